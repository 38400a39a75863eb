"""The health-check interface: one class per check, small hooks, guarded public methods.

A :class:`Check` declares its name, the metrics it measures (with units), the parameters a
profile may set (with defaults, whose types the profile loader enforces) and its time
budget for a full and a ``--quick`` run. :meth:`Check.run` is the guarded entry point: it
asks :meth:`Check.skip_reason` whether the check applies here, calls the :meth:`Check._measure`
hook with a :class:`Findings` recorder, and turns any exception into a FAIL that carries the
error. Checks never raise out of ``run``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar

from fireflyer.validator.grading import (
    CheckResult,
    Metric,
    Status,
    Thresholds,
    grade,
    worst,
)
from fireflyer.errors import UserError


@dataclass(frozen=True, kw_only=True)
class CheckSettings:
    """A profile's settings for one check: expectations, thresholds, budget, parameters."""

    enabled: bool = True
    thresholds: Thresholds = field(default_factory=Thresholds)
    expect: dict[str, float] = field(default_factory=dict)
    """Expected value per metric name (a metric without one is reported, not graded)."""
    budget_s: float | None = None
    """Seconds for a full run; None: the check's own default."""
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """What the command line says about this run, shared by every check."""

    quick: bool = False
    """A fast run: every check uses its short budget and small sizes (a few seconds in all)."""
    storage_path: str | None = None
    """Directory for the storage check; None: the profile's ``path``, else the temp directory."""
    storage_mb: int | None = None
    """Size of the storage check's file; None: the profile's ``size_mb``."""
    xid_log: str | None = None
    """Kernel log file for the Xid check; None: ``journalctl -k``, else ``dmesg``."""
    since: datetime | None = None
    """Only Xid lines at or after this time count; None: the whole log (since boot for dmesg)."""
    sysfs_root: str = "/sys"
    procfs_root: str = "/proc"
    ranks: int | None = None
    """Ranks of the allreduce checks; None: one per GPU, or min(4, 2 x cores) on CPU."""
    budget_scale: float = 1.0
    """Multiplies every budget (``--budget-scale``)."""

    def __post_init__(self) -> None:
        if self.storage_mb is not None and self.storage_mb < 1:
            raise UserError(f"storage_mb must be at least 1, got {self.storage_mb}")
        if self.ranks is not None and self.ranks < 1:
            raise UserError(f"ranks must be at least 1, got {self.ranks}")
        if not self.budget_scale > 0:
            raise UserError(f"budget_scale must be positive, got {self.budget_scale}")


@dataclass(frozen=True, kw_only=True)
class CheckContext:
    """Everything one check run sees: the options, its settings and its deadline."""

    options: RunOptions
    settings: CheckSettings
    defaults: dict[str, Any]
    budget_s: float
    started: float = field(default_factory=time.monotonic)

    @property
    def quick(self) -> bool:
        return self.options.quick

    def param(self, name: str) -> Any:
        """A parameter from the profile, else the check's default."""
        return self.settings.params.get(name, self.defaults[name])

    def time_left(self) -> float:
        """Seconds left of this check's budget (never negative)."""
        return max(0.0, self.started + self.budget_s - time.monotonic())


class SkipCheck(Exception):
    """Raised inside a check: it cannot run here (the message says why). Becomes SKIP."""


class Findings:
    """Collects a check's metrics and verdicts while it runs, then grades them."""

    def __init__(self, check: Check, settings: CheckSettings) -> None:
        self._check = check
        self._settings = settings
        self.metrics: list[Metric] = []
        self.verdicts: list[tuple[Status, str]] = []
        self.notes: list[str] = []
        self.details: dict[str, Any] = {}

    def metric(self, name: str, value: float, *, where: str = "", grade_it: bool = True) -> Metric:
        """Record metric ``name`` (declared by the check), graded against the profile.

        ``where`` names the device it was measured on (``cuda:0``, ``mlx5_0/1``): the metric is
        then reported as ``name@where`` and graded against ``name``'s expectation.
        """
        unit = self._check.metrics[name]
        expected = self._settings.expect.get(name) if grade_it else None
        status, why = grade(value, expected, self._settings.thresholds)
        m = Metric(name=f"{name}@{where}" if where else name, value=round(float(value), 3), unit=unit,
                   expected=expected, status=status, reason=why)
        self.metrics.append(m)
        return m

    def fail(self, reason: str) -> None:
        self.verdicts.append((Status.FAIL, reason))

    def warn(self, reason: str) -> None:
        self.verdicts.append((Status.WARN, reason))

    def note(self, reason: str) -> None:
        """Something worth saying that does not change the grade."""
        self.notes.append(reason)

    def result(self, seconds: float) -> CheckResult:
        graded = [(m.status, f"{m.name} {m.value:g} {m.unit}: {m.reason}") for m in self.metrics]
        status = worst([s for s, _ in self.verdicts + graded], default=Status.PASS)
        if status in (Status.WARN, Status.FAIL):
            reason = "; ".join(why for s, why in self.verdicts + graded if s == status)
            if self.notes:
                reason += " [" + "; ".join(self.notes) + "]"
        elif self.notes:
            reason = "; ".join(self.notes)
        elif any(m.expected is not None for m in self.metrics):
            reason = "within expectations"
        else:
            reason = "ok"
        return CheckResult(name=self._check.name, status=status, reason=reason, metrics=self.metrics,
                           details=self.details, seconds=seconds)


class Check:
    """Base class of a node health check. Subclasses set the class attributes and ``_measure``."""

    name: ClassVar[str]
    """Name on the command line (``--checks``) and in profiles (``[checks.NAME]``)."""
    title: ClassVar[str]
    metrics: ClassVar[dict[str, str]] = {}
    """Metric name -> unit. Every expectation a profile gives must name one of these."""
    params: ClassVar[dict[str, Any]] = {}
    """Parameters a profile may set, with their defaults (which fix their types)."""
    budget_s: ClassVar[float] = 10.0
    quick_budget_s: ClassVar[float] = 1.0
    needs_gpu: ClassVar[bool] = False

    def skip_reason(self, ctx: CheckContext) -> str | None:
        """Why this check does not apply here, or None when it does. Must not raise."""
        if self.needs_gpu:
            from fireflyer.validator.checks.gpu_common import cuda_skip_reason

            return cuda_skip_reason()
        return None

    def budget(self, options: RunOptions, settings: CheckSettings) -> float:
        """Seconds this check may take in this run."""
        if options.quick:
            base = self.quick_budget_s
        else:
            base = settings.budget_s if settings.budget_s is not None else self.budget_s
        return base * options.budget_scale

    def run(self, ctx: CheckContext) -> CheckResult:
        """Run the check; every outcome, an exception included, is a :class:`CheckResult`."""
        t0 = time.monotonic()
        findings = Findings(self, ctx.settings)
        try:
            reason = self.skip_reason(ctx)
            if reason is None:
                self._measure(ctx, findings)
        except SkipCheck as exc:
            reason = str(exc)
        except Exception as exc:  # noqa: BLE001  (a broken check is a failed check, never a crashed validator)
            return CheckResult(name=self.name, status=Status.FAIL,
                               reason=f"check raised {type(exc).__name__}: {exc}",
                               metrics=findings.metrics, details=findings.details,
                               seconds=time.monotonic() - t0)
        if reason is not None:
            return CheckResult(name=self.name, status=Status.SKIP, reason=reason, seconds=time.monotonic() - t0)
        return findings.result(time.monotonic() - t0)

    def _measure(self, ctx: CheckContext, out: Findings) -> None:
        raise NotImplementedError
