"""The flight recorder: its ring buffer, its dumps, and torch's own analyzer reading them."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest

from fireflyer.hfreduce.diagnosis import flight
from fireflyer.hfreduce.diagnosis.flight import FlightRecorder

F32 = ["float32"]


def recorder(tmp_path: Path, rank: int = 0, world: int = 4, **kw) -> FlightRecorder:
    kw.setdefault("global_ranks", list(range(world)))
    kw.setdefault("group_name", "0")
    return FlightRecorder(rank=rank, world_size=world, dump_dir=tmp_path, **kw)


def allreduce(fr: FlightRecorder, seq: int, n: int = 1024, op: str = "allreduce") -> None:
    fr.record(seq, op, input_sizes=[[n]], input_dtypes=F32, output_sizes=[[n]], output_dtypes=F32, timeout_s=60)


# ---------------------------------------------------------------------- the ring buffer
def test_the_ring_wraps_at_capacity_and_keeps_the_newest(tmp_path):
    fr = recorder(tmp_path, capacity=3)
    for seq in range(5):
        allreduce(fr, seq)
    entries = fr.entries()
    assert [e["collective_seq_id"] for e in entries] == [2, 3, 4]
    assert [e["record_id"] for e in entries] == [2, 3, 4]
    fr.started(0)  # aged out: ignored
    fr.completed(1)
    assert all(e["state"] == "scheduled" for e in fr.entries())
    allreduce(fr, 5)
    assert [e["collective_seq_id"] for e in fr.entries()] == [3, 4, 5]


class Kept:
    """A ledger as the C++ door keeps one (its protocol, flight.Ledger): collectives the recorder never saw."""

    def __init__(self, fr: FlightRecorder) -> None:
        self.fr, self.rows, self.current = fr, [], None

    def run(self, seq: int, *, done: bool = True) -> None:
        now = 1_000 + seq
        self.rows.append([next(self.fr.record_ids), seq, now, now, now + 1 if done else None, 60_000, 7,
                          ([[8]], F32, [[8]], F32)])
        self.current = None if done else seq

    def counts(self):
        return (int(self.current is not None), sum(r[4] is not None for r in self.rows), len(self.rows))

    def last(self):
        seqs = [r[1] for r in self.rows]
        done = [r[1] for r in self.rows if r[4] is not None]
        return (max(seqs, default=-1), max(seqs, default=-1), max(done, default=-1))

    def open_collectives(self):
        return [] if self.current is None else [(self.current, "allreduce")]

    def records(self):
        return [tuple(r) for r in self.rows[-self.fr.capacity:]]


def test_a_ledgers_collectives_are_merged_into_everything_the_recorder_reports(tmp_path):
    fr = recorder(tmp_path, capacity=4)
    kept = Kept(fr)
    fr.attach(kept)
    allreduce(fr, 0)
    fr.completed(0)
    kept.run(1)
    kept.run(2)
    allreduce(fr, 3, op="broadcast")
    kept.run(4, done=False)
    # the newest 4 by record id, the ledger's and the recorder's side by side
    assert [e["collective_seq_id"] for e in fr.entries()] == [1, 2, 3, 4]
    assert [e["state"] for e in fr.entries()] == ["completed", "completed", "scheduled", "started"]
    assert fr.entries()[0]["input_sizes"] == [[8]] and fr.entries()[0]["duration_ms"] == 1e-6
    assert fr.in_flight() == 2 and fr.settled == 3
    assert fr.open_collectives() == [(3, "broadcast"), (4, "allreduce")]
    info = fr._group_info()
    assert (info["recorded"], info["dropped"]) == (5, 1)
    assert (info["last_enqueued_collective"], info["last_started_collective"],
            info["last_completed_collective"]) == (4, 4, 2)
    dumped = json.loads(flight.json_path(tmp_path, 0).read_text()) if fr.dump("test") else None
    assert [e["collective_seq_id"] for e in dumped["entries"]] == [1, 2, 3, 4]


def test_a_ledger_is_held_weakly(tmp_path):
    fr = recorder(tmp_path, capacity=4)
    kept = Kept(fr)
    fr.attach(kept)
    kept.run(0)
    assert fr.settled == 1
    del kept
    assert fr.settled == 0 and fr.entries() == [] and fr.in_flight() == 0


def test_a_reused_slot_keeps_nothing_of_the_collective_it_held(tmp_path):
    fr = recorder(tmp_path, capacity=2)
    allreduce(fr, 0, n=7)
    fr.waiting(0, [3], "reduce of chunk 0 of 1")
    fr.failed(0, "PeerFailure: rank 3 died")
    allreduce(fr, 1)
    allreduce(fr, 2, n=9, op="broadcast")  # takes seq 0's slot
    fr.completed(0)  # aged out: must not touch the slot's new collective
    e = fr.entries()[-1]
    assert e["collective_seq_id"] == 2 and e["profiling_name"] == "nccl:broadcast" and e["input_sizes"] == [[9]]
    assert e["state"] == "scheduled" and not e["retired"] and e["error"] is None
    assert e["waiting_on"] == [] and e["waiting_for"] is None and e["time_discovered_started_ns"] is None


def test_states_from_scheduled_to_completed_or_failed(tmp_path):
    fr = recorder(tmp_path, rank=1, global_ranks=[4, 6, 8, 10], group_desc="dp")
    allreduce(fr, 0)
    allreduce(fr, 1)
    (e,) = [e for e in fr.entries() if e["collective_seq_id"] == 0]
    assert e["state"] == "scheduled" and e["time_discovered_started_ns"] is None and not e["retired"]
    assert e["profiling_name"] == "nccl:all_reduce" and e["process_group"] == ("0", "dp")
    assert e["timeout_ms"] == 60_000 and e["input_sizes"] == [[1024]] and e["is_p2p"] is False

    fr.started(0)
    fr.waiting(0, [2, 3], "reduce of chunk 3 of 8")
    e = fr.entries()[0]
    assert e["state"] == "started" and e["time_discovered_started_ns"] is not None
    assert e["waiting_on"] == [2, 3] and e["waiting_on_global"] == [8, 10]
    assert e["waiting_for"] == "reduce of chunk 3 of 8"

    fr.completed(0)
    e = fr.entries()[0]
    assert e["state"] == "completed" and e["retired"] and e["duration_ms"] >= 0
    assert e["waiting_on"] == [] and e["waiting_for"] is None

    fr.waiting(1, [3], "broadcast of chunk 0 of 1")  # waiting implies started
    fr.failed(1, "PeerFailure: rank 10 died")
    e = fr.entries()[1]
    assert e["state"] == "started" and e["retired"] and e["error"] == "PeerFailure: rank 10 died"
    assert e["waiting_on_global"] == [10], "whom a failed collective waited on is kept"
    assert "duration_ms" not in e


def test_entries_are_copies(tmp_path):
    fr = recorder(tmp_path)
    allreduce(fr, 0)
    fr.entries()[0]["input_sizes"].append([1])
    assert fr.entries()[0]["input_sizes"] == [[1024]]


def test_concurrent_recording_and_dumping(tmp_path):
    fr = recorder(tmp_path, capacity=64)
    errors: list[BaseException] = []

    def collectives(first: int) -> None:
        try:
            for seq in range(first, first + 2000, 4):
                allreduce(fr, seq)
                fr.started(seq)
                fr.waiting(seq, [1], "x")
                fr.completed(seq)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def reader() -> None:
        try:
            for _ in range(20):
                fr.entries()
                fr.dump("while running")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=collectives, args=(i,)) for i in range(4)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    entries = fr.entries()
    assert len(entries) == 64 and all(e["state"] == "completed" for e in entries)
    assert len({e["record_id"] for e in entries}) == 64
    info = fr._group_info()
    assert info["recorded"] == 2000 and info["dropped"] == 2000 - 64 and info["last_completed_collective"] >= 1996


def test_unknown_op_and_bad_arguments(tmp_path):
    fr = recorder(tmp_path)
    with pytest.raises(ValueError, match="allreduce"):
        allreduce(fr, 0, op="scan")
    with pytest.raises(ValueError, match="rank"):
        FlightRecorder(rank=4, world_size=4, global_ranks=[0, 1, 2, 3], group_name="0", dump_dir=tmp_path)
    with pytest.raises(ValueError, match="global_ranks"):
        FlightRecorder(rank=0, world_size=4, global_ranks=[0, 1], group_name="0", dump_dir=tmp_path)


# ---------------------------------------------------------------------- configuration
def test_capacity_zero_disables(tmp_path, monkeypatch):
    monkeypatch.setenv(flight.BUFFER_ENV, "0")
    fr = recorder(tmp_path)
    assert fr.capacity == 0
    allreduce(fr, 0)
    fr.started(0)
    fr.waiting(0, [1], "x")
    fr.completed(0)
    fr.failed(0, "boom")
    assert fr.entries() == [] and fr.dump("why") is None
    assert list(tmp_path.iterdir()) == []


def test_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(flight.BUFFER_ENV, "7")
    monkeypatch.setenv(flight.DIR_ENV, str(tmp_path / "traces"))
    fr = FlightRecorder(rank=0, world_size=1, global_ranks=[0], group_name="0")
    assert fr.capacity == 7 and fr.dump_dir == tmp_path / "traces"
    monkeypatch.setenv(flight.BUFFER_ENV, "lots")
    with pytest.raises(ValueError, match=flight.BUFFER_ENV):
        FlightRecorder(rank=0, world_size=1, global_ranks=[0], group_name="0")


def test_default_dump_dir_is_one_folder_per_job():
    tmp = Path(__import__("tempfile").gettempdir()) / "fireflyer-hfreduce-trace"
    assert flight.default_dump_dir({"SLURM_JOB_ID": "42"}) == tmp / "slurm-42"
    assert flight.default_dump_dir({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}) == tmp / "slurm-42-restart1"
    assert flight.default_dump_dir({"TORCHELASTIC_RUN_ID": "abc", "MASTER_PORT": "1"}) == tmp / "torchrun-abc"
    assert flight.default_dump_dir({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "10.0.0.1",
                                    "MASTER_PORT": "29500"}) == tmp / "10.0.0.1-29500"
    assert flight.default_dump_dir({}) == tmp / f"pid-{os.getpid()}"
    assert flight.default_dump_dir({"FIREFLYER_TASK_DIR": "/p/tasks/7", "FIREFLYER_ATTEMPT": "2",
                                    "SLURM_JOB_ID": "1"}) == Path("/p/tasks/7/hfreduce-trace/attempt-2")
    assert flight.default_dump_dir({flight.DIR_ENV: "/x", "FIREFLYER_TASK_DIR": "/p"}) == Path("/x")


# ---------------------------------------------------------------------- dumps
def test_dump_writes_a_torch_pickle_and_a_json_twin(tmp_path):
    fr = recorder(tmp_path, rank=2, group_desc="default_pg")
    for seq in range(3):
        allreduce(fr, seq)
        fr.started(seq)
    fr.completed(0)
    fr.waiting(2, [3], "reduce of chunk 1 of 2")
    path = fr.dump("CollectiveTimeout: allreduce #2")
    assert path == tmp_path / "hfreduce_trace_rank_2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hfreduce_rank_2.json", "hfreduce_trace_rank_2"]

    ours = json.loads((tmp_path / "hfreduce_rank_2.json").read_text())
    assert ours["format"] == flight.FORMAT and ours["rank"] == 2 and ours["reason"].startswith("CollectiveTimeout")
    assert ours["pid"] == os.getpid() and ours["hostname"]
    assert ours["groups"]["0"]["global_ranks"] == [0, 1, 2, 3] and ours["groups"]["0"]["rank"] == 2
    assert ours["entries"][2]["waiting_on_global"] == [3]

    from torch.distributed.flight_recorder.components.loader import read_dump

    theirs = read_dump(flight.PICKLE_PREFIX, str(path))  # torch's loader unpickles it; our reader never does
    assert theirs["rank"] == 2 and theirs["version"] == flight.FR_VERSION
    assert theirs["pg_config"] == {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}}
    assert [e["state"] for e in theirs["entries"]] == ["completed", "started", "started"]
    # the JSON holds the same entries, plus hfreduce's extras
    for mine, torch_entry in zip(ours["entries"], theirs["entries"]):
        assert {k: mine[k] for k in torch_entry} == json.loads(json.dumps(torch_entry))
        assert "waiting_on" in mine and "waiting_on" not in torch_entry


def test_dump_is_atomic(tmp_path, monkeypatch):
    fr = recorder(tmp_path)
    allreduce(fr, 0)
    fr.dump("first")
    before = (tmp_path / "hfreduce_rank_0.json").read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(flight.os, "replace", broken_replace)
    allreduce(fr, 1)
    with pytest.raises(OSError, match="disk full"):
        fr.dump("second")
    assert (tmp_path / "hfreduce_rank_0.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hfreduce_rank_0.json", "hfreduce_trace_rank_0"]


def test_groups_of_one_process_share_one_file_pair(tmp_path):
    world = recorder(tmp_path, rank=1, world=4, group_name="pending")
    sub = recorder(tmp_path, rank=0, world=2, global_ranks=[1, 3], group_name="1", group_desc="tp")
    world.group_name = "0"  # torch names a group after its backend exists
    world.group_desc = "default_pg"
    allreduce(world, 0)
    allreduce(sub, 0, n=8)
    sub.waiting(0, [1], "reduce of chunk 0 of 1")
    allreduce(world, 1)
    path = sub.dump("PeerFailure")
    assert path == world.dump("PeerFailure")
    ours = json.loads((tmp_path / "hfreduce_rank_1.json").read_text())
    assert set(ours["groups"]) == {"0", "1"}
    assert [(e["process_group"][0], e["collective_seq_id"]) for e in ours["entries"]] == [("0", 0), ("1", 0), ("0", 1)]
    assert [e["record_id"] for e in ours["entries"]] == sorted(e["record_id"] for e in ours["entries"])
    assert ours["entries"][1]["waiting_on_global"] == [3]
    assert ours["pg_config"]["1"] == {"name": "1", "desc": "tp", "ranks": "[1, 3]"}


# ---------------------------------------------------------------------- a simulated 4-rank job
def job(folder: Path, *, dead: int | None = None, odd_rank: int | None = None, stuck: int = 5,
        world: int = 4) -> list[FlightRecorder]:
    """Ranks that ran collectives 0..stuck-1 to completion and hang in #stuck.

    ``dead``: that rank wrote no dump; the others wait on it. ``odd_rank``: that rank called
    #stuck with twice the size of the others; everyone waits on the next rank in a ring.
    """
    recorders = []
    for r in range(world):
        fr = FlightRecorder(rank=r, world_size=world, global_ranks=list(range(world)), group_name="0",
                            group_desc="default_pg", dump_dir=folder)
        for seq in range(stuck + 1):
            allreduce(fr, seq, n=2048 if (r == odd_rank and seq == stuck) else 1024)
            fr.started(seq)
            if seq < stuck:
                fr.completed(seq)
        if dead is not None:
            fr.waiting(stuck, [dead], "reduce of chunk 3 of 8")
        else:
            fr.waiting(stuck, [(r + 1) % world], "reduce of chunk 0 of 1")
        recorders.append(fr)
    for r, fr in enumerate(recorders):
        if r != dead:
            fr.dump(f"CollectiveTimeout: allreduce (#{stuck}) did not finish within 60s")
    return recorders


@pytest.fixture
def dead_rank_job(tmp_path):
    folder = tmp_path / "dead"
    keep = job(folder, dead=3)
    yield folder
    del keep


@pytest.fixture
def mismatch_job(tmp_path):
    folder = tmp_path / "mismatch"
    keep = job(folder, odd_rank=0)
    yield folder
    del keep


def fr_trace(args: list[str], caplog) -> str:
    from torch.distributed.flight_recorder import fr_trace as torch_fr_trace

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="Flight Recorder"):
        torch_fr_trace.main(args)
    return caplog.text


def test_torchs_analyzer_names_the_dead_rank(dead_rank_job, caplog):
    assert sorted(p.name for p in dead_rank_job.iterdir() if "trace" in p.name) == [
        "hfreduce_trace_rank_0", "hfreduce_trace_rank_1", "hfreduce_trace_rank_2"]
    with pytest.raises(AssertionError, match=r"Missing dump files from ranks \{3\}"):
        fr_trace([str(dead_rank_job)], caplog)
    log = fr_trace([str(dead_rank_job), "--allow-incomplete-ranks"], caplog)
    assert "missed FR dumps from ranks ({3})" in log


def test_torchs_analyzer_reports_the_mismatch(mismatch_job, caplog):
    log = fr_trace([str(mismatch_job)], caplog)
    assert "Collective sequence number: 5 has errors" in log
    assert "SIZE_OR_SYNTAX_MISMATCH" in log and "[[2048]]" in log and "[[1024]]" in log
    assert "collective: nccl:all_reduce" in log


def test_torchs_analyzer_reads_several_groups(tmp_path, caplog):
    keep = []
    for r in range(4):
        world = recorder(tmp_path, rank=r, group_desc="default_pg")
        pair = recorder(tmp_path, rank=r % 2, world=2, global_ranks=[r - r % 2, r - r % 2 + 1],
                        group_name=f"pair{r // 2}")
        for seq in range(3):
            for fr in (world, pair):
                allreduce(fr, seq)
                fr.started(seq)
                fr.completed(seq)
        # all_gather's output and reduce_scatter's input are the whole buffer: world_size times the other side
        world.record(3, "allgather", input_sizes=[[8]], input_dtypes=F32, output_sizes=[[32]], output_dtypes=F32,
                     timeout_s=60)
        world.record(4, "reduce_scatter", input_sizes=[[32]], input_dtypes=F32, output_sizes=[[8]],
                     output_dtypes=F32, timeout_s=60)
        world.record(5, "broadcast", input_sizes=[[3]], input_dtypes=F32, output_sizes=[[3]], output_dtypes=F32,
                     timeout_s=60)
        for seq in (3, 4, 5):
            world.completed(seq)
        keep += [world, pair]
    for fr in keep[::2]:
        fr.dump("test")
    log = fr_trace([str(tmp_path)], caplog)
    assert "has errors" not in log and "Not all ranks" not in log and "missed FR dumps" not in log


# ---------------------------------------------------------------------- fireflyer hfreduce trace DIR
def trace(capsys, *args: str) -> tuple[int, str, str]:
    from fireflyer import cli

    code = cli.main(["hfreduce", "trace", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_trace_names_the_rank_everyone_waited_for(dead_rank_job, capsys):
    code, out, err = trace(capsys, dead_rank_job)
    assert code == 0, err
    assert "MISSING rank 3" in out
    assert "first collective not completed everywhere: #5 allreduce in [[1024]] float32" in out
    assert "ranks 0-2    started, waiting on rank 3 for reduce of chunk 3 of 8" in out
    assert ("=> everyone waited for rank 3: no dump (dead, or hung outside hfreduce); "
            "waited on directly by ranks 0-2") in out
    assert "MISMATCH" not in out
    assert "ranks 0-2 dumped because: CollectiveTimeout" in out
    assert "fr_trace" in out  # points at torch's analyzer too

    code, out, _ = trace(capsys, dead_rank_job, "--json")
    assert code == 0
    (group,) = json.loads(out)["groups"]
    assert group["missing"] == [3] and group["dumped"] == [0, 1, 2]
    assert [s["rank"] for s in group["waited_for"]] == [3] and group["waited_for"][0]["waited_on_by"] == [0, 1, 2]
    fi = group["first_incomplete"]
    assert fi["seq"] == 5 and [r["state"] for r in fi["ranks"]] == ["started"] * 3 + ["no dump"]
    assert group["mismatches"] == []


def test_trace_follows_a_chain_of_waits(tmp_path, capsys):
    keep = []
    for r, waits in enumerate([[1], [3], [3]]):  # 0 waits on 1, which waits on 3, like 2; 3 is dead
        fr = recorder(tmp_path, rank=r)
        allreduce(fr, 0)
        fr.waiting(0, waits, "broadcast of chunk 0 of 1")
        fr.dump("CollectiveTimeout")
        keep.append(fr)
    code, out, _ = trace(capsys, tmp_path, "--json")
    (group,) = json.loads(out)["groups"]
    assert [(s["rank"], s["waited_on_by"]) for s in group["waited_for"]] == [(3, [1, 2])]


def test_trace_reports_a_rank_that_never_got_there(tmp_path, capsys):
    keep = []
    for r in range(2):
        fr = recorder(tmp_path, rank=r, world=2)
        for seq in range(4 if r == 0 else 3):
            allreduce(fr, seq)
            fr.started(seq)
            if seq < 3:
                fr.completed(seq)
        if r == 0:
            fr.waiting(3, [1], "reduce of chunk 0 of 1")
        fr.dump("CollectiveTimeout" if r == 0 else "atexit")
        keep.append(fr)
    code, out, _ = trace(capsys, tmp_path)
    assert "rank 1       not reached (last completed #2)" in out
    assert "=> everyone waited for rank 1: never reached this collective; last completed #2" in out


def test_trace_reports_the_mismatch(mismatch_job, capsys):
    code, out, err = trace(capsys, mismatch_job)
    assert code == 0, err
    assert "MISMATCH at #5: rank 0: allreduce in [[2048]] float32 | ranks 1-3: allreduce in [[1024]] float32" in out
    assert "MISSING" not in out
    assert "wait on each other in a cycle" in out
    code, out, _ = trace(capsys, mismatch_job, "--json")
    (group,) = json.loads(out)["groups"]
    (m,) = group["mismatches"]
    assert m["seq"] == 5 and [v["ranks"] for v in m["variants"]] == [[0], [1, 2, 3]]
    assert m["variants"][0]["input_sizes"] == [[2048]]


def test_trace_as_a_subprocess(dead_rank_job):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "fireflyer.cli", "hfreduce", "trace", str(dead_rank_job)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "everyone waited for rank 3" in done.stdout and "MISSING rank 3" in done.stdout


def _garble(folder: Path) -> None:
    (folder / "hfreduce_rank_1.json").write_text('{"format": "fireflyer.hfreduce.trace", "rank": ')


def _not_ours(folder: Path) -> None:
    (folder / "hfreduce_rank_1.json").write_text('{"format": "something else", "rank": 1}')


def _wrong_shape(folder: Path) -> None:
    path = folder / "hfreduce_rank_1.json"
    data = json.loads(path.read_text())
    data["entries"][0]["input_sizes"] = "big"
    path.write_text(json.dumps(data))


def _outside_the_world(folder: Path) -> None:
    data = json.loads((folder / "hfreduce_rank_1.json").read_text())
    data["rank"] = 7
    (folder / "hfreduce_rank_7.json").write_text(json.dumps(data))


def _a_bigger_world(folder: Path) -> None:
    data = json.loads((folder / "hfreduce_rank_1.json").read_text())
    data["rank"] = 7
    data["groups"]["0"].update(rank=7, world_size=8, global_ranks=list(range(8)))
    (folder / "hfreduce_rank_7.json").write_text(json.dumps(data))


def _renamed(folder: Path) -> None:
    (folder / "hfreduce_rank_1.json").rename(folder / "hfreduce_rank_5.json")


@pytest.mark.parametrize("damage,needle", [
    (_garble, "not valid JSON"),
    (_not_ours, "not an hfreduce trace dump"),
    (_wrong_shape, "expected list"),
    (_outside_the_world, "rank 7 is outside group '0' (its ranks are 0-3)"),
    (_a_bigger_world, "disagree on group '0'"),
    (_renamed, "its name says rank 5"),
])
def test_trace_bad_dumps_are_one_line_and_exit_2(dead_rank_job, capsys, damage, needle):
    damage(dead_rank_job)
    code, out, err = trace(capsys, dead_rank_job)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def test_trace_bad_folders_are_one_line_and_exit_2(tmp_path, capsys):
    for folder, needle in [(tmp_path / "nope", "no such directory"), (tmp_path, "no hfreduce trace dumps")]:
        code, out, err = trace(capsys, folder)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and needle in err, err
    from fireflyer import cli

    assert cli.main(["hfreduce", "trace"]) == 2
    assert "DIR" in capsys.readouterr().err


def test_stacks_are_kept_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv(flight.STACK_ENV, "1")
    fr = recorder(tmp_path)
    allreduce(fr, 0)
    frames = fr.entries()[0]["frames"]
    assert frames[0]["name"] == "allreduce" and frames[1]["name"] == "test_stacks_are_kept_on_request"
    assert frames[1]["filename"] == __file__ and isinstance(frames[1]["line"], int)
    monkeypatch.delenv(flight.STACK_ENV)
    off = recorder(tmp_path, group_name="1")
    allreduce(off, 0)
    assert off.entries()[0]["frames"] == []


def test_trace_a_rank_stuck_on_itself(tmp_path, capsys):
    keep = []
    for r in range(3):
        fr = recorder(tmp_path, rank=r, world=3)
        allreduce(fr, 0)
        fr.started(0)
        if r != 2:
            fr.waiting(0, [2], "reduce of chunk 0 of 1")
        fr.dump("CollectiveTimeout")
        keep.append(fr)
    code, out, _ = trace(capsys, tmp_path)
    assert "=> everyone waited for rank 2: started it and waited on no one" in out


def test_a_rank_with_no_dump_is_the_suspect_when_the_live_ranks_wait_on_each_other(tmp_path, capsys):
    """What a real death looks like: the survivors' last waits are on each other's stages, not on the dead."""
    keep = []
    for r in range(3):  # rank 3 died and wrote nothing
        fr = recorder(tmp_path, rank=r)
        for seq in range(3):
            allreduce(fr, seq)
            fr.started(seq)
            if seq < 2:
                fr.completed(seq)
        fr.waiting(2, [(r + 1) % 3], "'out' of chunk 4 of 8")
        keep.append(fr)
    for fr in keep:
        fr.dump("PeerFailure: rank 3 died")
    code, out, _ = trace(capsys, tmp_path, "--json")
    assert code == 0
    (group,) = json.loads(out)["groups"]
    assert [s["rank"] for s in group["waited_for"]] == [3] and group["wait_cycle"] == []
