"""Quick single-thread bandwidth of the reduce kernels, against torch ops and the copy roofline.

``python -m fireflyer.bench.kernels [--mib 16] [--inputs 4]``. Each row reduces
``--inputs`` buffers of ``--mib`` MiB of fp32 (and bf16 at the same element count, half the
bytes) into one; GB/s counts the bytes that must move, each input read once and out written
once, so rows compare as times do. The roofline is torch's single-thread ``copy_`` bandwidth
(bytes read + written). Not a test: it measures and prints.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fireflyer.hfreduce.engine import kernels
from fireflyer.hfreduce.plans.plan import Op, Reducer


def _time(fn, reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(mib: int = 16, nin: int = 4, reps: int = 9) -> list[tuple[str, float, float]]:
    """(row, seconds, GB/s) for the copy roofline, torch's chains and every ISA's kernels."""
    torch.set_num_threads(1)
    n = (mib << 20) // 4
    rows = []
    src, dst = torch.randn(n * (nin + 1) // 2), torch.empty(n * (nin + 1) // 2)
    t = _time(lambda: dst.copy_(src), reps)
    rows.append(("torch copy_ (roofline)", t, 2 * src.numel() * 4 / t / 1e9))
    reducer = Reducer()
    for dtype, out_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                             (torch.bfloat16, torch.float32)):
        ins = [torch.randn(n).to(dtype) for _ in range(nin)]
        out = torch.empty(n, dtype=out_dtype)
        moved = (nin * dtype.itemsize + out_dtype.itemsize) * n
        name = f"{str(dtype)[6:]}->{str(out_dtype)[6:]}"
        if dtype == out_dtype == torch.float32:
            def chain():
                torch.add(ins[0], ins[1], out=out)
                for x in ins[2:]:
                    torch.add(out, x, out=out)
            t = _time(chain, reps)
            rows.append((f"{name} torch.add chain", t, moved / t / 1e9))
        t = _time(lambda: kernels.reference_reduce(out, ins, Op.SUM, reducer=reducer), reps)
        rows.append((f"{name} reference (Reducer)", t, moved / t / 1e9))
        for isa in kernels.supported_isas():
            kernels.set_isa(isa)
            t = _time(lambda: kernels.reduce(out, ins, Op.SUM), reps)
            rows.append((f"{name} core {isa}", t, moved / t / 1e9))
        kernels.set_isa(None)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=16, help="MiB of fp32 per input (default 16)")
    p.add_argument("--inputs", type=int, default=4, help="inputs per reduction (default 4)")
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args(argv)
    rows = measure(args.mib, args.inputs, args.reps)
    roof = rows[0][2]
    print(f"SUM of {args.inputs} x {args.mib} MiB (fp32 element count), 1 thread")
    print(f"{'':38} {'ms':>8} {'GB/s':>7} {'of roof':>8}")
    for name, t, gbs in rows:
        print(f"{name:38} {t * 1e3:8.2f} {gbs:7.1f} {gbs / roof:8.0%}")


if __name__ == "__main__":
    main()
