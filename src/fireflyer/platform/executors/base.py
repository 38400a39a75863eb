"""Where attempts run: one small interface, with a local and a Slurm implementation.

The daemon decides *what* runs *where*; an executor only starts an attempt's
supervisor (:mod:`fireflyer.platform.attempt.supervisor`) on the chosen nodes, says whether it
is still alive, and kills it. Everything else goes through the attempt's directory
(:class:`~fireflyer.platform.layout.AttemptDir`), which the supervisor, the ranks'
client (:mod:`fireflyer.platform.client`) and the daemon all read and write:

* ``spec.json``: the :class:`Launch` (written by the daemon before ``launch``);
* ``supervisor.json``: the supervisor's pid and host, written when it starts;
* ``control/``: ``suspend`` and ``stop`` requests from the daemon; ``received``,
  ``can_suspend`` and ``whole_life_state`` from the job;
* ``started/rank{R}``: written by each rank as it starts;
* ``logs/rank{R}.log``: each rank's output;
* ``status.json``: how the attempt ended, written once by the supervisor.

A handle is a string the executor can find the attempt by again after the daemon
restarted: a pid with its start time for the local executor, a job id for Slurm.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Protocol
from fireflyer.errors import UserError


@dataclass(frozen=True)
class Timeouts:
    """The supervisor's clocks, in seconds (HAI's defaults where HAI has one)."""

    suspend_ack: float = 5.0
    """A suspend not acknowledged (``receive_suspend_command``) in this long stops the task."""
    suspend_grace: float = 60.0
    """After acknowledging, the job has this long to save and call ``go_suspend``."""
    watchdog: float = 1800.0
    """No output from any rank for this long counts as a hang (HAI's HF_WATCHDOG_TIME)."""
    unschedulable: float = 180.0
    """Ranks that have not all started in this long make the attempt unschedulable."""
    kill_grace: float = 5.0
    """Between SIGTERM and SIGKILL when ranks are stopped."""

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or value <= 0:
                raise UserError(f"timeout {name} must be a positive number of seconds, got {value!r}")


@dataclass(frozen=True)
class Launch:
    """Everything an attempt needs to run; saved as ``spec.json`` in its directory."""

    task_id: int
    chain_id: int
    attempt: int
    name: str
    user: str
    command: tuple[str, ...]
    nodes: tuple[str, ...]
    ranks_per_node: int
    master_port: int
    cwd: str
    env: Mapping[str, str] = field(default_factory=dict)
    whole_life_state: int = 0
    timeouts: Timeouts = field(default_factory=Timeouts)
    prolog: tuple[str, ...] = ()
    """A node health check run once per node before its ranks start (empty: none)."""
    account: Mapping[str, Any] | None = None
    """The Unix account the attempt runs as (:meth:`Account.to_json
    <fireflyer.platform.accounts.Account.to_json>`); None: the daemon's own."""
    fault_tolerant: bool = False
    """Each node a replica group of torchft (:mod:`fireflyer.platform.attempt.replicas`): a lost node is replaced."""

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.ranks_per_node

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["env"] = dict(self.env)
        data["account"] = None if self.account is None else dict(self.account)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Launch":
        data = dict(data)
        data["timeouts"] = Timeouts(**data.get("timeouts", {}))
        for key in ("command", "nodes", "prolog"):
            data[key] = tuple(data.get(key, ()))
        return cls(**data)


class Executor(Protocol):
    """Starts, watches and kills attempts' supervisors."""

    name: str

    def launch(self, launch: Launch, attempt_dir: str) -> str:
        """Start the attempt's supervisor; returns its handle. ``spec.json`` is already written."""

    def alive(self, handle: str) -> bool:
        """Whether the attempt's supervisor is running or still waiting to run."""

    def kill(self, handle: str) -> None:
        """End the attempt at once: its supervisor and every rank. Idempotent."""

    def find(self, task_id: int, attempt_dir: str) -> str | None:
        """The handle of an attempt that ``launch`` started but whose handle was never recorded (the daemon
        stopped in between), found by its attempt directory; None when no such attempt runs or waits."""
