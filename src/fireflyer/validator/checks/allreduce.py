"""In-node allreduce: bus bandwidth and verified results, through hfreduce and (on GPUs) NCCL.

Paper §VII-B measures intra-node allreduce from the application level with HFReduce. This
check starts N local ranks with torchrun (:func:`fireflyer.launch.run_local`): one per GPU
when there are at least two, else ``min(4, 2 x cores)`` CPU ranks. Each rank verifies every
result element (see :mod:`fireflyer.validator.allreduce_worker`). Bandwidth follows
nccl-tests: ``algbw = bytes / t`` with t the slowest rank's mean time per op, and
``busbw = algbw * 2 (n - 1) / n``, the traffic each rank's link carries in a ring allreduce.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from fireflyer.validator.checks.base import Check, CheckContext, Findings, SkipCheck
from fireflyer.validator.checks.gpu_common import cuda_skip_reason, gpu_count

STARTUP_S = 20.0
"""Allowance for torchrun and N interpreters importing torch, on top of the budget."""


def busbw(nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s for one allreduce of ``nbytes`` that took ``seconds``."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (world - 1) / world


def default_ranks() -> tuple[int, str]:
    """Ranks and device of the allreduce check on this node."""
    gpus = gpu_count()
    if gpus >= 2:
        return gpus, "cuda"
    return min(4, (os.cpu_count() or 1) * 2), "cpu"


class _AllreduceCheck(Check):
    metrics: ClassVar[dict[str, str]] = {"busbw": "GB/s", "algbw": "GB/s"}
    params: ClassVar[dict[str, Any]] = {"mib": 64, "quick_mib": 4, "iters": 20, "quick_iters": 5}
    budget_s = 60.0
    quick_budget_s = 3.0
    backend: str = "hfreduce"

    def _layout(self, ctx: CheckContext) -> tuple[int, str]:
        ranks, device = default_ranks()
        return (ctx.options.ranks or ranks), device

    def _measure(self, ctx: CheckContext, out: Findings) -> None:
        from fireflyer.launch import LaunchFailed, LocalJob, run_local

        ranks, device = self._layout(ctx)
        if ranks < 2:
            raise SkipCheck(f"an allreduce needs at least 2 ranks, this node gives {ranks}")
        nbytes = ctx.param("quick_mib" if ctx.quick else "mib") << 20
        iters = ctx.param("quick_iters" if ctx.quick else "iters")
        with tempfile.TemporaryDirectory(prefix="fireflyer-validate-allreduce-") as tmp:
            target = ["-m", "fireflyer.validator.allreduce_worker", "--backend", self.backend,
                      "--device", device, "--bytes", str(nbytes), "--iters", str(iters),
                      "--timeout", str(max(10.0, ctx.time_left() + STARTUP_S)), "--out", tmp]
            job = LocalJob(target=target, nodes=1, ranks_per_node=ranks, quiet=True,
                           timeout=ctx.time_left() + STARTUP_S, log_dir=os.path.join(tmp, "logs"))
            try:
                run_local(job)
            except (LaunchFailed, TimeoutError) as exc:
                out.fail(f"{ranks} {device} ranks on {self.backend}: {exc}".replace(tmp, "<tmp>"))
                return
            results = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
        if len(results) != ranks:
            out.fail(f"only {len(results)} of {ranks} ranks reported a result")
            return
        slowest = max(r["mean_s"] for r in results)
        algbw, bus = busbw(results[0]["bytes"], slowest, ranks)
        out.metric("busbw", bus)
        out.metric("algbw", algbw, grade_it=False)
        wrong = sum(r["wrong"] for r in results)
        checked = sum(r["checked_elements"] for r in results)
        out.details.update(backend=self.backend, ranks=ranks, device=device, bytes=results[0]["bytes"],
                           iters=iters, slowest_mean_s=slowest, wrong_elements=wrong,
                           checked_elements=checked, verified=wrong == 0)
        if wrong:
            out.fail(f"{wrong} of {checked} result elements wrong on {self.backend}")
        else:
            out.note(f"{ranks} {device} ranks, {results[0]['bytes'] >> 20} MiB, {checked} elements verified")


class HFReduceAllreduce(_AllreduceCheck):
    """In-node allreduce through the hfreduce backend (CPU ranks, or one rank per GPU)."""

    name = "allreduce"
    title = "In-node allreduce (hfreduce)"
    backend = "hfreduce"


class NcclAllreduce(_AllreduceCheck):
    """In-node allreduce through NCCL, one rank per GPU (needs at least two GPUs)."""

    name = "nccl_allreduce"
    title = "In-node allreduce (NCCL)"
    backend = "nccl"
    needs_gpu = True

    def skip_reason(self, ctx: CheckContext) -> str | None:
        reason = cuda_skip_reason()
        if reason is not None:
            return reason
        import torch.distributed as dist

        if not dist.is_nccl_available():
            return "this torch has no NCCL"
        if gpu_count() < 2:
            return f"NCCL allreduce needs at least 2 GPUs, this node has {gpu_count()}"
        return None

    def _layout(self, ctx: CheckContext) -> tuple[int, str]:
        return gpu_count(), "cuda"
