"""CPU and memory checks: GEMM throughput, a verified stress run, memory bandwidth, frequency.

Paper §VII-B lists "CPU stress and memory bandwidth" and "hardware frequency". The stress run
multiplies integer-valued fp32 matrices whose every partial sum is exactly representable, so
the result is bit-exact whatever order the BLAS adds in: any difference from the reference is
a computation fault (silent data corruption), not rounding.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, ClassVar

from fireflyer.validator.checks.base import Check, CheckContext, Findings, SkipCheck


SHARED = 0.5
"""Below this :func:`cpu_share`, a throughput check says that the node was shared while it measured."""


def cpu_share(cpu_seconds: float, wall_seconds: float, threads: int) -> float:
    """The share of its cores a measurement got: CPU seconds over wall seconds times threads (1.0 on a quiet
    node; far less where other work shares the cores, and then a low rate says so, not that the node is slow)."""
    return round(cpu_seconds / max(wall_seconds * max(threads, 1), 1e-9), 3)


def record_share(out: Findings, cpu_started: float, wall_seconds: float) -> None:
    """Put the measurement's threads and :func:`cpu_share` (since ``cpu_started``, a ``process_time``) in its
    details, and say so in the reason where it got under :data:`SHARED` of its cores' time."""
    import torch

    threads = torch.get_num_threads()
    share = cpu_share(time.process_time() - cpu_started, wall_seconds, threads)
    out.details.update(threads=threads, cpu_share=share)
    if share < SHARED:
        out.note(f"it got {share:.0%} of its cores' time: other work shares this node")


class CpuGemm(Check):
    """fp32 matrix multiply on every core: sustained GFLOP/s."""

    name = "cpu_gemm"
    title = "CPU GEMM"
    metrics: ClassVar[dict[str, str]] = {"gflops": "GFLOP/s"}
    params: ClassVar[dict[str, Any]] = {"n": 2048, "quick_n": 512}
    budget_s = 10.0
    quick_budget_s = 0.5

    def _measure(self, ctx: CheckContext, out: Findings) -> None:
        import torch

        n = ctx.param("quick_n" if ctx.quick else "n")
        a, b = torch.randn(n, n), torch.randn(n, n)
        c = torch.empty(n, n)
        torch.mm(a, b, out=c)  # warm-up: thread pool, packing buffers
        iters, t0, c0 = 0, time.perf_counter(), time.process_time()
        while iters < 2 or ctx.time_left() > 0:
            torch.mm(a, b, out=c)
            iters += 1
        seconds = time.perf_counter() - t0
        out.metric("gflops", 2 * n**3 * iters / seconds / 1e9)
        out.details.update(n=n, iterations=iters)
        record_share(out, c0, seconds)


class CpuStress(Check):
    """Every core multiplies integer-valued matrices for the whole budget; each product is
    compared bit for bit with a reference computed once in float64."""

    name = "cpu_stress"
    title = "CPU stress (verified)"
    metrics: ClassVar[dict[str, str]] = {"gflops": "GFLOP/s"}
    params: ClassVar[dict[str, Any]] = {"n": 1024, "pairs": 4}
    budget_s = 30.0
    quick_budget_s = 0.5

    def _measure(self, ctx: CheckContext, out: Findings) -> None:
        import torch

        n = 256 if ctx.quick else ctx.param("n")
        gen = torch.Generator().manual_seed(20240826)
        # |entries| <= 8, so |partial sums| <= 64 n < 2**24: exact in fp32 in any summation order.
        pairs = []
        for _ in range(ctx.param("pairs")):
            a = torch.randint(-8, 9, (n, n), generator=gen).float()
            b = torch.randint(-8, 9, (n, n), generator=gen).float()
            pairs.append((a, b, (a.double() @ b.double()).float()))
        c = torch.empty(n, n)
        iters = wrong = 0
        t0, c0 = time.perf_counter(), time.process_time()
        while iters < len(pairs) or ctx.time_left() > 0:
            a, b, ref = pairs[iters % len(pairs)]
            torch.mm(a, b, out=c)
            bad = int((c != ref).sum())
            if bad:
                wrong += bad
                out.details.setdefault("first_mismatch_iteration", iters)
            iters += 1
        seconds = time.perf_counter() - t0
        out.metric("gflops", 2 * n**3 * iters / seconds / 1e9)
        out.details.update(n=n, iterations=iters, wrong_elements=wrong)
        record_share(out, c0, seconds)
        if wrong:
            out.fail(f"{wrong} wrong elements in {iters} verified products: the CPU computes wrong results")
        else:
            out.note(f"{iters} products of {n}x{n} verified bit-exact")


class MemoryBandwidth(Check):
    """STREAM-like copy and triad over buffers far larger than the caches, all cores at once."""

    name = "memory_bandwidth"
    title = "Memory bandwidth"
    metrics: ClassVar[dict[str, str]] = {"copy": "GB/s", "triad": "GB/s"}
    params: ClassVar[dict[str, Any]] = {"mib": 512, "quick_mib": 64}
    budget_s = 10.0
    quick_budget_s = 0.6

    def _measure(self, ctx: CheckContext, out: Findings) -> None:
        import torch

        mib = ctx.param("quick_mib" if ctx.quick else "mib")
        n = mib * (1 << 20) // 4
        a, b, c = torch.ones(n), torch.full((n,), 2.0), torch.empty(n)
        c.copy_(a)
        best_copy = best_triad = 0.0
        trials = 0
        w0, c0 = time.perf_counter(), time.process_time()
        while trials < 2 or ctx.time_left() > 0:
            t0 = time.perf_counter()
            c.copy_(a)
            t1 = time.perf_counter()
            torch.add(b, a, alpha=3.0, out=c)  # triad: c = b + 3a
            t2 = time.perf_counter()
            best_copy = max(best_copy, 2 * 4 * n / (t1 - t0) / 1e9)   # read a, write c
            best_triad = max(best_triad, 3 * 4 * n / (t2 - t1) / 1e9)  # read a and b, write c
            trials += 1
        if float(c[n // 2]) != 5.0 or float(c[-1]) != 5.0:
            out.fail("triad produced a wrong value")
        out.metric("copy", best_copy)
        out.metric("triad", best_triad)
        out.details.update(buffer_mib=mib, trials=trials)
        record_share(out, c0, time.perf_counter() - w0)


def read_cpu_frequencies(sysfs_root: str = "/sys", procfs_root: str = "/proc") -> dict[str, object]:
    """Per-core frequencies in MHz from cpufreq sysfs, else ``cpu MHz`` in /proc/cpuinfo.

    Returns ``source``, ``cores`` (online), ``max_mhz`` (per core: the highest frequency the
    core may run at now, i.e. the policy cap ``scaling_max_freq``), ``cur_mhz`` and ``governors``.
    """
    base = Path(sysfs_root) / "devices/system/cpu"
    cur: list[float] = []
    cap: list[float] = []
    governors: set[str] = set()
    for core in sorted(base.glob("cpu[0-9]*"), key=lambda p: int(p.name[3:])):
        freq = core / "cpufreq"
        if not freq.is_dir():
            continue
        online = core / "online"
        if online.exists() and online.read_text().strip() == "0":
            continue
        cur.append(int((freq / "scaling_cur_freq").read_text()) / 1000)
        cap_file = freq / "scaling_max_freq"
        cap.append(int((cap_file if cap_file.exists() else freq / "cpuinfo_max_freq").read_text()) / 1000)
        gov = freq / "scaling_governor"
        if gov.exists():
            governors.add(gov.read_text().strip())
    if cur:
        return {"source": "cpufreq", "cores": len(cur), "max_mhz": cap, "cur_mhz": cur, "governors": sorted(governors)}
    try:
        text = (Path(procfs_root) / "cpuinfo").read_text()
    except OSError as exc:
        raise SkipCheck(f"no cpufreq in {base} and cannot read cpuinfo: {exc}") from exc
    mhz = [float(line.split(":", 1)[1]) for line in text.splitlines() if line.startswith("cpu MHz")]
    if not mhz:
        raise SkipCheck(f"no cpufreq in {base} and no 'cpu MHz' in {procfs_root}/cpuinfo")
    return {"source": "cpuinfo", "cores": len(mhz), "max_mhz": mhz, "cur_mhz": mhz, "governors": []}


class CpuFrequency(Check):
    """Core count and the slowest core's frequency cap (a throttled or BIOS-capped core shows here)."""

    name = "cpu_freq"
    title = "CPU frequency"
    metrics: ClassVar[dict[str, str]] = {"min_max_mhz": "MHz", "mean_cur_mhz": "MHz"}
    params: ClassVar[dict[str, Any]] = {"min_cores": 1, "governor": ""}
    budget_s = 2.0
    quick_budget_s = 0.5

    def _measure(self, ctx: CheckContext, out: Findings) -> None:
        info = read_cpu_frequencies(ctx.options.sysfs_root, ctx.options.procfs_root)
        out.metric("min_max_mhz", min(info["max_mhz"]))
        out.metric("mean_cur_mhz", sum(info["cur_mhz"]) / len(info["cur_mhz"]), grade_it=False)
        out.details.update(source=info["source"], cores=info["cores"], governors=info["governors"],
                           os_cpu_count=os.cpu_count())
        if info["source"] == "cpuinfo":
            out.note("no cpufreq: /proc/cpuinfo's current frequency stands in for the cap")
        want_cores = ctx.param("min_cores")
        if info["cores"] < want_cores:
            out.fail(f"{info['cores']} cores online, the profile expects at least {want_cores}")
        want_gov = ctx.param("governor")
        if want_gov and info["governors"] and info["governors"] != [want_gov]:
            out.warn(f"cpufreq governor {','.join(info['governors'])}, the profile expects {want_gov}")
