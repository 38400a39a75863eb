"""The platform's settings, kept in ``HOME/platform.json`` by ``fireflyer platform start``."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from fireflyer.platform.executors.base import Timeouts
from fireflyer.platform.layout import Home, read_json, write_json
from fireflyer.platform.state.policy import Node, PolicyConfig
from fireflyer.errors import UserError

EXECUTORS = ("local", "slurm")
_POLICY_FIELDS = frozenset(f.name for f in dataclasses.fields(PolicyConfig))


@dataclass(frozen=True, kw_only=True)
class PlatformConfig:
    executor: str = "local"
    """``local`` (emulated nodes on this machine) or ``slurm`` (the nodes of a real Slurm cluster)."""
    nodes: int = 2
    """Emulated nodes (local executor)."""
    zones: int = 1
    """Zones the emulated nodes are split into, in order (node0.. in zone0, ...)."""
    ranks_per_node: int = 1
    """Ranks a task starts per node unless it asks otherwise (GPUs per node on a real cluster)."""
    slots_per_node: int | None = None
    """The most ranks a task may start on one node; default: this machine's CPU count (the cores
    one emulated node may use), so no task can start a flood of processes."""
    tick: float = 1.0
    """Seconds between scheduling cycles (HAI: 1 s)."""
    max_restarts: int = 3
    """Restarts after a failed rank, per chain, before a task is left failed."""
    policy: PolicyConfig = field(default_factory=lambda: PolicyConfig(default_quota="half"))
    """The scheduler's settings: turn-taking (``time_share_after``), zones (``max_cross_zone``),
    demotion (``demote_after``) and the default quota. The platform's default quota is ``"half"``:
    a user without a quota row (their own or ``public``) holds half the platform's nodes, rounded
    up, for sure per group and priority; beyond them their tasks only borrow idle nodes, and are
    the first suspended when another task needs them. None: no default (anyone may hold every node)."""
    prolog: tuple[str, ...] = ()
    """A health check run for each node before a task's ranks start there; a node that fails it is drained."""
    partition: str | None = None
    """Slurm partition (slurm executor)."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    runs_dir: str | None = None
    """Where attempt folders live (absolute). Default: ``HOME/tasks``, inside the private home, which
    is right while every task runs as the platform's own account. An isolating platform needs a
    folder every user can reach (the daemon makes it, open to enter but not to list) on a
    filesystem every node sees."""
    isolate: bool = False
    """Run every task as its owner's Unix account even before any user maps to an account other
    than the daemon's (a daemon run as a service account); see :mod:`fireflyer.platform.accounts`."""
    allow_root_tasks: bool = False
    """Whether a user mapped to root may run tasks (as root) on an isolating platform."""

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise UserError(f"unknown executor {self.executor!r}; choose one of {', '.join(EXECUTORS)}")
        if self.slots_per_node is not None and (not isinstance(self.slots_per_node, int)
                                                or not self.ranks_per_node <= self.slots_per_node <= 100_000):
            raise UserError(f"slots_per_node must be an integer from ranks_per_node to 100000, got {self.slots_per_node!r}")
        for name in ("nodes", "zones", "ranks_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{name} must be a positive integer, got {value!r}")
        if self.zones > self.nodes:
            raise UserError(f"{self.zones} zones need at least as many nodes, got {self.nodes}")
        if not self.tick > 0:
            raise UserError(f"tick must be positive seconds, got {self.tick!r}")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise UserError(f"max_restarts must be a non-negative integer, got {self.max_restarts!r}")
        if self.runs_dir is not None and (not isinstance(self.runs_dir, str) or not os.path.isabs(self.runs_dir)):
            raise UserError(f"runs_dir must be an absolute path, got {self.runs_dir!r}")
        for name in ("isolate", "allow_root_tasks"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.policy, PolicyConfig):
            raise UserError(f"policy must be a PolicyConfig, got {type(self.policy).__name__}")

    def slots(self) -> int:
        """The most ranks per node a task may ask for."""
        return self.slots_per_node or max(os.cpu_count() or 1, self.ranks_per_node)

    def emulated_nodes(self) -> list[Node]:
        width = len(str(self.nodes - 1))
        return [Node(f"node{i:0{width}d}" if width > 1 else f"node{i}", f"zone{i * self.zones // self.nodes}")
                for i in range(self.nodes)]

    def replace(self, **changes: Any) -> "PlatformConfig":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "PlatformConfig":
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)} | _POLICY_FIELDS
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"unknown platform settings: {', '.join(unknown)}")
        # A platform.json from before the policy settings were nested keeps them at the top level.
        policy = {**{k: data.pop(k) for k in _POLICY_FIELDS if k in data}, **data.get("policy", {})}
        data["policy"] = PolicyConfig(**{"default_quota": "half", **policy})
        data["timeouts"] = Timeouts(**data.get("timeouts", {}))
        data["prolog"] = tuple(data.get("prolog", ()))
        return cls(**data)


def load(home: Home) -> PlatformConfig | None:
    data = read_json(home.config)
    return None if data is None else PlatformConfig.from_json(data)


def save(home: Home, cfg: PlatformConfig) -> None:
    write_json(home.config, cfg.to_json(), sort_keys=True)
