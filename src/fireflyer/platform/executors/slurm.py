"""The Slurm executor: each attempt is one batch job on the nodes the platform chose.

The platform's daemon stays the scheduler; Slurm only runs what it is given. For an
attempt, :meth:`SlurmExecutor.launch` writes ``slurm.sh`` into the attempt's directory and
submits it with ``sbatch`` on exactly the chosen nodes (``--nodelist``, ``--exclusive``).
The script runs the attempt's supervisor (``python -m fireflyer.platform.attempt.supervisor
ATTEMPT_DIR --slurm``), which starts the ranks with one ``srun``
(:func:`fireflyer.platform.attempt.starters.srun_ranks`) and then runs the same watch as on the
local executor: handshake, watchdog, ``status.json``.

Slurm's own signals reach the same handshake:

* ``--signal=B:USR1@S``: Slurm warns the batch script S seconds before a time limit. The
  script turns SIGUSR1 (and SIGTERM) into a suspend request (:meth:`SlurmExecutor.batch_script`).
* Slurm's own preemption sends the same USR1 when the cluster sets
  ``SlurmctldParameters=preempt_send_user_signal`` and a ``GraceTime`` (as ``.ci/setup-slurm`` does).
* :meth:`SlurmExecutor.signal` (``scancel --signal=USR1 --batch``) delivers one by hand.
* ``--requeue``: when Slurm itself requeues the job (a failed node, or Slurm's own
  preemption), the batch script runs again; a supervisor whose attempt already wrote
  ``status.json`` exits at once, so an attempt never runs twice.

The platform owns resumption: a suspended attempt ends, and the chain's next attempt is a
new ``sbatch``. The attempt directory must be on a filesystem every node sees.

Every call to Slurm goes through :func:`run_slurm`, with a timeout; failures become
:class:`SlurmError` naming the command and what Slurm said.
"""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fireflyer.cliutil import plural
from fireflyer.errors import FireflyerError, UserError
from fireflyer.platform.accounts import Account
from fireflyer.platform.executors.base import Launch
from fireflyer.platform.layout import AttemptDir
from fireflyer.platform.state.policy import Node

TIMEOUT_S = 30.0
"""How long any one Slurm command may take before it counts as failed."""
JOB_PREFIX = "fireflyer-"
DEFAULT_ZONE = "zone0"

FINISHED_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
    "DEADLINE", "OUT_OF_MEMORY", "REVOKED",
})
"""Job states after which the batch script no longer runs. Every other state (PENDING,
RUNNING, CONFIGURING, COMPLETING, REQUEUED, SUSPENDED, ...) counts as alive. A job
submitted with ``--requeue`` that Slurm puts back in the queue after ``NODE_FAIL`` or
``PREEMPTED`` shows PENDING again; :meth:`SlurmExecutor.kill` after ``alive`` turned False
makes sure such a job cannot come back."""

_USABLE = frozenset({"idle", "mixed", "allocated", "completing", "planned"})
_DRAINED = frozenset({"drained", "draining", "drain"})


class SlurmError(FireflyerError, RuntimeError):
    """A Slurm command failed, timed out, printed something unexpected, or is not installed."""


def run_slurm(argv: Sequence[str], *, timeout: float = TIMEOUT_S, ok_errors: Sequence[str] = (),
              account: Account | None = None) -> str:
    """Run one Slurm command; its stdout, or :class:`SlurmError`.

    ``ok_errors``: substrings of stderr that mean "nothing to do" (a job already gone),
    for which a non-zero exit returns ``""`` instead of raising. ``account``: run it as
    that Unix account, with its environment from scratch (munge then vouches for that
    user, and ``sbatch`` exports that environment to the job).
    """
    cmd = shlex.join(argv)
    how = {} if account is None else {"env": account.env(), **account.popen()}
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, check=False, **how)
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]!r} not found: Slurm's client is not installed "
                         "(apt-get install slurm-client) or not on PATH") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{cmd}` did not answer within {timeout:g} s; is slurmctld up? "
                         "(`scontrol ping`)") from None
    except OSError as exc:
        raise SlurmError(f"`{cmd}` could not start: {exc.strerror}") from None
    if done.returncode != 0:
        if any(s in done.stderr for s in ok_errors):
            return ""
        lines = [ln.strip() for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
        raise SlurmError(f"`{cmd}` failed (exit {done.returncode})" + (f": {lines[-1]}" if lines else ""))
    return done.stdout


# ---------------------------------------------------------------------- the executor
@dataclass
class SlurmExecutor:
    """Runs attempts as Slurm batch jobs (see the module docstring)."""

    partition: str | None = None
    """Slurm partition for every job; None: the cluster's default."""
    python: str = field(default_factory=lambda: sys.executable)
    """The interpreter that runs the supervisor and the rank shim (on every node)."""
    time_limit: str | None = None
    """``--time`` for every job (Slurm's format, e.g. ``"4:00:00"``); None: the partition's."""
    exclusive: bool = True
    """Whole nodes: no other job shares an attempt's nodes."""
    extra_args: tuple[str, ...] = ()
    """More sbatch options, e.g. ``("--gres=gpu:8", "--account=ml")``."""
    timeout: float = TIMEOUT_S

    name = "slurm"

    # ------------------------------------------------------------ building the job
    @staticmethod
    def job_name(task_id: int) -> str:
        return f"{JOB_PREFIX}{task_id}"

    @staticmethod
    def signal_lead(launch: Launch) -> int:
        """Seconds before a time limit at which Slurm sends USR1: the whole handshake, plus slack."""
        return min(65535, math.ceil(launch.timeouts.suspend_ack + launch.timeouts.suspend_grace) + 10)

    def batch_script(self, launch: Launch, adir: AttemptDir) -> str:
        """The job's script: runs the supervisor, and turns Slurm's batch signals into suspend requests.

        Slurm signals only this shell (``B:USR1`` before a time limit or on preemption,
        ``scancel --signal=USR1 --batch``), possibly the instant the job starts. The shell
        writes ``control/suspend`` itself, so a signal that comes before the supervisor's
        handler is in place is not lost, and passes the signal on; the supervisor starts
        with USR1 and TERM ignored, so such an early signal cannot kill it either. The signal
        is passed on first and the flag written last, beside itself and renamed into place (as
        :func:`fireflyer.fsutil.atomic_write` does): whoever sees the flag sees its whole reason,
        never an empty file, and knows the supervisor has been sent the signal.
        """
        supervisor = shlex.join([self.python, "-m", "fireflyer.platform.attempt.supervisor", str(adir.root), "--slurm"])
        flag = shlex.quote(str(adir.flag("suspend")))
        tmp = shlex.quote(str(adir.control / ".suspend")) + ".$$"  # hidden: only the exact flag name counts
        about = (f"fireflyer task {launch.task_id} ({launch.name!r}, chain {launch.chain_id}, "
                 f"attempt {launch.attempt}) on {plural(len(launch.nodes), 'node')}")
        return textwrap.dedent(f"""\
            #!/bin/sh
            # {about}
            trap '' USR1 TERM
            {supervisor} &
            child=$!
            flag={flag}
            tmp={tmp}
            suspend() {{
                kill -"$1" "$child" 2>/dev/null
                [ -e "$flag" ] || {{ echo "signal SIG$1 (Slurm, to the batch script)" > "$tmp" &&
                    mv -f "$tmp" "$flag" || rm -f "$tmp"; }}
            }}
            trap 'suspend USR1' USR1
            trap 'suspend TERM' TERM
            while :; do
                wait "$child"
                rc=$?
                kill -0 "$child" 2>/dev/null || exit "$rc"
            done
            """)

    def sbatch_argv(self, launch: Launch, adir: AttemptDir, script: Path) -> list[str]:
        if not launch.nodes:
            raise UserError(f"task {launch.task_id}: no nodes to launch on")
        argv = ["sbatch", "--parsable", "--job-name", self.job_name(launch.task_id),
                "--nodes", str(len(launch.nodes)), "--nodelist", ",".join(launch.nodes),
                "--ntasks-per-node", str(launch.ranks_per_node),
                "--requeue", f"--signal=B:USR1@{self.signal_lead(launch)}",
                "--output", str(adir.logs / "slurm-%j.out"), "--open-mode=append",
                "--chdir", launch.cwd, "--comment", str(adir.root)]
        if self.exclusive:
            argv.append("--exclusive")
        if self.partition:
            argv += ["--partition", self.partition]
        if self.time_limit:
            argv += ["--time", self.time_limit]
        argv += list(self.extra_args)
        argv.append(str(script))
        return argv

    # ------------------------------------------------------------ the Executor protocol
    def launch(self, launch: Launch, attempt_dir: str) -> str:
        """Submit the attempt's job; as the task's account when it has one, so Slurm runs it as that user."""
        adir = AttemptDir(attempt_dir)
        account = None if launch.account is None else Account.from_json(launch.account)
        if account is None:
            adir.create()
        script = adir.root / "slurm.sh"
        script.unlink(missing_ok=True)
        with os.fdopen(adir.open_new("slurm.sh", 0o700), "w") as f:
            f.write(self.batch_script(launch, adir))
        out = run_slurm(self.sbatch_argv(launch, adir, script), timeout=self.timeout, account=account).strip()
        # --parsable prints "jobid" or "jobid;cluster"
        job = out.splitlines()[-1].split(";")[0].strip() if out else ""
        if not job.isdigit():
            raise SlurmError(f"sbatch for task {launch.task_id} printed no job id: {out!r}")
        return job

    def state(self, handle: str) -> str | None:
        """The job's Slurm state (``RUNNING``, ``COMPLETED``, ...), or None when Slurm no longer knows it."""
        _check_handle(handle)
        out = run_slurm(["squeue", "-h", "-j", handle, "--states=all", "-o", "%T"], timeout=self.timeout,
                        ok_errors=("Invalid job id",))
        states = [ln.strip().upper() for ln in out.splitlines() if ln.strip()]
        if not states:
            return None
        if not all(s.replace("_", "").isalpha() for s in states):
            raise SlurmError(f"squeue printed an unexpected state for job {handle}: {out.strip()!r}")
        return states[0]

    def alive(self, handle: str) -> bool:
        st = self.state(handle)
        return st is not None and st not in FINISHED_STATES

    def kill(self, handle: str) -> None:
        _check_handle(handle)
        run_slurm(["scancel", handle], timeout=self.timeout,
                  ok_errors=("Invalid job id", "already completing or completed"))

    def signal(self, handle: str, sig: str = "USR1") -> None:
        """Send a signal to the job's batch script only: its supervisor (USR1 or TERM: a suspend request)."""
        _check_handle(handle)
        if not sig.replace("SIG", "", 1).isalnum():
            raise UserError(f"bad signal name {sig!r}")
        run_slurm(["scancel", f"--signal={sig}", "--batch", handle], timeout=self.timeout)

    def find(self, task_id: int, attempt_dir: str | None = None) -> str | None:
        """The job of a task's attempt, when ``launch`` submitted it but its handle was lost.

        Jobs are matched by name (``fireflyer-ID``) and, when ``attempt_dir`` is given, by the
        attempt directory in their comment, so another platform home's task with the same id
        is never taken. The newest match wins; None when Slurm knows no such job.
        """
        out = run_slurm(["squeue", "-h", "--states=all", "--name", self.job_name(task_id), "-o", "%i|%k"],
                        timeout=self.timeout)
        want = str(Path(attempt_dir)) if attempt_dir is not None else None
        jobs: list[int] = []
        for line in out.splitlines():
            if not line.strip():
                continue
            job, _, comment = line.strip().partition("|")
            if not job.isdigit():
                raise SlurmError(f"squeue printed an unexpected job id: {line.strip()!r}")
            if want is None or comment.strip() == want:
                jobs.append(int(job))
        return str(max(jobs)) if jobs else None


def _check_handle(handle: str) -> None:
    if not str(handle).isdigit():
        raise UserError(f"not a Slurm job id: {handle!r}")


# ---------------------------------------------------------------------- inside the job
def hostnames(nodelist: str, *, timeout: float = TIMEOUT_S) -> list[str]:
    """Expand a Slurm node list (``fnode[0-3],gpu7``) into names."""
    return [n for n in run_slurm(["scontrol", "show", "hostnames", nodelist], timeout=timeout).split() if n]


def node_addr(node: str, *, timeout: float = TIMEOUT_S) -> str:
    """The address other nodes reach ``node`` at (its Slurm ``NodeAddr``; the name when none)."""
    out = run_slurm(["scontrol", "show", "node", node, "-o"], timeout=timeout)
    for word in out.split():
        if word.startswith("NodeAddr="):
            addr = word.partition("=")[2]
            if addr and addr != "(null)":
                return addr
    return node


# ---------------------------------------------------------------------- nodes
def _parse_state(raw: str) -> tuple[bool, bool]:
    """(healthy, drained) from a ``sinfo %T`` state such as ``idle``, ``drained``, ``down*``, ``mixed-``."""
    state = raw.strip().lower()
    flags = ""
    while state and not state[-1].isalpha() and state[-1] != "_":
        flags, state = state[-1] + flags, state[:-1]
    not_responding = "*" in flags
    if state in _DRAINED:
        return not not_responding, True
    return state in _USABLE and not not_responding, False


def _zone(features: str) -> str:
    for feat in features.split(","):
        feat = feat.strip()
        for sep in ("=", ":"):
            if feat.startswith("zone" + sep) and len(feat) > 5:
                return feat[5:]
    return DEFAULT_ZONE


def parse_sinfo(out: str) -> list[Node]:
    """Nodes from ``sinfo -N -h -o '%N|%T|%P|%f'`` (one line per node and partition)."""
    nodes: dict[str, Node] = {}
    for line in out.splitlines():
        if not line.strip():
            continue
        parts = line.strip().split("|")
        if len(parts) != 4 or not parts[0]:
            raise SlurmError(f"sinfo printed an unexpected line: {line.strip()!r}")
        name, state, _partition, features = parts
        healthy, drained = _parse_state(state)
        node = Node(name=name, zone=_zone(features), healthy=healthy, drained=drained)
        if name in nodes and nodes[name] != node:
            raise SlurmError(f"sinfo reported node {name} twice, differently: {nodes[name]} and {node}")
        nodes[name] = node
    return sorted(nodes.values(), key=lambda n: n.name)


def slurm_nodes(partition: str | None = None, *, timeout: float = TIMEOUT_S) -> list[Node]:
    """The cluster's nodes as the policy sees them: drained/draining nodes drained,
    down, failed or unresponsive ones unhealthy; zone from a ``zone=NAME`` feature."""
    argv = ["sinfo", "-N", "-h", "-o", "%N|%T|%P|%f"]
    if partition:
        argv += ["-p", partition]
    return parse_sinfo(run_slurm(argv, timeout=timeout))


def _check_node(node: str) -> None:
    if not node or any(c.isspace() or c in "=," for c in node):
        raise UserError(f"bad node name {node!r}")


def drain(node: str, reason: str, *, timeout: float = TIMEOUT_S) -> None:
    """Take a node out of Slurm's scheduling (its running job, if any, finishes)."""
    _check_node(node)
    run_slurm(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason or 'fireflyer'}"],
              timeout=timeout)


def undrain(node: str, *, timeout: float = TIMEOUT_S) -> None:
    """Return a drained node to service; a node that is not drained is left as it is."""
    _check_node(node)
    run_slurm(["scontrol", "update", f"nodename={node}", "state=resume"], timeout=timeout,
              ok_errors=("Invalid node state specified",))
