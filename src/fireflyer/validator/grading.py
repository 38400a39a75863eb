"""Grades: how a measured value compares with what the hardware profile expects.

A check measures one or more *metrics* (``cpu_gemm.gflops``, ``storage.write``). Each metric
with an expectation is graded against two thresholds, given as fractions of the expected
value: below ``fail_below`` it FAILs, below ``warn_below`` it WARNs, otherwise it PASSes.
A check's status is the worst of its metrics and of its own verdicts (a wrong allreduce
result FAILs whatever its speed). SKIP means the check could not run here (no GPU, no
permission) and says why; it never makes a node unhealthy.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from fireflyer.errors import UserError


class Status(enum.IntEnum):
    """Outcome of a check or a metric, ordered from best to worst (SKIP ranks below PASS)."""

    SKIP = 0
    PASS = 1
    WARN = 2
    FAIL = 3

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """When a higher-is-better metric is unhealthy, as fractions of its expected value."""

    warn_below: float = 0.8
    """WARN when ``measured < warn_below * expected``."""
    fail_below: float = 0.5
    """FAIL when ``measured < fail_below * expected``."""

    def __post_init__(self) -> None:
        for name in ("warn_below", "fail_below"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise UserError(f"{name} must be a fraction of the expected value in [0, 1], got {value!r}")
        if self.fail_below > self.warn_below:
            raise UserError(f"fail_below ({self.fail_below}) must not exceed warn_below ({self.warn_below})")


def grade(measured: float, expected: float | None, thresholds: Thresholds) -> tuple[Status, str]:
    """Grade a higher-is-better ``measured`` value; return the status and a one-line reason."""
    if expected is None:
        return Status.PASS, "measured (no expectation in the profile)"
    if expected <= 0:
        return Status.PASS, "measured (expectation is zero)"
    ratio = measured / expected
    if ratio < thresholds.fail_below:
        return Status.FAIL, f"{ratio:.0%} of expected, below the fail threshold {thresholds.fail_below:.0%}"
    if ratio < thresholds.warn_below:
        return Status.WARN, f"{ratio:.0%} of expected, below the warn threshold {thresholds.warn_below:.0%}"
    return Status.PASS, f"{ratio:.0%} of expected"


def worst(statuses: Iterable[Status], default: Status = Status.PASS) -> Status:
    """The worst status of ``statuses``; ``default`` when there are none."""
    return max(statuses, default=default)


@dataclass(kw_only=True)
class Metric:
    """One measured value of a check, with what was expected and its grade."""

    name: str
    value: float
    unit: str
    expected: float | None = None
    status: Status = Status.PASS
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "unit": self.unit, "expected": self.expected,
                "status": str(self.status), "reason": self.reason}


@dataclass(kw_only=True)
class CheckResult:
    """What one check found: its status, why, its metrics, and details for the JSON report."""

    name: str
    status: Status
    reason: str
    metrics: list[Metric] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": str(self.status), "reason": self.reason,
                "seconds": round(self.seconds, 3), "metrics": [m.to_json() for m in self.metrics],
                "details": self.details}


def node_status(results: Iterable[CheckResult], *, warn_is_failure: bool = False) -> Status:
    """The node's overall status; with ``warn_is_failure`` a WARN counts as a FAIL."""
    status = worst((r.status for r in results), default=Status.PASS)
    if warn_is_failure and status == Status.WARN:
        return Status.FAIL
    return status


def exit_code(status: Status) -> int:
    """Exit code for Slurm's HealthCheckProgram: 0 healthy (PASS, WARN, SKIP), 1 on FAIL."""
    return 1 if status == Status.FAIL else 0
