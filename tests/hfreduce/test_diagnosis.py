"""The pieces of issue 29's detection, in one process: the flight recorder's sends, receives and in-flight count,
a timeout's blame (the rank that never called the collective, not a live relay), the watch's news, and what
``fireflyer hfreduce trace`` makes of sends and receives and of waits that go round among live ranks.
The same behaviour through ``torch.distributed`` on real ranks is ``test_chaos.py``'s."""

from __future__ import annotations

import datetime
import os
import threading

import pytest
import torch.distributed as dist

from fireflyer.hfreduce.diagnosis import trace_report
from fireflyer.hfreduce.errors import CollectiveTimeout, HFReduceError, PeerFailure, error_from_text, fresh
from fireflyer.hfreduce.engine.failures import Failures
from fireflyer.hfreduce.diagnosis.flight import FlightRecorder
from fireflyer.hfreduce.engine.watch import Watch
from fireflyer.testing.waiting import wait_until


def recorder(folder, rank: int = 0, world: int = 4, capacity: int | None = None) -> FlightRecorder:
    return FlightRecorder(rank=rank, world_size=world, global_ranks=list(range(world)), group_name="0",
                          dump_dir=folder, capacity=capacity)


def collective(fr: FlightRecorder, seq: int, op: str = "allgather") -> None:
    fr.record(seq, op, input_sizes=[[8]], input_dtypes=["float32"], output_sizes=[[32]], output_dtypes=["float32"],
              timeout_s=5.0)


# -- the recorder --------------------------------------------------------------------------------------------

def test_sends_and_receives_are_numbered_apart_from_the_collectives_and_named_as_torch_parses_them(tmp_path):
    fr = recorder(tmp_path, rank=1)
    collective(fr, 0)
    send = fr.record_p2p("send", 2, sizes=[[4]], dtypes=["float32"], timeout_s=5.0)
    recv = fr.record_p2p("recv", 0, sizes=[[4]], dtypes=["float32"], timeout_s=5.0)
    collective(fr, 1)
    assert fr.in_flight() == 4 and fr.open_collectives() == [(0, "allgather"), (1, "allgather")]
    for key in (0, send, recv, 1):
        fr.completed(key)
    assert fr.in_flight() == 0 and fr.settled == 4
    es = fr.entries()
    assert [(e["op"], e["is_p2p"], e["collective_seq_id"], e["p2p_seq_id"]) for e in es] == [
        ("allgather", False, 0, 0), ("send", True, 0, 1), ("recv", True, 0, 2), ("allgather", False, 1, 0)]
    assert [e["profiling_name"] for e in es[1:3]] == ["nccl:send 1->2", "nccl:recv 1<-0"]
    assert es[1]["peer"] == 2 and es[0]["peer"] is None and all(e["state"] == "completed" for e in es)


def test_what_is_in_flight_is_known_with_recording_off(tmp_path):
    fr = recorder(tmp_path, capacity=0)
    collective(fr, 0, "gather")
    key = fr.record_p2p("recv", 3, sizes=[[4]], dtypes=["float32"], timeout_s=5.0)
    assert fr.in_flight() == 2 and fr.open_collectives() == [(0, "gather")] and fr.entries() == []
    fr.failed(0, "boom")
    fr.completed(key)
    assert fr.in_flight() == 0 and fr.settled == 2


# -- a timeout's blame ---------------------------------------------------------------------------------------

class _Positions:
    """A watch that answers as the ranks would: how many of the group's collectives each has called."""

    pending = None

    def __init__(self, answers: dict[int, int], silent: list[int]) -> None:
        self.answers, self.silent, self.published = answers, silent, []

    def positions(self, patience: float):
        return dict(self.answers), list(self.silent)

    def publish(self, text: str) -> None:
        self.published.append(text)


def failures(tmp_path, watch) -> tuple[Failures, FlightRecorder]:
    fr = recorder(tmp_path, rank=2)
    f = Failures(rank=2, members=[2, 3], pids=[os.getpid()] * 4, describe=lambda r: f"rank {r} (node {r // 2})",
                 store=dist.HashStore(), arena=None, flight=fr, running=lambda: None)
    if watch is not None:
        f.attach(watch)
    return f, fr


def test_a_timeout_names_the_rank_that_never_called_the_collective_not_the_relay_it_waited_on(tmp_path):
    watch = _Positions({0: 7, 1: 6, 3: 7}, [])
    f, fr = failures(tmp_path, watch)
    for seq in (6,):
        collective(fr, seq, "reduce_scatter")
    error = f.fail(CollectiveTimeout("timed out waiting for rank 3 (node 1) while receiving reduce_scatter"))
    assert isinstance(error, CollectiveTimeout)
    assert str(error) == ("reduce_scatter (#6) did not finish within its timeout on rank 2 (node 1): rank 1 (node 0) "
                          "never called it (the last collective it called is #5)")
    assert watch.published == [f"CollectiveTimeout|{error}"]
    assert fr.entries()[-1]["waiting_on"] == [1]


def test_with_every_rank_there_the_silent_one_is_named_and_else_the_timeout_keeps_its_words(tmp_path):
    f, fr = failures(tmp_path, _Positions({0: 3, 3: 3}, [1]))
    collective(fr, 2)
    assert "rank 1 (node 0) did not answer" in str(f.fail(CollectiveTimeout("waiting for rank 3")))
    f, fr = failures(tmp_path, _Positions({0: 3, 1: 3, 3: 3}, []))
    collective(fr, 2)
    assert str(f.fail(CollectiveTimeout("waiting for rank 3"))) == "waiting for rank 3"


def test_a_relayed_timeout_is_not_blamed_again_nor_published(tmp_path):
    watch = _Positions({0: 0, 1: 0, 3: 0}, [])
    f, fr = failures(tmp_path, watch)
    collective(fr, 0)
    relayed = error_from_text("CollectiveTimeout|allgather (#0) ...: rank 1 (node 0) never called it")
    assert relayed.relayed and fresh(relayed).relayed
    assert f.fail(relayed) is relayed and watch.published == []


def test_news_that_came_while_idle_fails_the_next_wait(tmp_path):
    watch = _Positions({}, [])
    f, _ = failures(tmp_path, watch)
    watch.pending = error_from_text("PeerFailure|rank 0 (node 0), pid 1, died")
    with pytest.raises(PeerFailure, match="rank 0"):
        f.check()


# -- the watch, on a real store --------------------------------------------------------------------------------

def test_the_watch_brings_a_published_error_and_answers_positions(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    adopted: list[BaseException] = []
    busy = threading.Event()
    watches = [Watch(rank=r, world_size=2, store=dist.PrefixStore("w", store), members=[r], pids=[os.getpid()] * 2,
                     progress=lambda: (1 if busy.is_set() else 0, 0), position=lambda r=r: 5 + r,
                     died=lambda r: PeerFailure(f"rank {r} died"), adopt=adopted.append) for r in range(2)]
    for w in watches:
        w.start()
    try:
        assert watches[0].positions(5.0) == ({1: 6}, [])
        watches[1].publish("PeerFailure|rank 9 died")  # rank 1 failed; rank 0 has nothing in flight: kept for later
        pending = wait_until(lambda: watches[0].pending, 10, "the news on rank 0")
        assert isinstance(pending, PeerFailure) and pending.relayed and str(pending) == "rank 9 died"
        busy.set()  # rank 0 starts a collective: the news fails it
        wait_until(lambda: adopted, 10, "the error adopted")
        assert isinstance(adopted[0], HFReduceError) and str(adopted[0]) == "rank 9 died"
    finally:
        for w in watches:
            w.close()
    assert not any(w._thread.is_alive() for w in watches)


# -- the trace -----------------------------------------------------------------------------------------------

def test_the_trace_names_a_late_rank_when_the_live_ranks_waits_go_round_among_themselves(tmp_path):
    keep = []
    for r in range(4):
        fr = recorder(tmp_path, rank=r)
        keep.append(fr)
        for seq in range(3 if r else 2):  # rank 0 never called #2
            collective(fr, seq)
            fr.started(seq)
            if seq < 2:
                fr.completed(seq)
        if r:
            fr.waiting(2, [1 + r % 3], "receiving from a relay")  # 1 -> 2 -> 3 -> 1
        fr.dump("CollectiveTimeout")
    (group,) = trace_report.analyse(trace_report.load(tmp_path), str(tmp_path))["groups"]
    assert [s["rank"] for s in group["waited_for"]] == [0] and group["wait_cycle"] == []
    assert group["waited_for"][0]["why"] == "never reached this collective; last completed #1"


def test_the_trace_reports_sends_and_receives_still_pending_and_the_peer_they_wait_for(tmp_path):
    keep = []
    for r in range(1, 4):  # rank 0 left no dump; rank 1 waits to receive from it, rank 2 from rank 1
        fr = recorder(tmp_path, rank=r)
        keep.append(fr)
        collective(fr, 0)
        fr.completed(0)
        if r < 3:
            key = fr.record_p2p("recv", r - 1, sizes=[[4]], dtypes=["float32"], timeout_s=5.0)
            fr.waiting(key, [r - 1], "receiving from the rank before")
            fr.failed(key, "CollectiveTimeout: ...")
        fr.dump("CollectiveTimeout")
    analysis = trace_report.analyse(trace_report.load(tmp_path), str(tmp_path))
    (group,) = analysis["groups"]
    assert group["first_incomplete"] is None
    assert [(p["rank"], p["op"], p["peer"], p["state"]) for p in group["p2p_pending"]] == [
        (1, "recv", 0, "failed"), (2, "recv", 1, "failed")]
    assert [s["rank"] for s in group["waited_for"]] == [0]
    text = "\n".join(line for line, _ in trace_report.render(analysis))
    assert "rank 1       recv from rank 0: failed" in text and "=> everyone waited for rank 0: no dump" in text
