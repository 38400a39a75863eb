"""Emulated nodes on this machine, started exactly as a multi-node job starts on a cluster.

``run_local(["-m", "my.job", "--flag"], nodes=2, ranks_per_node=2)`` starts one real
``torchrun`` agent per emulated node (``--nnodes N --node-rank i`` on 127.0.0.1), each
with its own ``FIREFLYER_NODE_ID``, so hfreduce sees N nodes and ranks get the usual
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``. Node 0's output
goes to this terminal (so rank 0 can draw a progress bar); everything else, node 0's
stderr included, is kept in ``log_dir/node{i}.log``. Nothing can hang: past ``timeout`` every agent and rank is
stopped, and none outlives the launcher, however it ends (:mod:`fireflyer.lifetime`).

Starters that spawn ranks themselves (the test harness's LocalCluster, the platform's local
ranks, the benchmarks) build each rank's environment with :func:`rank_env`, the one place
that names those variables; a rank reads its place back with :func:`this_rank`.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from fireflyer import lifetime
from fireflyer.errors import FireflyerError, TimedOut, UserError
from fireflyer.ports import free_port


class LaunchFailed(FireflyerError, RuntimeError):
    """A rank of a local job failed; the message carries its last error line."""


@dataclass(frozen=True, kw_only=True)
class LocalJob:
    """One local multi-node job: what to run and on how many emulated nodes."""

    target: Sequence[str]
    """What torchrun runs: ``["-m", "pkg.module", args...]`` or ``["script.py", args...]``."""
    nodes: int = 1
    ranks_per_node: int = 1
    timeout: float = 600.0
    """Seconds before every process of the job is killed and TimeoutError raised."""
    env: dict[str, str] = field(default_factory=dict)
    log_dir: str | None = None
    """Where each node's output is kept (``node{i}.log``). Default: a fresh temporary directory."""
    quiet: bool = False
    """Send node 0's output to the log only, not to this terminal."""
    grace: float = lifetime.DEFAULT_GRACE
    """Seconds the ranks get to finish what is in flight (a checkpoint save) when the job is stopped
    (a stop signal, the timeout) before they are killed."""
    replicas: bool = False
    """Each node a job of its own (torchrun with one node, its own rendezvous): the nodes are replica groups that
    find each other through torchft's Lighthouse, and one node's failure leaves the others running."""
    max_restarts: int = 0
    """``replicas``: times each node's agent restarts the node's ranks when one of them fails."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise UserError(f"nodes and ranks_per_node must be at least 1, got {self.nodes} x {self.ranks_per_node}")
        if not self.target:
            raise UserError("target is empty: give a script or '-m module' for torchrun to run")
        if not self.timeout > 0:
            raise UserError(f"timeout must be positive seconds, got {self.timeout}")
        if not 0 <= self.grace <= 3600:
            raise UserError(f"grace must be 0 to 3600 seconds, got {self.grace}")
        if not 0 <= self.max_restarts <= 1000:
            raise UserError(f"max_restarts must be 0 to 1000, got {self.max_restarts}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


NODE_ID = "FIREFLYER_NODE_ID"
"""The variable that names a rank's node; ranks with the same value share one node's memory."""
JOB_SECRET = "FIREFLYER_JOB_SECRET"
"""The variable that carries the job's secret, the same in every rank (hfreduce keys its links and arena with it)."""


def node_name(node: int) -> str:
    """The ``FIREFLYER_NODE_ID`` of emulated node ``node``: what tells this machine's nodes apart."""
    return f"node{node}"


def rank_env(*, rank: int, world_size: int, local_rank: int, local_world_size: int, node: int | str,
             master_addr: str = "127.0.0.1", master_port: int) -> dict[str, str]:
    """The variables one rank of an emulated node gets, as torchrun sets them on a cluster.

    The one place that names them: every starter of emulated nodes (the local launcher, the
    platform's local ranks, the benchmarks, the test harness) builds a rank's environment here.
    ``node`` is the emulated node's index (named by :func:`node_name`, and the node's rank) or
    its name (the node's rank is then ``rank // local_world_size``, as in an even layout).
    """
    if not 0 <= rank < world_size or not 0 <= local_rank < local_world_size:
        raise UserError(f"rank {rank}/{world_size} (local {local_rank}/{local_world_size}) is out of range")
    node_rank = rank // local_world_size if isinstance(node, str) else node
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node_rank), "NODE_RANK": str(node_rank),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        NODE_ID: node if isinstance(node, str) else node_name(node),
    }


@dataclass(frozen=True, kw_only=True)
class RankPlace:
    """Where this process sits in its job, as its launcher (torchrun, the platform, :func:`rank_env`) said."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: str
    """``FIREFLYER_NODE_ID``; empty where the launcher set none (one rank per host, or a real cluster)."""


def this_rank(env: Mapping[str, str] | None = None) -> RankPlace:
    """This rank's place, read from torchrun's variables (``env``: default this process's environment).

    ``RANK`` and ``WORLD_SIZE`` must be set (KeyError otherwise); ``LOCAL_RANK`` defaults to 0,
    ``LOCAL_WORLD_SIZE`` to 1.
    """
    env = os.environ if env is None else env
    return RankPlace(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                     local_rank=int(env.get("LOCAL_RANK", "0")),
                     local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")), node=env.get(NODE_ID, ""))


def threads_per_rank(world_size: int) -> int:
    """Intra-op threads for one rank so the ranks together use the cores once, not oversubscribe them."""
    return max(1, (os.cpu_count() or 1) // world_size)


def run_local(job: LocalJob) -> Path:
    """Run ``job`` to completion and return its log directory; raise LaunchFailed, TimedOut or Stopped.

    The job's processes end when this call ends, whichever way it ends (see
    :mod:`fireflyer.lifetime`): every agent and rank carries the job's mark; a stop signal
    (SIGINT, SIGTERM, SIGHUP) or the timeout sends SIGTERM to the agents, which forward it to
    their ranks, and after ``job.grace`` seconds what is left is killed; the agents follow this
    process if it is killed outright (SIGTERM on its death), and the ranks their agent (SIGKILL).
    """
    log_dir = Path(job.log_dir or tempfile.mkdtemp(prefix="fireflyer-job-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    threads = threads_per_rank(job.world_size)
    # One secret for the whole job, in every rank's environment: hfreduce keys its links and
    # arena with it, so it never has to sit in the rendezvous store.
    secret = os.environ.get(JOB_SECRET) or job.env.get(JOB_SECRET) or secrets.token_hex(32)
    mark = lifetime.child_mark()
    procs: list[subprocess.Popen] = []
    outputs = []
    with lifetime.stop_signals() as stops:
        try:
            for node in range(job.nodes):
                env = dict(os.environ)
                # torchrun gives each rank the rest of rank_env's variables; the node is this launcher's to name.
                env.update({NODE_ID: node_name(node), "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"})
                env.update(job.env)
                env.update({JOB_SECRET: secret, lifetime.MARK: mark, lifetime.GRACE: f"{job.grace:g}"})
                if job.replicas:  # a job of its own: one node, its own store, restarted on a failure
                    place = ["--nnodes=1", "--node-rank=0", f"--master-port={free_port()}",
                             f"--max-restarts={job.max_restarts}", "--monitor-interval=0.1"]
                else:
                    place = [f"--nnodes={job.nodes}", f"--node-rank={node}", f"--master-port={port}"]
                cmd = [
                    sys.executable, "-m", "torch.distributed.run", *place,
                    f"--nproc-per-node={job.ranks_per_node}", "--master-addr=127.0.0.1",
                    # the agent's wait between its SIGTERM to the ranks and its SIGKILL
                    f"--shutdown-timeout={math.ceil(job.grace) + 1}",
                    # each rank dies with its agent: python -m fireflyer.lifetime TARGET... becomes python TARGET...
                    "-m", "fireflyer.lifetime", *job.target,
                ]
                out = open(log_dir / f"node{node}.log", "w")
                outputs.append(out)
                to_terminal = node == 0 and not job.quiet
                procs.append(subprocess.Popen(
                    cmd, env=env, stdin=subprocess.DEVNULL,
                    stdout=None if to_terminal else out, stderr=out,
                    start_new_session=True,  # a terminal's Ctrl-C reaches this process, which stops the job in order
                    preexec_fn=lifetime.tied_to_me(signal.SIGTERM),
                ))
            _wait(procs, job.timeout, each_alone=job.replicas)
        except BaseException as exc:  # a stop signal, the timeout, or an error here: the job ends first
            why = f"{lifetime.signal_name(exc.signum)}" if isinstance(exc, lifetime.Stopped) else \
                "timeout" if isinstance(exc, TimedOut) else type(exc).__name__
            _stop(procs, job.grace, stops, why)
            raise
        finally:
            stops.armed = False  # a signal from here on must not cut the clean-up short
            _kill(procs)
            lifetime.sweep(mark)
            for out in outputs:
                out.close()
    failed = [(node, p.returncode) for node, p in enumerate(procs) if p.returncode != 0]
    if failed and (not job.replicas or len(failed) == len(procs)):  # replicas: one that finished is enough
        node, code = failed[0]
        raise LaunchFailed(f"node {node} exited with code {code}: {_first_error(log_dir)} (logs in {log_dir})")
    return log_dir


def _wait(procs: list[subprocess.Popen], timeout: float, *, each_alone: bool = False) -> None:
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]  # poll every agent, every time
        if all(code is not None for code in codes):
            return
        if time.monotonic() > deadline:
            raise TimedOut(f"the job did not finish within {timeout:.0f}s and was stopped")
        # One failed node means the others will only wait for it: give them a moment, then stop them
        # (unless the nodes are replicas, which go on without it).
        if not each_alone and any(code not in (None, 0) for code in codes):
            grace = time.monotonic() + 10
            while any(p.poll() is None for p in procs) and time.monotonic() < grace:
                time.sleep(0.1)
            return
        time.sleep(0.05)


def _stop(procs: list[subprocess.Popen], grace: float, stops: lifetime.StopRequests, why: str) -> None:
    """SIGTERM to every agent (each forwards it to its ranks), then wait up to ``grace`` + 3 s for them to end.

    A second stop signal cuts the wait short; :func:`_kill` and the sweep do the rest.
    """
    running = [p for p in procs if p.poll() is None]
    if not running:
        return
    if why.startswith("SIG"):  # a user's stop is answered at once; a timeout or an error says so in its own line
        print(f"fireflyer: stopping the job ({why}): its ranks have {grace:g} s to finish a checkpoint in flight"
              + (", a second Ctrl-C stops it at once" if why == "SIGINT" else ""), file=sys.stderr, flush=True)
    for p in running:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace + 3  # the agents' own SIGKILL comes at grace + 1
    while any(p.poll() is None for p in running) and time.monotonic() < deadline and not stops.hurry:
        time.sleep(0.05)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


_PEER_SYMPTOMS = ("PeerFailure", "ConnectionLost", "ChildFailedError", "BrokenPipeError", "ConnectionResetError",
                  "ConnectionAbortedError", "Broken pipe", "Connection reset by peer")
"""What a rank's error says when it only lost a peer that failed first."""


_FIREFLYER_ERROR = re.compile(r"fireflyer(\.\w+)+: ")
"""A traceback's last line for one of fireflyer's own errors, whose names need not end in Error
(``fireflyer.storage.errors.CorruptRecord: ...``, ``fireflyer.errors.TimedOut: ...``)."""


def _first_error(log_dir: Path) -> str:
    """The most telling error line any rank wrote: its exception, else the agent's summary."""
    candidates: list[str] = []
    for path in sorted(log_dir.rglob("*")):
        if not path.is_file() or path.suffix == ".json":
            continue
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            text = line.split("]:", 1)[-1].strip() if line.startswith("[") else line.strip()
            if (text.endswith(("Error", "Exception")) or ("Error: " in text or "Exception: " in text)
                    or _FIREFLYER_ERROR.match(text)) \
                    and not text.startswith(("torch.distributed.elastic", "raise ")):
                candidates.append(text)
                break
    # Ranks that died of a peer's failure say so (or lose their sockets to it); prefer the root cause.
    for text in candidates:
        if not any(symptom in text for symptom in _PEER_SYMPTOMS):
            return text
    return candidates[0] if candidates else "no error message; see the logs"
