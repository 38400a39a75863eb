"""GPU checks: memory patterns over free memory, verified GEMM at near-full memory, D2H/H2D bandwidth.

Paper §VII-B: "checking each byte of GPU memory to ensure no data corruption" and "GEMM with
full GPU memory occupancy, to check for logic faults in the GPU chip". Every check skips
with its reason where CUDA is absent; every device is tested in turn.

The GEMM check fills most of free memory with operand matrices M_0..M_{k-1}, times C = M_i
M_{i+1} against the profile's expected TFLOPS, then verifies every product with the
Huang-Abraham checksum C 1 = M_i (M_{i+1} 1) (computed in fp32, so it costs O(n^2) per
product), checks one product's sampled rows against a float64 reference on the CPU, and
recomputes the first product to confirm the GPU gives the same bits twice.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from fireflyer.validator.checks.base import Check, CheckContext, Findings
from fireflyer.errors import UserError

GIB = 1 << 30
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "tf32": "float32"}


def _sync(dev) -> None:
    import torch

    torch.cuda.synchronize(dev)


class GpuMemory(Check):
    """Write and read back patterns (0x00, 0xFF, 0xAA, 0x55, address and inverted address) over
    most of each GPU's free memory; any differing byte FAILs."""

    name = "gpu_memory"
    title = "GPU memory patterns"
    metrics: ClassVar[dict[str, str]] = {"tested": "GiB"}
    params: ClassVar[dict[str, Any]] = {"fraction": 0.9, "quick_gib": 0.5, "block_mib": 256}
    budget_s = 120.0
    quick_budget_s = 2.0
    needs_gpu = True

    def _measure(self, ctx: CheckContext, out: Findings) -> None:
        import torch

        n_dev = torch.cuda.device_count()
        for i in range(n_dev):
            dev = torch.device("cuda", i)
            blocks, wrong, passes = self._test_device(ctx, dev, n_dev - i)
            tested = sum(b.numel() for b in blocks) / GIB
            out.metric("tested", tested, where=str(dev), grade_it=False)
            out.details[str(dev)] = {"wrong_words": wrong, "passes": passes, "tested_gib": round(tested, 3)}
            if wrong:
                out.fail(f"{dev}: {wrong} 8-byte words read back wrong: GPU memory corrupts data")
            del blocks
            torch.cuda.empty_cache()

    def _test_device(self, ctx: CheckContext, dev, devices_left: int):
        import torch

        free, _total = torch.cuda.mem_get_info(dev)
        block = ctx.param("block_mib") << 20
        target = min(free * ctx.param("fraction"), ctx.param("quick_gib") * GIB) if ctx.quick \
            else free * ctx.param("fraction")
        blocks = []
        try:
            while (len(blocks) + 1) * block <= target:
                blocks.append(torch.empty(block // 8, dtype=torch.int64, device=dev))
        except torch.OutOfMemoryError:
            pass  # another process took memory meanwhile: test what we have
        deadline = time.monotonic() + ctx.time_left() / max(1, devices_left)
        wrong = passes = 0
        patterns = [0x0000000000000000, -1, -0x5555555555555556, 0x5555555555555555]  # 00, FF, AA, 55 bytes
        for p in patterns + ["address", "inverse"]:
            if passes >= 2 and time.monotonic() > deadline:
                break
            for bi, b in enumerate(blocks):
                if isinstance(p, int):
                    b.fill_(p)
                else:
                    self._address(b, bi, p == "inverse", write=True)
            _sync(dev)
            for bi, b in enumerate(blocks):
                wrong += int((b != p).sum()) if isinstance(p, int) else self._address(b, bi, p == "inverse", write=False)
            passes += 1
        return blocks, wrong, passes

    @staticmethod
    def _address(b, block_index: int, invert: bool, *, write: bool) -> int:
        """Write or check each word's own global index (inverted): catches aliased addresses."""
        import torch

        step = 1 << 21  # 16 MiB of words per slice keeps the temporaries small
        wrong = 0
        base = block_index * b.numel()
        for s in range(0, b.numel(), step):
            e = min(b.numel(), s + step)
            ref = torch.arange(base + s, base + e, dtype=torch.int64, device=b.device)
            if invert:
                ref.bitwise_not_()
            if write:
                b[s:e].copy_(ref)
            else:
                wrong += int((b[s:e] != ref).sum())
        return wrong


class GpuGemm(Check):
    """GEMM with GPU memory nearly full: TFLOPS against the profile, every product verified."""

    name = "gpu_gemm"
    title = "GPU GEMM at full memory (verified)"
    metrics: ClassVar[dict[str, str]] = {"tflops": "TFLOP/s"}
    params: ClassVar[dict[str, Any]] = {"dtype": "bf16", "n": 8192, "quick_n": 2048, "fraction": 0.85, "quick_gib": 1.0}
    budget_s = 60.0
    quick_budget_s = 2.0
    needs_gpu = True

    def _measure(self, ctx: CheckContext, out: Findings) -> None:
        import torch

        dname = ctx.param("dtype")
        if dname not in DTYPES:
            raise UserError(f"gpu_gemm dtype {dname!r}: choose one of {', '.join(DTYPES)}")
        dtype = getattr(torch, DTYPES[dname])
        prev_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = dname == "tf32"
        try:
            n_dev = torch.cuda.device_count()
            for i in range(n_dev):
                self._device(ctx, out, torch.device("cuda", i), dtype, n_dev - i)
                torch.cuda.empty_cache()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev_tf32

    def _device(self, ctx: CheckContext, out: Findings, dev, dtype, devices_left: int) -> None:
        import torch

        n = ctx.param("quick_n" if ctx.quick else "n")
        share = ctx.time_left() / max(1, devices_left)
        free, _ = torch.cuda.mem_get_info(dev)
        mat_bytes = n * n * torch.empty((), dtype=dtype).element_size()
        target = free * ctx.param("fraction")
        if ctx.quick:
            target = min(target, ctx.param("quick_gib") * GIB)
        k = max(2, int(target // mat_bytes) - 1)  # one matrix's room is kept for the product
        gen = torch.Generator(device=dev).manual_seed(1234 + dev.index)
        mats = []
        try:
            for _ in range(k):
                mats.append(torch.randn(n, n, device=dev, dtype=dtype, generator=gen))
        except torch.OutOfMemoryError:
            if len(mats) < 2:
                raise
        k = len(mats)
        c = torch.empty(n, n, device=dev, dtype=dtype)
        # timed phase: about half the share
        torch.mm(mats[0], mats[1], out=c)
        _sync(dev)
        iters, t0 = 0, time.perf_counter()
        while iters < 3 or time.perf_counter() - t0 < share * 0.4:
            for _ in range(4):
                torch.mm(mats[iters % k], mats[(iters + 1) % k], out=c)
                iters += 1
            _sync(dev)
        seconds = time.perf_counter() - t0
        out.metric("tflops", 2 * n**3 * iters / seconds / 1e12, where=str(dev))
        # verified phase: every operand used, every product checked by its checksum
        bad_products, verified = [], 0
        ones = torch.ones(n, 1, device=dev, dtype=torch.float32)
        first = None
        for i in range(k):
            if i >= 2 and time.perf_counter() - t0 > share * 0.9:
                break
            a, b = mats[i], mats[(i + 1) % k]
            torch.mm(a, b, out=c)
            if first is None:
                first = c.clone()
            got = c.float() @ ones
            want = a.float() @ (b.float() @ ones)
            scale = c.float().abs() @ ones
            tol = 2.0 ** -6 * scale + 1e-3 * n
            if bool(((got - want).abs() > tol).any()):
                bad_products.append(i)
            verified += 1
        # reference: sampled rows of the first product in float64 on the CPU
        rows = torch.arange(0, n, max(1, n // 8), device=dev)
        a_rows, b_host = mats[0][rows].cpu().double(), mats[1].cpu().double()  # no GPU memory needed
        ref = a_rows @ b_host
        ref_tol = 2.0 ** -6 * (a_rows.abs() @ b_host.abs()) + 1e-2
        ref_wrong = int(((first[rows].cpu().double() - ref).abs() > ref_tol).sum())
        del b_host
        torch.mm(mats[0], mats[1], out=c)
        repeat_same = bool(torch.equal(c, first))
        out.details[str(dev)] = {"n": n, "matrices": k, "gib_used": round(k * mat_bytes / GIB, 2),
                                 "free_gib": round(free / GIB, 2), "timed_products": iters,
                                 "verified_products": verified, "bad_products": bad_products[:10],
                                 "reference_wrong": ref_wrong, "repeat_bit_identical": repeat_same}
        if bad_products:
            out.fail(f"{dev}: {len(bad_products)} of {verified} products fail their checksum")
        if ref_wrong:
            out.fail(f"{dev}: {ref_wrong} elements differ from the float64 reference")
        if not repeat_same:
            out.warn(f"{dev}: the same product computed twice gave different bits")
        del mats, c, first


class GpuBandwidth(Check):
    """Host-to-device and device-to-host copy bandwidth per GPU, pinned host memory."""

    name = "gpu_bandwidth"
    title = "GPU H2D/D2H bandwidth"
    metrics: ClassVar[dict[str, str]] = {"h2d": "GB/s", "d2h": "GB/s"}
    params: ClassVar[dict[str, Any]] = {"mib": 512, "quick_mib": 64}
    budget_s = 10.0
    quick_budget_s = 1.0
    needs_gpu = True

    def _measure(self, ctx: CheckContext, out: Findings) -> None:
        import torch

        mib = ctx.param("quick_mib" if ctx.quick else "mib")
        nbytes = mib << 20
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host.fill_(0x5A)
        n_dev = torch.cuda.device_count()
        for i in range(n_dev):
            dev = torch.device("cuda", i)
            gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            deadline = time.monotonic() + ctx.time_left() / (n_dev - i)
            best = {"h2d": 0.0, "d2h": 0.0}
            trials = 0
            while trials < 2 or time.monotonic() < deadline:
                for key, dst, src in (("h2d", gpu, host), ("d2h", host, gpu)):
                    _sync(dev)
                    t0 = time.perf_counter()
                    dst.copy_(src, non_blocking=True)
                    _sync(dev)
                    best[key] = max(best[key], nbytes / (time.perf_counter() - t0) / 1e9)
                trials += 1
            if int((host != 0x5A).sum()):
                out.fail(f"{dev}: data changed on its way through the GPU")
            for key in ("h2d", "d2h"):
                out.metric(key, best[key], where=str(dev))
            del gpu
        out.details["buffer_mib"] = mib
