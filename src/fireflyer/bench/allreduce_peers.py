"""The peers of ``fireflyer bench allreduce`` (OpenMPI and DeepSpeed's CPU shared-memory
allreduce), and the process sets every system of a layout runs in.

A layout runs up to three process sets of N*L ranks: the torch ranks (the candidate and
gloo), DeepSpeed's ranks and OpenMPI's ranks under mpirun. :func:`start_sets` launches
them, :func:`accept` waits until each rank has connected to the parent's control socket
and said it is set up, and :class:`ProcessSet` sends them commands, reads their replies
and ends them.

Both are benchmark-only extras, measured in the same run as hfreduce and gloo, with
rounds alternating between the systems. Where one is not installed, the bench skips it
with a one-line note in its output and JSON; nothing else in fireflyer needs them.

Install them (Debian, into the project's venv; torch stays at constraints.txt's pin)::

    apt-get install openmpi-bin libopenmpi-dev
    DS_BUILD_OPS=0 .venv/bin/pip install -c constraints.txt -e '.[bench]'

(the ``bench`` extra is ``mpi4py`` and ``deepspeed==0.19.8``). DeepSpeed's shared-memory
op is built by g++ and ninja on first use, about a minute, and cached in
``~/.cache/torch_extensions``.

How each peer runs:

- **OpenMPI**: ``mpirun --allow-run-as-root --oversubscribe -np N`` starts N ranks of
  :mod:`fireflyer.bench.mpi_worker`, which call ``comm.Allreduce(MPI.IN_PLACE,
  buf)`` on numpy views of fp32 buffers. MPI has no bf16 type, so bf16 is n/a.
- **DeepSpeed**: N ranks of :mod:`fireflyer.bench.allreduce_worker` with torchrun's
  environment plus ``DS_ACCELERATOR=cpu`` and ``LOCAL_SIZE`` = N call
  ``deepspeed.init_distributed(dist_backend="gloo")`` and then
  ``torch.ops.deepspeed.inference_all_reduce_(buf)``. Its bf16 kernel needs AVX-512BW and
  its fp32 kernel AVX2; where the CPU lacks them that dtype is n/a (the kernel would fault
  and leave its peers spinning). Its shared-memory segments stay in /dev/shm after exit;
  the bench removes them after each layout.
- Both run on one host's shared memory: on an ``NxL`` layout with N > 1 they see N*L
  ranks on one host, not N nodes, and on a shaped layout they are skipped.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from fireflyer.bench.allreduce_report import Layout, LayoutResult
from fireflyer import lifetime
from fireflyer.launch import rank_env
from fireflyer.ports import free_port

OPENMPI = "openmpi"
DEEPSPEED = "deepspeed"
PEERS = (OPENMPI, DEEPSPEED)
CONNECT_TIMEOUT_S = 120.0
"""How long a rank retries connecting to the parent's control socket."""

INSTALL = {
    OPENMPI: "apt-get install openmpi-bin libopenmpi-dev && .venv/bin/pip install -c constraints.txt mpi4py",
    DEEPSPEED: "DS_BUILD_OPS=0 .venv/bin/pip install -c constraints.txt deepspeed==0.19.8 (g++ and ninja build its op)",
}
INSTALL_HELP = (
    "peers (benchmark-only extras; each is skipped with a note where absent):\n"
    "  apt-get install openmpi-bin libopenmpi-dev\n"
    "  DS_BUILD_OPS=0 .venv/bin/pip install -c constraints.txt -e '.[bench]'   # mpi4py, deepspeed==0.19.8\n"
    "DeepSpeed's shared-memory op is JIT-built by g++ and ninja on first use (about a minute)."
)

POLL_S = 0.1
"""Seconds between checks that a set's processes live while the parent waits on them."""
MPIRUN_FLAGS = ("--allow-run-as-root", "--oversubscribe")
DS_SHM_PREFIX = "deepspeed_allreduce_buffer"
"""DeepSpeed names rank r's segment ``{prefix}_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{r}`` (csrc/cpu/comm/shm.cpp)."""

# DeepSpeed's own probe (shm_interface.cpp, ``vector_kernel_level``): 2 = AVX-512BW, 1 = AVX2.
DS_LEVEL_NEEDED = {"fp32": 1, "bf16": 2}
DS_LEVEL_ISA = {1: "AVX2", 2: "AVX-512BW"}

_BUILD_SCRIPT = (
    "import os; os.environ.setdefault('DS_ACCELERATOR', 'cpu')\n"
    "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder\n"
    "m = ShareMemCommBuilder().load(verbose=False)\n"
    "print('FIREFLYER_DS_LEVEL', m.vector_kernel_level(), flush=True)\n"
)


@dataclass
class PeerStatus:
    """Whether a peer can run here, its version, and the one-line note the report prints."""

    name: str
    available: bool
    version: str | None = None
    note: str | None = None
    kernel_level: int | None = None
    """DeepSpeed only: its shm op's ISA level (0 none, 1 AVX2, 2 AVX-512BW)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# -- pure rules (unit-tested) ----------------------------------------------------------


def dtype_note(peer: str, dtype: str, kernel_level: int | None = None) -> str | None:
    """Why ``peer`` cannot reduce ``dtype`` here (an "n/a: ..." line), or None when it can."""
    if peer == OPENMPI:
        return None if dtype == "fp32" else f"n/a: MPI has no {dtype} type"
    if peer == DEEPSPEED:
        need = DS_LEVEL_NEEDED.get(dtype)
        if need is None:
            return f"n/a: DeepSpeed's shm allreduce has no {dtype} kernel"
        if (kernel_level or 0) < need:
            return f"n/a: DeepSpeed's {dtype} kernel needs {DS_LEVEL_ISA[need]}, which this CPU lacks"
        return None
    return None


def layout_note(peer: str, nodes: int, local: int, shaped: bool) -> tuple[bool, str | None]:
    """(runs, note) for a peer on a layout: peers use one host's shared memory, not the emulated nodes."""
    name = {OPENMPI: "OpenMPI", DEEPSPEED: "DeepSpeed SHM"}.get(peer, peer)
    if shaped:
        return False, f"{name} skipped: it runs on one host's shared memory and would not cross the shaped link"
    if nodes > 1:
        return True, (f"{name} runs {nodes * local} ranks on one host's shared memory: it does not see the "
                      f"{nodes} emulated nodes, so this is a one-node {nodes * local}-rank figure")
    return True, None


def level_from_flags(flags: set[str]) -> int:
    """DeepSpeed's kernel level from /proc/cpuinfo flags, as its own ``vector_kernel_level`` decides it."""
    if "avx512bw" in flags:
        return 2
    if "avx2" in flags:
        return 1
    return 0


def cpu_flags(cpuinfo: str) -> set[str]:
    """The ``flags`` of the first CPU in /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def mpirun_argv(mpirun: str, ranks: int, argv: list[str], env_names: tuple[str, ...] = ()) -> list[str]:
    """The mpirun command that starts ``ranks`` copies of ``argv`` on this host."""
    cmd = [mpirun, *MPIRUN_FLAGS, "-np", str(ranks)]
    for name in env_names:
        cmd += ["-x", name]
    return cmd + list(argv)


def deepspeed_env(env: dict[str, str], world: int) -> dict[str, str]:
    """A torchrun rank environment, made into one of DeepSpeed's CPU SHM ranks."""
    return {**env, "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": str(world)}


def deepspeed_shm_paths(uid: int, addr: str, port: int, world: int, shm_dir: str = "/dev/shm") -> list[str]:
    return [os.path.join(shm_dir, f"{DS_SHM_PREFIX}_{uid}_{addr}_{port}_{r}") for r in range(world)]


def remove_deepspeed_shm(addr: str, port: int, world: int, shm_dir: str = "/dev/shm") -> list[str]:
    """Remove the segments DeepSpeed's ranks left for this rendezvous; returns the ones removed."""
    removed = []
    for path in deepspeed_shm_paths(os.getuid(), addr, port, world, shm_dir):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


# -- probes (side effects: PATH, installed packages, the op build) ----------------------


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def probe_openmpi(which: Callable[[str], str | None] = shutil.which,
                  version: Callable[[str], str | None] = _version,
                  run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> PeerStatus:
    mpirun = which("mpirun")
    mpi4py = version("mpi4py")
    missing = [what for what, have in (("mpirun (openmpi-bin)", mpirun), ("mpi4py", mpi4py)) if not have]
    if missing:
        return PeerStatus(OPENMPI, False, note=f"OpenMPI skipped: {' and '.join(missing)} not installed; "
                                               f"install: {INSTALL[OPENMPI]}")
    ompi = None
    try:
        out = run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
        first = (out.stdout or "").strip().splitlines()
        ompi = first[0].split(")")[-1].strip() if first else None
        if first and "Open MPI" not in first[0]:
            return PeerStatus(OPENMPI, False, note=f"OpenMPI skipped: {mpirun} is not Open MPI ({first[0]})")
    except (OSError, subprocess.SubprocessError) as exc:
        return PeerStatus(OPENMPI, False, note=f"OpenMPI skipped: `mpirun --version` failed: {exc}")
    return PeerStatus(OPENMPI, True, version=f"Open MPI {ompi}, mpi4py {mpi4py}")


def probe_deepspeed(timeout_s: float, progress: Callable[[str], None] = lambda _m: None,
                    version: Callable[[str], str | None] = _version,
                    run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> PeerStatus:
    """Installed, and its shm op builds (JIT, in a child process, so this process stays free of it)."""
    ver = version("deepspeed")
    if ver is None:
        return PeerStatus(DEEPSPEED, False, note=f"DeepSpeed skipped: not installed; install: {INSTALL[DEEPSPEED]}")
    progress(f"loading DeepSpeed {ver}'s shm op (the first use JIT-builds it with g++ and ninja, about a minute)")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    try:
        out = run([sys.executable, "-c", _BUILD_SCRIPT], capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return PeerStatus(DEEPSPEED, False, version=ver,
                          note=f"DeepSpeed skipped: its shm op did not build within {timeout_s:.0f} s")
    except OSError as exc:
        return PeerStatus(DEEPSPEED, False, version=ver, note=f"DeepSpeed skipped: {exc}")
    level = parse_build_output(out.stdout or "")
    if out.returncode != 0 or level is None:
        tail = [ln for ln in ((out.stderr or "") + (out.stdout or "")).splitlines() if ln.strip()]
        return PeerStatus(DEEPSPEED, False, version=ver,
                          note=f"DeepSpeed skipped: its shm op did not build ({tail[-1][:200] if tail else 'no output'})")
    return PeerStatus(DEEPSPEED, True, version=ver, kernel_level=level)


def parse_build_output(stdout: str) -> int | None:
    for line in stdout.splitlines():
        if line.startswith("FIREFLYER_DS_LEVEL "):
            try:
                return int(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


def probe(names: tuple[str, ...], build_timeout_s: float, progress: Callable[[str], None]) -> dict[str, PeerStatus]:
    """The status of every peer in ``names`` (the others are not asked)."""
    found: dict[str, PeerStatus] = {}
    if OPENMPI in names:
        found[OPENMPI] = probe_openmpi()
    if DEEPSPEED in names:
        found[DEEPSPEED] = probe_deepspeed(build_timeout_s, progress)
    return found


# -- process sets: launched, spoken to over the control socket, ended ------------------------


_RANK_ENV = frozenset(rank_env(rank=0, world_size=1, local_rank=0, local_world_size=1, node=0, master_port=1))
"""What :func:`fireflyer.launch.rank_env` sets for a rank: never inherited from this process."""
_LAYOUT_ENV = _RANK_ENV | {"GLOO_SOCKET_IFNAME", "FIREFLYER_HFREDUCE_IFADDR", "LOCAL_SIZE", "DS_ACCELERATOR"}
"""Set per layout; any other FIREFLYER_* setting passes through to the workers."""


def worker_env(lay: Layout, rank: int, master_addr: str, port: int) -> dict[str, str]:
    """Rank ``rank`` of ``lay``'s emulated nodes: this environment, less what is set per layout,
    plus :func:`fireflyer.launch.rank_env` (what torchrun gives a rank) and one thread."""
    env = {k: v for k, v in os.environ.items() if k not in _LAYOUT_ENV and not k.startswith("TORCHELASTIC_")}
    env.update(rank_env(rank=rank, world_size=lay.world, local_rank=rank % lay.local, local_world_size=lay.local,
                        node=rank // lay.local, master_addr=master_addr, master_port=port),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


class SetFailed(RuntimeError):
    """A process set's rank failed, exited or stalled."""

    def __init__(self, set_name: str, message: str) -> None:
        super().__init__(message)
        self.set_name = set_name


def _last_line(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:300] if lines else "(empty log)"


class ProcessSet:
    """The ranks of one process set: its processes, each rank's control channel, and how to end them."""

    def __init__(self, name: str, world: int, log: Callable[[int], str]) -> None:
        self.name, self.world, self.log = name, world, log
        self.procs: list[subprocess.Popen] = []
        self.chans: list[Any] = [None] * world
        self.pids: list[int] = []
        self.hello: list[dict[str, Any] | None] = [None] * world
        self.cleanup: list[Callable[[], object]] = []
        self.closed = False

    @property
    def ready(self) -> bool:
        return all(h is not None for h in self.hello)

    def dtype_note(self, system: str, dtype: str) -> str | None:
        """Why ``system`` cannot run ``dtype`` here (the ranks' hello says), or None."""
        notes = [h["dtypes"][system].get(dtype) for h in self.hello if h]
        return next((n for n in notes if n), None)

    def check_reply(self, rank: int, msg: dict[str, Any] | None, closed: str, failed: str) -> None:
        """Raise :class:`SetFailed` for a rank's reply that is none (its channel closed: the message says
        ``closed`` and the rank's last log line) or an error (prefixed with ``failed``)."""
        if msg is None:
            self.check_alive()
            raise SetFailed(self.name, f"{self.name} rank {rank} {closed}: "
                                       f"{_last_line(self.log(min(rank, len(self.procs) - 1)))}")
        if "error" in msg:
            raise SetFailed(self.name, f"{self.name} {failed}{msg['error']}")

    def check_alive(self) -> None:
        for i, p in enumerate(self.procs):
            rc = p.poll()
            if rc is not None:
                where = f"rank {i}" if len(self.procs) > 1 else "mpirun"
                raise SetFailed(self.name, f"{self.name} {where} exited with code {rc}: {_last_line(self.log(i))}")

    def call(self, cmd: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        """Send ``cmd`` to every rank and return their replies, in rank order."""
        for ch in self.chans:
            ch.send(cmd)
        replies = []
        deadline = time.monotonic() + timeout_s
        for rank, ch in enumerate(self.chans):
            while True:
                try:
                    msg = ch.recv(POLL_S)
                    break
                except TimeoutError:
                    self.check_alive()
                    if time.monotonic() > deadline:
                        raise SetFailed(self.name, f"{self.name} rank {rank}: no answer to {cmd['cmd']} "
                                                   f"in {timeout_s:.0f} s") from None
            self.check_reply(rank, msg, "closed its channel", "")
            replies.append(msg)
        return replies

    def finish(self, timeout_s: float = 30.0) -> None:
        """Ask every rank to exit, and wait for the processes."""
        self.call({"cmd": "exit"}, timeout_s)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def kill(self) -> None:
        """End every process of the set (mpirun first gets SIGTERM, which it forwards), then clean up."""
        if self.closed:
            return
        self.closed = True
        for ch in self.chans:
            if ch is not None:
                ch.close()
        for p in self.procs:
            if p.poll() is None and self.name == OPENMPI:
                p.terminate()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
        for pid in self.pids:  # mpirun's ranks run in process groups of their own
            if pid == os.getpid():  # a rank in this very process (the tests' threads)
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for fn in self.cleanup:
            fn()


def start_sets(cfg: Any, lay: Layout, tmp: str, control: str, link: Any,
               peers: dict[str, PeerStatus], res: LayoutResult, sets: dict[str, ProcessSet]) -> None:
    """Start the torch ranks and every peer that runs on this layout, into ``sets`` as they
    start (so that whoever called can end them all even when a later start fails)."""
    idle_s = cfg.timeout_s * 4 + 120

    def spec(name: str, **extra: Any) -> str:
        path = os.path.join(tmp, f"{name}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"set": name, "control": control, "timeout_s": cfg.timeout_s, "idle_timeout_s": idle_s,
                       **extra}, f)
        return path

    def log_of(name: str) -> Callable[[int], str]:
        return lambda r: os.path.join(tmp, f"{name}.rank{r}.log")

    def popen(st: ProcessSet, rank: int, argv: list[str], env: dict[str, str], node: int | None = None) -> None:
        log = open(st.log(rank), "wb")
        kw: dict[str, Any] = dict(env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True, preexec_fn=lifetime.tied_to_me(signal.SIGTERM))
        try:
            st.procs.append(link.popen(node, argv, **kw) if node is not None else subprocess.Popen(argv, **kw))
        finally:
            log.close()

    candidate = cfg.candidate if "candidate" in cfg.systems else "gloo"
    st = sets["torch"] = ProcessSet("torch", lay.world, log_of("torch"))
    argv = [sys.executable, "-m", "fireflyer.bench.allreduce_worker", spec("torch", candidate=candidate)]
    master, port = (link.addrs[0], 29500) if link else ("127.0.0.1", free_port())
    for rank in range(lay.world):
        env = worker_env(lay, rank, master, port)
        if link is None:
            env["GLOO_SOCKET_IFNAME"] = "lo"
            popen(st, rank, argv, env)
        else:
            node = rank // lay.local
            env.update(GLOO_SOCKET_IFNAME=link.ifname, FIREFLYER_HFREDUCE_IFADDR=link.addrs[node])
            popen(st, rank, argv, env, node)

    for name in cfg.peers:
        status = peers[name]
        if not status.available:
            res.notes[name] = status.note or "not available"
            continue
        runs, note = layout_note(name, lay.nodes, lay.local, lay.shaped)
        if note:
            res.notes[name] = note
        if not runs:
            continue
        if name == DEEPSPEED:
            st = sets[name] = ProcessSet(name, lay.world, log_of(name))
            ds_port = free_port()
            argv = [sys.executable, "-m", "fireflyer.bench.allreduce_worker", spec(name)]
            for rank in range(lay.world):
                env = deepspeed_env(worker_env(lay, rank, "127.0.0.1", ds_port), lay.world)
                env["GLOO_SOCKET_IFNAME"] = "lo"
                popen(st, rank, argv, env)
            st.cleanup.append(lambda p=ds_port, w=lay.world: remove_deepspeed_shm("127.0.0.1", p, w))
        else:
            st = sets[name] = ProcessSet(name, lay.world, lambda _r: os.path.join(tmp, "openmpi.log"))
            env = {k: v for k, v in os.environ.items() if k not in _LAYOUT_ENV}
            env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            worker = [sys.executable, "-m", "fireflyer.bench.mpi_worker", spec(name)]
            popen(st, 0, mpirun_argv(shutil.which("mpirun") or "mpirun", lay.world, worker), env)


def accept(server: socket.socket, sets: dict[str, ProcessSet], timeout_s: float, pending: list[Any]) -> None:
    """Wait until every rank of every set has connected and said hello once set up.

    ``pending``: channels accepted whose rank has not said who it is yet. A rank names its
    set and rank as soon as it connects, so one that dies during setup is known by name
    even where its launcher lives on (mpirun waits for the ranks still running)."""
    deadline = time.monotonic() + timeout_s
    server.settimeout(POLL_S)
    while not all(st.ready for st in sets.values()):
        try:
            conn, _ = server.accept()
            pending.append(Channel(conn))
        except socket.timeout:
            pass
        for ch in list(pending):
            try:
                msg = ch.recv(0.01)
            except TimeoutError:
                continue
            pending.remove(ch)
            if msg is None or msg.get("conn") not in sets:  # closed at once, or a rank of a dropped set
                ch.close()
                continue
            st = sets[msg["conn"]]
            st.chans[msg["rank"]] = ch
            st.pids.append(msg["pid"])
        for st in sets.values():
            for rank, ch in enumerate(st.chans):
                if ch is None or st.hello[rank] is not None:
                    continue
                try:
                    msg = ch.recv(0.01)
                except TimeoutError:
                    continue
                st.check_reply(rank, msg, "exited while setting up", f"rank {rank} failed to start: ")
                st.hello[rank] = msg
            if not st.ready:
                st.check_alive()
        if time.monotonic() > deadline:
            late = [f"{st.name} rank {r}" for st in sets.values() for r, h in enumerate(st.hello) if h is None]
            raise SetFailed(next(st.name for st in sets.values() if not st.ready),
                            f"not started within {timeout_s:.0f} s: {', '.join(late)}")


def close_pending(pending: list[Any]) -> None:
    """Close the channels :func:`accept` took whose rank never said who it is (their ranks see
    the parent go away and end)."""
    for ch in pending:
        ch.close()
    pending.clear()


# -- the control channel -------------------------------------------------------------------


class Channel:
    """JSON lines over a connected stream socket; the parent's side and a rank's side alike."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""

    @classmethod
    def connect(cls, path: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Channel:
        deadline = time.monotonic() + timeout_s
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                return cls(s)
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no bench parent listening at {path} after {timeout_s:.0f} s") from None
                time.sleep(0.05)

    def send(self, obj: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def recv(self, timeout_s: float) -> dict[str, Any] | None:
        """The next message; None when the other side closed; TimeoutError after ``timeout_s``
        (a partial line is kept for the next call)."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no message in {timeout_s:.1f} s")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 16)
            except socket.timeout:
                raise TimeoutError(f"no message in {timeout_s:.1f} s") from None
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def close(self) -> None:
        self.sock.close()
