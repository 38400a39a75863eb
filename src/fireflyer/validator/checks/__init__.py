"""The validator's checks, in the order they run (cheap reads first, stress last)."""

from __future__ import annotations

from fireflyer.validator.checks.allreduce import HFReduceAllreduce, NcclAllreduce
from fireflyer.validator.checks.base import (
    Check,
    CheckContext,
    CheckSettings,
    Findings,
    RunOptions,
    SkipCheck,
)
from fireflyer.validator.checks.cpu import (
    CpuFrequency,
    CpuGemm,
    CpuStress,
    MemoryBandwidth,
)
from fireflyer.validator.checks.gpu import GpuBandwidth, GpuGemm, GpuMemory
from fireflyer.validator.checks.links import NicLinks
from fireflyer.validator.checks.storage import StorageBandwidth
from fireflyer.validator.checks.xid_log import XidErrors

ALL_CHECKS: dict[str, type[Check]] = {c.name: c for c in (
    CpuFrequency, NicLinks, XidErrors, CpuGemm, CpuStress, MemoryBandwidth,
    GpuBandwidth, GpuMemory, GpuGemm, HFReduceAllreduce, NcclAllreduce, StorageBandwidth,
)}

__all__ = ["ALL_CHECKS", "Check", "CheckContext", "CheckSettings", "Findings", "RunOptions", "SkipCheck"]
