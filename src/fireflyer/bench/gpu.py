"""D2H/H2D bandwidth next to hfreduce's stage-in and stage-out throughput (``benchmarks/gpu_check.sh``).

One process, world size 1: an allreduce then is exactly stage-in (D2H into the pinned
arena on the copy stream), a one-input reduce, and stage-out (H2D).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from fireflyer.hfreduce import Communicator, HFReduceConfig


def _bw(fn, nbytes: int, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return nbytes * iters / (time.perf_counter() - t0) / 1e9


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device")
        return 1
    n = 64 << 20  # 256 MiB of fp32
    dev = torch.device("cuda", 0)
    x = torch.randn(n, device=dev)
    pinned = torch.empty(n, pin_memory=True)
    pageable = torch.empty(n)
    nbytes = n * 4
    print(f"gpu_bench: {torch.cuda.get_device_name(0)}, buffers of {nbytes >> 20} MiB")
    print(f"  D2H pinned   {_bw(lambda: pinned.copy_(x, non_blocking=True), nbytes):7.2f} GB/s")
    print(f"  H2D pinned   {_bw(lambda: x.copy_(pinned, non_blocking=True), nbytes):7.2f} GB/s")
    print(f"  D2H pageable {_bw(lambda: pageable.copy_(x), nbytes):7.2f} GB/s")
    store = dist.HashStore()
    with Communicator(store, 0, 1, config=HFReduceConfig.from_env()) as comm:
        rt = _bw(lambda: comm.allreduce(x).wait(), nbytes, iters=5)
        # stage-in and stage-out each move nbytes over PCIe; a round trip moves both
        print(f"  hfreduce world=1 allreduce: {rt:7.2f} GB/s algbw (stage-in + stage-out of every byte)")
        print(f"  -> stage-in/stage-out throughput about {2 * rt:7.2f} GB/s of PCIe traffic")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
