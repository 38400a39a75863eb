"""Goodput at scale: checkpoint-restart against fault-tolerant training, as the job grows.

*Goodput* (FT-HSDP's "effective training time") is useful training time over wall time. It
falls as a job grows because failures come faster while each one costs as much. Everything
here is pure: numbers in, numbers out. The command, ``fireflyer simulate goodput``, is
:mod:`fireflyer.validator.goodput_cli`.

**Failures.** Every GPU fails independently at the same rate (a Poisson process), so a job on
``N`` GPUs fails every ``M = MTBF_gpu / N`` on average. ``MTBF_gpu`` is given, or comes from
Fire-Flyer 2's year of failure data (:func:`paper_rates`: the job-stopping Xids of Table VI,
the catalogue's ``interrupts`` flag deciding which, plus Table VII's CPU memory errors and
InfiniBand flash cuts).

**Checkpoint-restart** (the paper's design, §VII-A). The job saves every ``τ`` seconds, each
save stalling it ``C`` seconds; a failure loses the work since the last save, ``τ/2`` on
average, and the restart ``R``. ``τ`` is Young's ``√(2·C·M)``
(:func:`~fireflyer.validator.failures.young_daly_interval`) unless given. The goodput is
Daly's (2006) exact expectation for Poisson failures, which may also strike during a restart
or a save::

    goodput = τ / (M · e^(R/M) · (e^((τ+C)/M) − 1))

To first order this is ``1 − C/τ − (R + τ/2)/M``: half an interval plus the restart lost per
failure. Unlike the first-order form it stays in (0, 1) when failures come faster than restarts.

**Fault-tolerant training** (torchft, FT-HSDP). A failure stalls the whole job ``S`` seconds
while the quorum re-forms; then the survivors go on while the failed replica is replaced and
heals from a live one (``H`` seconds, the *rejoin*). The job makes progress at time ``t``
unless a failure struck in ``(t − S, t]``, so (overlapping stalls merging) the stall costs a
factor ``e^(−S/M)``, which is Daly's formula with ``R = S`` and free checkpoints. Given the
GPUs per data-parallel replica, the reduced throughput counts too: on average ``H/M``
replicas are out healing (Little's law), each taking its share of the work, a factor
``1 − H/(M·replicas)``. Fault-tolerant training needs two replicas at least. Its occasional
disaster checkpoints are left out.

**The FT-HSDP check** (:func:`reproduce_ft_hsdp`). FT-HSDP (arXiv 2602.00277, Jan 2026)
publishes that at O(100K) GPUs a failure stalls a synchronous job 10 minutes, giving 44%
effective training time, and that FT-HSDP's 3-minute stall gives 80%. It does not publish
its failure rate. The job MTBF is *derived* here from the 44% point alone (the 10-minute stall
taken as the whole cost of a failure: ``R = 600 s``, ``C = 0``), and the model then *predicts*
the 80% point from the 3-minute stall at that MTBF; the prediction's error is the check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from fireflyer.errors import UserError
from fireflyer.validator.failures import young_daly_interval
from fireflyer.validator.xid import TABLE_VI, XidClass, lookup

MAX_GPUS = 1_000_000
"""The largest job modelled."""

DEFAULT_GPUS: tuple[int, ...] = (1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000)

# ---------------------------------------------------------------- recovery times measured here

DEFAULT_FT_STALL_S = 2.1
"""Fault-tolerant stall: one replica SIGKILLed → the survivor's next committed step. Measured on
this project's 2-core host (2.05-2.16 s, median of 3) with torchft 0.2.0's Lighthouse and Manager
over hfreduce, two one-rank replica groups of the tests' job (``testing/jobs/ft_replica.py``),
the Lighthouse's heartbeat timeout 2 s, which is most of it. ``fireflyer bench recovery``'s
``stall_s``."""

DEFAULT_REJOIN_S = 1.7
"""Rejoin: the replacement replica started → its first step in the full quorum, having healed
from the live replica over the network (same setup, 1.71 s in each of 3 runs, Python and torch
start-up included). ``fireflyer bench recovery``'s ``rejoin_s``."""

DEFAULT_RESTART_S = 4.0
"""Checkpoint-restart's restart: ``fireflyer train --preset tiny --resume`` started → its first
step (3.7-4.2 s over 3 runs): relaunching 2 emulated nodes, their process groups, loading the
checkpoint. Noticing the failure and rescheduling the job are not in it."""

DEFAULT_CHECKPOINT_WRITE_S = 0.10
"""The training stall of one asynchronous save of 1 GB a rank (``stall_if_step_at_once_s`` of
``fireflyer bench checkpoint``, benchmarks/results/checkpoint.json: 0.10 s; the save persists in
the background in about 1 s)."""

# ---------------------------------------------------------------- the paper's failure data

FIRE_FLYER_GPUS = 10_000
"""Fire-Flyer 2's PCIe A100s, over which Tables VI-VIII were counted."""

HOURS_PER_YEAR = 365 * 24.0

TABLE_VII_MONTHS = 6
TABLE_VII_NON_XID: dict[str, int] = {"CPU memory ECC": 54, "InfiniBand flash cuts": 89}
"""Table VII's columns that are not Xids (October 2023 to March 2024). Its Xid columns are the
same kind of events as Table VI's and are not counted twice."""


@dataclass(frozen=True, kw_only=True)
class FailureRates:
    """Job-stopping failures a year on a cluster, by source, and the MTBF of one GPU they give."""

    per_year: dict[str, float]
    gpus: int
    source: str

    @property
    def total(self) -> float:
        return sum(self.per_year.values())

    @property
    def gpu_mtbf_hours(self) -> float:
        return self.gpus * HOURS_PER_YEAR / self.total

    def to_dict(self) -> dict[str, object]:
        return {"per_year": self.per_year, "gpus": self.gpus, "source": self.source, "total_per_year": self.total,
                "gpu_mtbf_hours": self.gpu_mtbf_hours}


def paper_rates(*, hardware_only: bool = False) -> FailureRates:
    """Fire-Flyer 2's failures a year on 10,000 GPUs: Table VI's Xids that stop a job (by class)
    plus Table VII's CPU memory errors and flash cuts, doubled from its six months.

    ``hardware_only`` leaves out the Xids that applications trigger (13 and 31: a bug in the
    job, not a broken GPU). The counts are log messages, not deduplicated incidents, so the
    rates are an upper bound (the MTBF a lower one)."""
    per_year: dict[str, float] = {}
    for code, n in TABLE_VI.items():
        x = lookup(code)
        if not x.interrupts or (hardware_only and x.xid_class is XidClass.SOFTWARE):
            continue
        key = f"Xid {x.xid_class.value}"
        per_year[key] = per_year.get(key, 0) + n
    for name, n in TABLE_VII_NON_XID.items():
        per_year[name] = n * 12 / TABLE_VII_MONTHS
    what = "hardware " if hardware_only else ""
    return FailureRates(per_year=per_year, gpus=FIRE_FLYER_GPUS,
                        source=f"Fire-Flyer 2's Tables VI-VII ({what}job-stopping failures)")


def gpu_mtbf_from_node(node_mtbf_hours: float, gpus_per_node: int) -> float:
    """A node's MTBF as one GPU's: a node of ``g`` GPUs failing every ``M`` hours is ``g`` GPUs
    each failing every ``g·M``."""
    _check_positive("node MTBF (hours)", node_mtbf_hours)
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise UserError(f"GPUs per node must be a whole number >= 1, got {gpus_per_node!r}")
    return node_mtbf_hours * gpus_per_node


# ---------------------------------------------------------------- the model

def _check_positive(what: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UserError(f"{what} must be a number > 0, got {value!r}")


def _check_non_negative(what: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise UserError(f"{what} must be a number >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Recovery:
    """What a failure and a checkpoint cost, in seconds. The defaults were measured on this host."""

    ft_stall_s: float = DEFAULT_FT_STALL_S
    """Fault-tolerant: the whole job's stall per failure, while the quorum re-forms."""
    rejoin_s: float = DEFAULT_REJOIN_S
    """Fault-tolerant: how long a failed replica is out before it trains again (replacement and healing)."""
    restart_s: float = DEFAULT_RESTART_S
    """Checkpoint-restart: from the failure to training again from the last save."""
    checkpoint_write_s: float = DEFAULT_CHECKPOINT_WRITE_S
    """Checkpoint-restart: how long one save stalls training (Young's C)."""
    checkpoint_interval_s: float | None = None
    """Checkpoint-restart: seconds between saves; ``None`` for Young's √(2·C·M) at each job size."""

    def __post_init__(self) -> None:
        for name in ("ft_stall_s", "rejoin_s", "restart_s", "checkpoint_write_s"):
            _check_non_negative(name, getattr(self, name))
        if self.checkpoint_interval_s is not None:
            _check_positive("checkpoint_interval_s", self.checkpoint_interval_s)


@dataclass(frozen=True, kw_only=True)
class GoodputConfig:
    """A goodput study: one GPU's MTBF, the recovery costs, and optionally the replica size."""

    gpu_mtbf_hours: float
    """Mean time between job-stopping failures of one GPU (a node's failures spread over its GPUs)."""
    recovery: Recovery = field(default_factory=Recovery)
    replica_gpus: int | None = None
    """GPUs per data-parallel replica; given, fault-tolerant goodput counts the replicas out
    healing. ``None`` leaves the reduced throughput out."""

    def __post_init__(self) -> None:
        _check_positive("gpu_mtbf_hours", self.gpu_mtbf_hours)
        g = self.replica_gpus
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= MAX_GPUS):
            raise UserError(f"replica_gpus must be a whole number in 1..{MAX_GPUS:,}, got {self.replica_gpus!r}")


def _log_expm1(x: float) -> float:
    """log(e^x − 1) for x > 0, without overflow."""
    return math.log(math.expm1(x)) if x < 50 else x + math.log1p(-math.exp(-x))


def checkpoint_interval(job_mtbf_s: float, recovery: Recovery) -> float:
    """Seconds between saves: the one given, else Young's √(2·C·M)."""
    if recovery.checkpoint_interval_s is not None:
        return recovery.checkpoint_interval_s
    return young_daly_interval(recovery.checkpoint_write_s, job_mtbf_s)


def checkpoint_restart_goodput(job_mtbf_s: float, recovery: Recovery) -> float:
    """Daly's exact goodput of checkpoint-restart: τ / (M·e^(R/M)·(e^((τ+C)/M) − 1))."""
    _check_positive("job MTBF (s)", job_mtbf_s)
    m, r, c = job_mtbf_s, recovery.restart_s, recovery.checkpoint_write_s
    tau = checkpoint_interval(m, recovery)
    if tau == 0:  # free saves after every step: only the restart is lost (the limit τ → 0)
        return math.exp(-r / m)
    return math.exp(math.log(tau / m) - r / m - _log_expm1((tau + c) / m))


def fault_tolerant_goodput(job_mtbf_s: float, recovery: Recovery, *, replicas: int | None = None) -> float:
    """e^(−S/M), times 1 − H/(M·replicas) for the replicas out healing when ``replicas`` is given (>= 2)."""
    _check_positive("job MTBF (s)", job_mtbf_s)
    stalled = math.exp(-recovery.ft_stall_s / job_mtbf_s)
    if replicas is None:
        return stalled
    if replicas < 2:
        raise UserError(f"fault-tolerant training needs 2 replicas or more, got {replicas}")
    return stalled * max(0.0, 1.0 - recovery.rejoin_s / (job_mtbf_s * replicas))


@dataclass(frozen=True, kw_only=True)
class GoodputRow:
    """Both designs at one job size."""

    gpus: int
    job_mtbf_s: float
    failures_per_day: float
    checkpoint_interval_s: float
    lost_per_failure_s: float
    """Checkpoint-restart's first-order loss per failure: half an interval plus the restart."""
    checkpoint_restart: float
    fault_tolerant: float | None
    """``None`` where the job has fewer than two replicas of ``replica_gpus``."""
    replicas: int | None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def check_gpus(gpus: Sequence[int]) -> list[int]:
    """The GPU counts, each a whole number in 1..1,000,000, else a :class:`UserError`."""
    out = list(gpus)
    if not out:
        raise UserError("give at least one GPU count")
    for n in out:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_GPUS:
            raise UserError(f"GPU counts must be whole numbers in 1..{MAX_GPUS:,}, got {n!r}")
    return out


def simulate(gpus: Sequence[int], config: GoodputConfig) -> list[GoodputRow]:
    """Goodput of checkpoint-restart and of fault-tolerant training at each GPU count."""
    rows = []
    rec = config.recovery
    for n in check_gpus(gpus):
        m = config.gpu_mtbf_hours * 3600.0 / n
        tau = checkpoint_interval(m, rec)
        replicas = n // config.replica_gpus if config.replica_gpus is not None else None
        ft = None if replicas is not None and replicas < 2 else fault_tolerant_goodput(m, rec, replicas=replicas)
        rows.append(GoodputRow(
            gpus=n, job_mtbf_s=m, failures_per_day=86400.0 / m, checkpoint_interval_s=tau,
            lost_per_failure_s=tau / 2 + rec.restart_s, checkpoint_restart=checkpoint_restart_goodput(m, rec),
            fault_tolerant=ft, replicas=replicas,
        ))
    return rows


# ---------------------------------------------------------------- FT-HSDP's published figures

@dataclass(frozen=True, kw_only=True)
class Published:
    """Figures a paper publishes: job size, the stall per failure of each design, and their goodput."""

    source: str
    gpus: int
    stall_s: float
    """Synchronous (checkpoint-restart) training's stall per failure."""
    ft_stall_s: float
    goodput: float
    ft_goodput: float


FT_HSDP = Published(
    source="FT-HSDP, arXiv 2602.00277 (Jan 2026), abstract", gpus=100_000, stall_s=600.0, ft_stall_s=180.0,
    goodput=0.44, ft_goodput=0.80,
)
""""Compared with fully synchronous training at O(100K) GPUs, FT-HSDP can reduce the stall time
due to failure recovery from 10 minutes to 3 minutes, increasing effective training time from
44% to 80%." O(100K) is taken as 100,000; only the per-GPU MTBF depends on it."""


@dataclass(frozen=True, kw_only=True)
class Reproduction:
    """The model against a paper: the job MTBF derived from its synchronous point, the fault-tolerant point predicted."""

    published: Published
    job_mtbf_s: float
    """Derived: the job MTBF at which checkpoint-restart with the published stall gives the published goodput."""
    gpu_mtbf_hours: float
    """Derived: that MTBF as one GPU's, at the published job size."""
    goodput: float
    """The model's synchronous goodput at the derived MTBF: the published one, by construction."""
    ft_goodput: float
    """The model's fault-tolerant goodput at the derived MTBF: the prediction checked."""
    first_order: dict[str, float]
    """The fault-tolerant point as simpler stall models predict it (each fitted to the synchronous point the same way)."""

    @property
    def error(self) -> float:
        return self.goodput / self.published.goodput - 1.0

    @property
    def ft_error(self) -> float:
        return self.ft_goodput / self.published.ft_goodput - 1.0

    def recovery(self) -> Recovery:
        return published_recovery(self.published)

    def to_dict(self) -> dict[str, object]:
        return {"published": asdict(self.published), "derived": {"job_mtbf_s": self.job_mtbf_s,
                                                                  "gpu_mtbf_hours": self.gpu_mtbf_hours},
                "model": {"goodput": self.goodput, "ft_goodput": self.ft_goodput},
                "relative_error": {"goodput": self.error, "ft_goodput": self.ft_error},
                "first_order_ft_goodput": self.first_order}


def published_recovery(published: Published) -> Recovery:
    """A paper's stalls as recovery costs: the stall is the whole cost of a failure (no save cost, no rework on top)."""
    return Recovery(restart_s=published.stall_s, checkpoint_write_s=0.0, ft_stall_s=published.ft_stall_s)


def _solve_job_mtbf(target: float, recovery: Recovery) -> float:
    """The job MTBF at which :func:`checkpoint_restart_goodput` is ``target`` (bisection in log M: it rises with M)."""
    lo, hi = math.log(1e-3), math.log(1e12)
    for _ in range(200):
        mid = (lo + hi) / 2
        if checkpoint_restart_goodput(math.exp(mid), recovery) < target:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def reproduce(published: Published = FT_HSDP) -> Reproduction:
    """Derive the job MTBF from the synchronous point, then predict the fault-tolerant point with it."""
    if not 0 < published.goodput < 1:
        raise UserError(f"the published goodput must be between 0 and 1, got {published.goodput}")
    rec = published_recovery(published)
    m = _solve_job_mtbf(published.goodput, rec)
    s, s_ft, g = published.stall_s, published.ft_stall_s, published.goodput
    m_renewal, m_linear = s / (1 / g - 1), s / (1 - g)
    return Reproduction(
        published=published, job_mtbf_s=m, gpu_mtbf_hours=m * published.gpus / 3600.0,
        goodput=checkpoint_restart_goodput(m, rec), ft_goodput=fault_tolerant_goodput(m, rec),
        first_order={"1/(1+S/M)": 1 / (1 + s_ft / m_renewal), "1-S/M": 1 - s_ft / m_linear},
    )


def reproduce_ft_hsdp() -> Reproduction:
    """:func:`reproduce` on FT-HSDP's 44% → 80%."""
    return reproduce(FT_HSDP)


__all__ = [
    "DEFAULT_CHECKPOINT_WRITE_S", "DEFAULT_FT_STALL_S", "DEFAULT_GPUS", "DEFAULT_REJOIN_S", "DEFAULT_RESTART_S",
    "FT_HSDP", "FailureRates", "GoodputConfig", "GoodputRow", "MAX_GPUS", "Published", "Recovery", "Reproduction",
    "check_gpus", "checkpoint_interval", "checkpoint_restart_goodput", "fault_tolerant_goodput", "gpu_mtbf_from_node",
    "paper_rates", "published_recovery", "reproduce", "reproduce_ft_hsdp", "simulate",
]
