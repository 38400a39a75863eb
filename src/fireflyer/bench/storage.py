"""``fireflyer bench storage``: random reads from record shards against the usual layouts, and the shard cache.

One run, JSON plus a PNG:

* **random reads**: ``--samples`` samples of ``--sample-kb`` KiB, read in random order in
  batches of ``--batch``, with 1 and 4 reader threads, from (a) record shards
  (``RecordReader.read_many``: index lookup, ``preadv`` of neighbours, CRC-32 check),
  (b) one file per sample (open, read, close), (c) one ``np.memmap`` of all samples.
  Each is measured *warm* (the files in the page cache) and *cold* (this benchmark's
  own files evicted with ``posix_fadvise(DONTNEED)`` first; nobody else's cache is touched).
* **shard cache**: ``ShardCache`` with a DRAM tier of 16 shards and an SSD tier of 64
  (the exercise's slots) over a backend that answers after ``--latency-ms`` plus the
  bytes at ``--backend-mbps``, on the exercise's locality trace, a reader computing
  ``--compute-ms`` per shard: top-tier hit rate and the time the reader stalled, with
  no prefetch and with the locality prefetcher at each distance.
"""

from __future__ import annotations

import os
import platform
import random
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from fireflyer.cliutil import ArgumentParser, doc_summary
from fireflyer.bench.harness import figure, timestamp
from fireflyer.bench.skeleton import run_bench
from fireflyer.errors import UserError
from fireflyer.storage.backends import LocalBackend
from fireflyer.storage.cache import CacheConfig, ShardCache
from fireflyer.storage.cachesim import SimConfig, make_trace
from fireflyer.storage.policy import LocalityPrefetch
from fireflyer.storage.records import RecordReader, RecordWriter


@dataclass(frozen=True, kw_only=True)
class StorageBenchConfig:
    samples: int = 20000
    sample_kb: int = 4
    reads: int = 20000
    batch: int = 64
    threads: tuple[int, ...] = (1, 4)
    shard_kb: int = 256
    trace_len: int = 1000
    latency_ms: float = 4.0
    backend_mbps: float = 400.0
    compute_ms: float = 5.0
    prefetch_threads: int = 4
    distances: tuple[int, ...] = (1, 2, 3)
    directory: str | None = None
    out_dir: str = "benchmarks/results"
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.samples, self.sample_kb, self.reads, self.batch, self.shard_kb, self.trace_len) < 1:
            raise UserError("--samples, --sample-kb, --reads, --batch, --shard-kb and --trace-len must be >= 1")
        if not self.threads or min(self.threads) < 1:
            raise UserError("--threads must be positive integers")
        if self.prefetch_threads < 1:
            raise UserError("--prefetch-threads must be at least 1")
        if self.latency_ms < 0 or self.backend_mbps <= 0 or self.compute_ms < 0:
            raise UserError("--latency-ms and --compute-ms must be >= 0 and --backend-mbps > 0")


def build_config(argv: list[str]) -> StorageBenchConfig:
    d = StorageBenchConfig()
    p = ArgumentParser(prog="fireflyer bench storage", description=doc_summary(__doc__))
    p.add_argument("--samples", type=int, default=d.samples, help=f"samples in the dataset (default {d.samples})")
    p.add_argument("--sample-kb", type=int, default=d.sample_kb, help=f"KiB per sample (default {d.sample_kb})")
    p.add_argument("--reads", type=int, default=d.reads, help=f"random reads per measurement (default {d.reads})")
    p.add_argument("--batch", type=int, default=d.batch, help=f"ids per batched read (default {d.batch})")
    p.add_argument("--threads", default="1,4", help="reader thread counts (default 1,4)")
    p.add_argument("--shard-kb", type=int, default=d.shard_kb, help=f"KiB per cached shard (default {d.shard_kb})")
    p.add_argument("--trace-len", type=int, default=d.trace_len, help=f"cache trace accesses (default {d.trace_len})")
    p.add_argument("--latency-ms", type=float, default=d.latency_ms, help="backend latency per read (default 4)")
    p.add_argument("--backend-mbps", type=float, default=d.backend_mbps, help="backend MB/s (default 400)")
    p.add_argument("--compute-ms", type=float, default=d.compute_ms, help="reader compute per shard (default 5)")
    p.add_argument("--prefetch-threads", type=int, default=d.prefetch_threads,
                   help=f"ShardCache background loaders (default {d.prefetch_threads})")
    p.add_argument("--distances", default="1,2,3", help="prefetch distances (default 1,2,3)")
    p.add_argument("--dir", default=None, help="directory on the disk under test (default: a temporary one here)")
    p.add_argument("--out", default=d.out_dir, help="where storage.json and storage.png go")
    a = p.parse_args(argv)
    try:
        threads = tuple(int(x) for x in a.threads.split(","))
        distances = tuple(int(x) for x in a.distances.split(","))
    except ValueError:
        raise UserError("--threads and --distances are comma-separated integers") from None
    if a.dir is not None and not os.path.isdir(a.dir):
        raise UserError(f"--dir {a.dir!r} is not a directory")
    try:
        return StorageBenchConfig(samples=a.samples, sample_kb=a.sample_kb, reads=a.reads, batch=a.batch,
                                  threads=threads, shard_kb=a.shard_kb, trace_len=a.trace_len,
                                  latency_ms=a.latency_ms, backend_mbps=a.backend_mbps, compute_ms=a.compute_ms,
                                  prefetch_threads=a.prefetch_threads, distances=distances, directory=a.dir,
                                  out_dir=a.out)
    except ValueError as exc:
        raise UserError(str(exc)) from None


# -- random reads ----------------------------------------------------------------------


def _evict(paths: list[str]) -> bool:
    """Drop these files from the page cache; False where the platform cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _build_layouts(cfg: StorageBenchConfig, root: str) -> dict[str, Any]:
    rng = np.random.default_rng(cfg.seed)
    size = cfg.sample_kb * 1024
    samples = rng.integers(0, 256, size=(cfg.samples, size), dtype=np.uint8)
    rec_dir = os.path.join(root, "records")
    with RecordWriter(rec_dir, records_per_shard=4096) as w:
        for row in samples:
            w.append(row.tobytes())
    files_dir = os.path.join(root, "files")
    os.makedirs(files_dir)
    file_paths = []
    for i, row in enumerate(samples):
        path = os.path.join(files_dir, f"{i:07d}.bin")
        with open(path, "wb") as f:
            f.write(row.tobytes())
        file_paths.append(path)
    mm_path = os.path.join(root, "samples.npy.raw")
    mm = np.memmap(mm_path, dtype=np.uint8, mode="w+", shape=samples.shape)
    mm[:] = samples
    mm.flush()
    del mm
    os.sync()
    rec_paths = [os.path.join(rec_dir, n) for n in os.listdir(rec_dir)]
    return {"records": rec_dir, "rec_paths": rec_paths, "files": file_paths, "memmap": mm_path,
            "check": {i: samples[i].tobytes() for i in range(0, cfg.samples, max(1, cfg.samples // 50))}}


def _measure_reads(cfg: StorageBenchConfig, lay: dict[str, Any]) -> list[dict[str, Any]]:
    size = cfg.sample_kb * 1024
    ids = random.Random(cfg.seed).choices(range(cfg.samples), k=cfg.reads)
    batches = [ids[i:i + cfg.batch] for i in range(0, len(ids), cfg.batch)]
    rows = []
    for cold in (False, True):
        for threads in cfg.threads:
            for layout in ("records", "files", "memmap"):
                if layout == "records":
                    reader = RecordReader(lay["records"], threads=threads)
                    read_batch: Callable[[list[int]], list[bytes]] = reader.read_many
                    paths = lay["rec_paths"]
                    close = reader.close
                    pool = None
                else:
                    pool = ThreadPoolExecutor(threads) if threads > 1 else None
                    if layout == "files":
                        paths = lay["files"]

                        def one(i: int) -> bytes:
                            return _read_file(lay["files"][i])
                    else:
                        paths = [lay["memmap"]]
                        mm = np.memmap(lay["memmap"], dtype=np.uint8, mode="r", shape=(cfg.samples, size))

                        def one(i: int, mm: np.memmap = mm) -> bytes:
                            return mm[i].tobytes()

                    def read_batch(b: list[int], one: Callable[[int], bytes] = one,
                                   pool: ThreadPoolExecutor | None = pool, threads: int = threads) -> list[bytes]:
                        if pool is None:
                            return [one(i) for i in b]
                        parts = [b[k::threads] for k in range(threads)]  # one task per thread, as read_many does
                        done = list(pool.map(lambda part: [one(i) for i in part], parts))
                        out: list[bytes] = [b""] * len(b)
                        for k, got in enumerate(done):
                            out[k::threads] = got
                        return out

                    def close(pool: ThreadPoolExecutor | None = pool) -> None:
                        if pool is not None:
                            pool.shutdown()
                evicted = _evict(paths) if cold else False
                t0 = time.perf_counter()
                got = 0
                for b in batches:
                    out = read_batch(b)
                    got += len(out)
                elapsed = time.perf_counter() - t0
                for i, want in list(lay["check"].items())[:5]:  # the layouts hold the same bytes
                    assert read_batch([i])[0] == want, f"{layout} returned wrong bytes for sample {i}"
                close()
                rows.append({"layout": layout, "threads": threads, "cache": "cold" if cold else "warm",
                             "evicted": evicted, "samples_per_s": got / elapsed, "mb_per_s": got * size / elapsed / 1e6,
                             "seconds": elapsed})
                print(f"  {rows[-1]['cache']:<5} {layout:<8} threads={threads}: "
                      f"{rows[-1]['samples_per_s']:10.0f} samples/s {rows[-1]['mb_per_s']:8.1f} MB/s")
    return rows


# -- shard cache -----------------------------------------------------------------------


class ThrottledBackend(LocalBackend):
    """A local directory that answers like a remote store: a latency per read plus bytes over a bandwidth."""

    name = "throttled"

    def __init__(self, root: str, *, latency_s: float, bytes_per_s: float) -> None:
        super().__init__(root)
        self.latency_s, self.bytes_per_s = latency_s, bytes_per_s

    def _read(self, key: str) -> bytes:
        t0 = time.perf_counter()
        data = super()._read(key)
        wait = self.latency_s + len(data) / self.bytes_per_s - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        return data


def _measure_cache(cfg: StorageBenchConfig, root: str) -> list[dict[str, Any]]:
    sim = SimConfig(trace_len=cfg.trace_len)
    trace = make_trace(sim)
    size = cfg.shard_kb * 1024
    backend = ThrottledBackend(os.path.join(root, "remote"), latency_s=cfg.latency_ms / 1e3,
                               bytes_per_s=cfg.backend_mbps * 1e6)
    keys = [f"shard-{i:04d}" for i in range(sim.shards)]
    rng = np.random.default_rng(cfg.seed)
    for k in keys:
        backend.write(k, rng.integers(0, 256, size=size, dtype=np.uint8).tobytes())
    rows = []
    for d in (0, *cfg.distances):
        cc = CacheConfig(dram_bytes=sim.hbm_slots * size, ssd_bytes=sim.dram_slots * size,
                         ssd_dir=os.path.join(root, f"ssd-{d}"), prefetch_threads=cfg.prefetch_threads)
        pf = LocalityPrefetch(distance=d, num_shards=sim.shards) if d else None
        with ShardCache(backend, keys, config=cc, prefetcher=pf) as cache:
            t0 = time.perf_counter()
            for s in trace:
                data = cache.get(keys[s])
                assert len(data) == size
                if cfg.compute_ms:
                    time.sleep(cfg.compute_ms / 1e3)
            wall = time.perf_counter() - t0
            st = cache.stats.as_dict()
        compute = len(trace) * cfg.compute_ms / 1e3
        rows.append({"prefetch_distance": d, "hit_rate": st["top_tier_hit_rate"], "hits": st["hits"],
                     "stall_seconds": st["stall_seconds"], "wall_seconds": wall, "compute_seconds": compute,
                     "stall_share": st["stall_seconds"] / wall if wall else 0.0,
                     "prefetch_loaded": st["prefetch_loaded"], "bytes_moved": st["bytes_moved"]})
        print(f"  cache prefetch d={d}: top-tier hit rate {rows[-1]['hit_rate']:.3f}, reader stalled "
              f"{rows[-1]['stall_seconds']:.2f} s of {wall:.2f} s")
    return rows


def write_png(path: str, doc: dict[str, Any]) -> None:
    with figure(path, 1, 2, figsize=(13, 4.5)) as (fig, axes):
        ax = axes[0]
        reads = doc["random_reads"]
        labels = sorted({(r["cache"], r["threads"]) for r in reads}, key=lambda x: (x[0] != "warm", x[1]))
        layouts = ["records", "files", "memmap"]
        width = 0.8 / len(layouts)
        for j, lay in enumerate(layouts):
            vals = [next(r["samples_per_s"] for r in reads if r["layout"] == lay and (r["cache"], r["threads"]) == lb)
                    for lb in labels]
            ax.bar([i + j * width for i in range(len(labels))], vals, width, label=lay)
        ax.set_xticks([i + width for i in range(len(labels))])
        ax.set_xticklabels([f"{c}\n{t} thread{'s' if t > 1 else ''}" for c, t in labels])
        ax.set_yscale("log")
        ax.set_ylabel("random samples/s (log)")
        ax.set_title(f"random reads of {doc['config']['sample_kb']} KiB samples")
        ax.legend()
        ax = axes[1]
        rows = doc["shard_cache"]
        xs = [f"d={r['prefetch_distance']}" if r["prefetch_distance"] else "none" for r in rows]
        ax.bar(xs, [r["stall_seconds"] for r in rows], color="tab:red", label="reader stall (s)")
        ax.set_ylabel("reader stall (s)")
        ax2 = ax.twinx()
        ax2.plot(xs, [r["hit_rate"] for r in rows], "o-", color="tab:blue", label="top-tier hit rate")
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("top-tier hit rate")
        ax.set_xlabel("prefetch")
        ax.set_title("ShardCache on the locality trace")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)


def run(cfg: StorageBenchConfig) -> dict[str, Any]:
    """The whole result document (its own head: ``bench``, ``time``, ``host``), the progress printed."""
    root = tempfile.mkdtemp(prefix="fireflyer-storage-bench-", dir=cfg.directory or ".")
    try:
        load_before = os.getloadavg()
        print(f"building {cfg.samples} samples of {cfg.sample_kb} KiB in three layouts under {root}")
        lay = _build_layouts(cfg, root)
        print("random reads:")
        reads = _measure_reads(cfg, lay)
        print("shard cache:")
        cache = _measure_cache(cfg, root)
        load_after = os.getloadavg()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"bench": "storage", "time": timestamp(),
            "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "loadavg_before": load_before,
                     "loadavg_after": load_after},
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()},
            "random_reads": reads, "shard_cache": cache}


def main(argv: list[str]) -> int:
    return run_bench(argv, part="storage", configure=build_config, measure=run, fields=lambda cfg, doc: doc,
                     plot=lambda path, cfg, doc: write_png(path, doc), head=lambda argv: {})
