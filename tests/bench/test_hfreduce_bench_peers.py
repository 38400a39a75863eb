"""The peers of `fireflyer bench allreduce` (OpenMPI, DeepSpeed SHM): their absence, their dtypes
and layouts, their launch commands and DeepSpeed's /dev/shm clean-up. Nothing is installed or
started: the probes get fake PATHs, package versions and builds."""

from __future__ import annotations

import subprocess

import pytest

from fireflyer.bench import allreduce_peers as peers


def _no_version(_name: str) -> str | None:
    return None


def _run_ok(stdout: str, rc: int = 0, stderr: str = ""):
    def run(argv, **kw):
        return subprocess.CompletedProcess(argv, rc, stdout=stdout, stderr=stderr)

    return run


def test_openmpi_absent_is_skipped_with_a_note() -> None:
    st = peers.probe_openmpi(which=lambda _c: None, version=_no_version)
    assert not st.available
    assert "mpirun" in st.note and "mpi4py" in st.note and "apt-get install openmpi-bin" in st.note
    st = peers.probe_openmpi(which=lambda _c: "/usr/bin/mpirun", version=_no_version)
    assert not st.available and "mpi4py not installed" in st.note and "mpirun" not in st.note.split(":")[1]


def test_openmpi_present_and_not_open_mpi() -> None:
    st = peers.probe_openmpi(which=lambda _c: "/usr/bin/mpirun", version=lambda _n: "4.1.2",
                             run=_run_ok("mpirun (Open MPI) 4.1.4\n\nReport bugs\n"))
    assert st.available and st.version == "Open MPI 4.1.4, mpi4py 4.1.2" and st.note is None
    st = peers.probe_openmpi(which=lambda _c: "/usr/bin/mpirun", version=lambda _n: "4.1.2",
                             run=_run_ok("HYDRA build details:\n"))
    assert not st.available and "is not Open MPI" in st.note


def test_deepspeed_absent_or_unbuildable_is_skipped() -> None:
    st = peers.probe_deepspeed(60, version=_no_version)
    assert not st.available and "DS_BUILD_OPS=0" in st.note and "deepspeed==0.19.8" in st.note

    st = peers.probe_deepspeed(60, version=lambda _n: "0.19.8", run=_run_ok("", rc=1, stderr="ninja: not found\n"))
    assert not st.available and st.version == "0.19.8" and "ninja: not found" in st.note

    def slow(argv, **kw):
        raise subprocess.TimeoutExpired(argv, kw["timeout"])

    st = peers.probe_deepspeed(5, version=lambda _n: "0.19.8", run=slow)
    assert not st.available and "within 5 s" in st.note


def test_deepspeed_built_reports_its_kernel_level() -> None:
    said = []
    st = peers.probe_deepspeed(60, said.append, version=lambda _n: "0.19.8",
                               run=_run_ok("DeepSpeed built\nFIREFLYER_DS_LEVEL 1\n"))
    assert st.available and st.kernel_level == 1 and st.to_json()["kernel_level"] == 1
    assert said and "JIT-builds" in said[0]
    assert peers.parse_build_output("FIREFLYER_DS_LEVEL x\n") is None
    assert peers.parse_build_output("nothing\n") is None


def test_probe_asks_only_for_the_named_peers() -> None:
    assert peers.probe((), 1, lambda _m: None) == {}


def test_dtype_notes() -> None:
    assert peers.dtype_note(peers.OPENMPI, "fp32") is None
    assert peers.dtype_note(peers.OPENMPI, "bf16") == "n/a: MPI has no bf16 type"
    assert peers.dtype_note(peers.DEEPSPEED, "fp32", 1) is None
    assert peers.dtype_note(peers.DEEPSPEED, "bf16", 2) is None
    assert "AVX-512BW" in peers.dtype_note(peers.DEEPSPEED, "bf16", 1)
    assert "AVX2" in peers.dtype_note(peers.DEEPSPEED, "fp32", 0)
    assert peers.dtype_note("gloo", "bf16") is None


def test_cpu_flags_decide_deepspeeds_level() -> None:
    cpuinfo = "processor\t: 0\nmodel name\t: x\nflags\t\t: fpu sse avx2 f16c avx512f avx512bw\n"
    flags = peers.cpu_flags(cpuinfo)
    assert {"avx2", "avx512bw"} <= flags
    assert peers.level_from_flags(flags) == 2
    assert peers.level_from_flags({"avx2", "f16c"}) == 1
    assert peers.level_from_flags(set()) == 0
    assert peers.cpu_flags("no flags here") == set()


@pytest.mark.parametrize("peer", peers.PEERS)
def test_layout_notes(peer: str) -> None:
    assert peers.layout_note(peer, 1, 4, False) == (True, None)
    runs, note = peers.layout_note(peer, 2, 2, False)
    assert runs and "4 ranks on one host" in note and "2 emulated nodes" in note
    runs, note = peers.layout_note(peer, 2, 2, True)
    assert not runs and "skipped" in note


def test_launch_commands() -> None:
    argv = peers.mpirun_argv("/usr/bin/mpirun", 4, ["python", "-m", "w"], ("OMP_NUM_THREADS",))
    assert argv == ["/usr/bin/mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4",
                    "-x", "OMP_NUM_THREADS", "python", "-m", "w"]
    env = peers.deepspeed_env({"RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 4)
    assert env == {"RANK": "1", "LOCAL_WORLD_SIZE": "2", "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "4"}


def test_remove_deepspeed_shm_removes_only_this_rendezvous(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(peers.os, "getuid", lambda: 0)
    ours = peers.deepspeed_shm_paths(0, "127.0.0.1", 29611, 3, str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in ours] == [f"deepspeed_allreduce_buffer_0_127.0.0.1_29611_{r}"
                                                   for r in range(3)]
    other = tmp_path / "deepspeed_allreduce_buffer_0_127.0.0.1_29612_0"
    for p in [*ours[:2], other]:
        open(p, "wb").close()
    assert peers.remove_deepspeed_shm("127.0.0.1", 29611, 3, str(tmp_path)) == ours[:2]
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name]


def test_install_help_names_the_extra() -> None:
    assert "'.[bench]'" in peers.INSTALL_HELP and "openmpi-bin" in peers.INSTALL_HELP
    assert "DS_BUILD_OPS=0" in peers.INSTALL_HELP


# -- the parent's side of the control socket, with threads as ranks ---------------------------


def _rank_threads(control: str, set_name: str, world: int, setup) -> list:
    import threading

    from fireflyer.bench import allreduce_worker as bench_worker

    spec = {"control": control, "set": set_name, "idle_timeout_s": 30.0}

    def rank(r: int) -> None:
        try:
            bench_worker.run_rank(spec, r, world, lambda: setup(r))
        except BaseException:  # a failed setup is reported over the channel; a lost parent ends the rank
            pass

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    return threads


def test_accept_call_and_finish_a_set(tmp_path) -> None:
    import socket

    control = str(tmp_path / "c.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(control)
    server.listen(8)

    def setup(r: int):
        info = {"dtypes": {"candidate": {"fp32": None, "bf16": "n/a: no bf16 here"}}}
        return {"candidate": lambda buf: lambda: None}, lambda: None, {"who": lambda cmd: {"rank": r}}, info

    threads = _rank_threads(control, "torch", 2, setup)
    st = peers.ProcessSet("torch", 2, lambda r: str(tmp_path / f"{r}.log"))
    try:
        peers.accept(server, {"torch": st}, 30, [])
        assert st.ready and st.dtype_note("candidate", "bf16") == "n/a: no bf16 here"
        assert st.dtype_note("candidate", "fp32") is None
        assert st.call({"cmd": "who"}, 10) == [{"rank": 0}, {"rank": 1}]
        replies = st.call({"cmd": "round", "system": "candidate", "dtype": "fp32", "bytes": 64, "ops": 3,
                           "warmup": 1, "size_index": 0, "dtype_index": 0}, 10)
        assert [len(r["times"]) for r in replies] == [3, 3]
        assert all(r["wrong"] > 0 for r in replies)  # doing nothing is not an allreduce of 2 ranks
        st.finish(10)
    finally:
        st.kill()
        server.close()
    for t in threads:
        t.join(10)
        assert not t.is_alive()


def test_a_rank_that_fails_to_set_up_names_its_set(tmp_path) -> None:
    import socket

    control = str(tmp_path / "c.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(control)
    server.listen(8)

    import threading

    rank0_connected = threading.Event()

    def setup(r: int):
        if r == 1:
            # fail only once rank 0 has connected (on a busy host its thread may start late): rank 0
            # is then either known to the set or still pending, and the clean-up below ends it either way
            rank0_connected.wait(30)
            raise RuntimeError("no shm op")
        rank0_connected.set()
        return {}, lambda: None, {}, {"dtypes": {}}

    threads = _rank_threads(control, peers.DEEPSPEED, 2, setup)
    st = peers.ProcessSet(peers.DEEPSPEED, 2, lambda r: str(tmp_path / f"{r}.log"))
    pending: list = []
    try:
        with pytest.raises(peers.SetFailed) as err:
            peers.accept(server, {peers.DEEPSPEED: st}, 30, pending)
        assert err.value.set_name == peers.DEEPSPEED and "rank 1" in str(err.value) and "no shm op" in str(err.value)
    finally:
        st.kill()  # closes the channels: rank 0 sees the parent go away
        peers.close_pending(pending)
        server.close()
    for t in threads:
        t.join(10)
        assert not t.is_alive()
