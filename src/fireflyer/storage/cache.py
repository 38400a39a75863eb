"""``ShardCache``: a tiered cache of training-data shards over a slower backend.

Tiers, fastest first: GPU memory (when CUDA is present and ``gpu_bytes > 0``), host
DRAM, and a local SSD directory; below them any :class:`~fireflyer.storage.backends.Backend`
(3FS or NFS mount, S3). Each tier is LRU with a capacity in bytes. As in the simulator
(:mod:`fireflyer.storage.cachesim`), a shard found lower down is promoted one tier at a
time and then sits in every tier above the one it was found in; an optional admission
filter (:class:`~fireflyer.storage.policy.FrequencyAdmission`) can refuse a demanded
shard a full tier's slot.

Prefetching uses the same policy objects as the simulator: after each demand the
prefetcher names shard numbers (positions in ``keys``), and a background thread loads
them. A demand for a shard already being loaded waits for that load instead of
starting another; the time demands spend waiting on I/O is the *reader stall*.

Every blocking call takes a timeout. The cache is thread-safe: one lock guards the tier
maps, and I/O runs outside it.

:class:`CachedBackend` puts a cache under a :class:`~fireflyer.storage.records.RecordReader`
(or a :class:`~fireflyer.storage.dataset.RecordDataset`): the reader's ranged reads of a
shard are served from the cached shard, everything else (manifest, indexes) from the
backend below, so records keep their per-record CRC check while their shards are read once.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from fireflyer.storage.backends import Backend, open_backend
from fireflyer.storage.errors import StorageError
from fireflyer.fsutil import atomic_write
from fireflyer.storage.policy import FrequencyAdmission, Prefetcher
from fireflyer.errors import TimedOut, UsageError, UserError


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """Tier capacities in bytes, and where the SSD tier lives."""

    gpu_bytes: int = 0
    """GPU tier capacity; used only when CUDA is available (0: no GPU tier)."""
    dram_bytes: int = 1 << 30
    ssd_bytes: int = 0
    """SSD tier capacity (0: no SSD tier)."""
    ssd_dir: str | None = None
    """Directory of the SSD tier (required when ssd_bytes > 0); the cache owns its contents."""
    device: str = "cuda"
    prefetch_queue: int = 64
    """Pending prefetches beyond this are dropped (the newest, as they arrive)."""
    prefetch_threads: int = 1
    """Background loaders. One keeps the model's order exactly; more overlap the backend's latency."""
    timeout: float = 60.0
    """Default seconds a get() may wait for I/O."""

    def __post_init__(self) -> None:
        for name in ("gpu_bytes", "dram_bytes", "ssd_bytes"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.ssd_bytes > 0 and not self.ssd_dir:
            raise UserError("ssd_dir is required when ssd_bytes > 0")
        if self.prefetch_threads < 1:
            raise UserError(f"prefetch_threads must be at least 1, got {self.prefetch_threads}")
        if self.prefetch_queue < 1:
            raise UserError(f"prefetch_queue must be at least 1, got {self.prefetch_queue}")
        if not self.timeout > 0:
            raise UserError(f"timeout must be positive seconds, got {self.timeout}")


class _Tier:
    """LRU by bytes. Subclasses keep the payload; this keeps the order and the sizes."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name, self.capacity = name, capacity
        self.sizes: OrderedDict[str, int] = OrderedDict()
        self.used = 0

    def __contains__(self, key: str) -> bool:
        return key in self.sizes

    def touch(self, key: str) -> None:
        self.sizes.move_to_end(key)

    def victims(self, nbytes: int) -> list[str]:
        """Least recent keys that must go for ``nbytes`` to fit."""
        out, free = [], self.capacity - self.used
        for k, n in self.sizes.items():
            if free >= nbytes:
                break
            out.append(k)
            free += n
        return out

    def put(self, key: str, data: Any, nbytes: int) -> list[str]:
        """Store; return the evicted keys (nothing is stored if it can never fit)."""
        if nbytes > self.capacity:
            return []
        if key in self.sizes:
            self.remove(key)
        evicted = self.victims(nbytes)
        for k in evicted:
            self.remove(k)
        self._store(key, data)
        self.sizes[key] = nbytes
        self.used += nbytes
        return evicted

    def remove(self, key: str) -> None:
        self.used -= self.sizes.pop(key)
        self._drop(key)

    def _store(self, key: str, data: Any) -> None:
        raise NotImplementedError

    def _drop(self, key: str) -> None:
        raise NotImplementedError

    def load(self, key: str) -> Any:
        raise NotImplementedError


class _MemoryTier(_Tier):
    def __init__(self, name: str, capacity: int) -> None:
        super().__init__(name, capacity)
        self.data: dict[str, Any] = {}

    def _store(self, key: str, data: Any) -> None:
        self.data[key] = data

    def _drop(self, key: str) -> None:
        del self.data[key]

    def load(self, key: str) -> Any:
        return self.data[key]


class _GPUTier(_MemoryTier):
    """Shards as uint8 CUDA tensors."""

    def __init__(self, capacity: int, device: str) -> None:
        super().__init__("gpu", capacity)
        import torch

        self.torch, self.device = torch, torch.device(device)

    def upload(self, data: bytes) -> Any:
        t = self.torch.frombuffer(bytearray(data), dtype=self.torch.uint8)
        return t.pin_memory().to(self.device, non_blocking=True) if len(data) else t.to(self.device)


class _SSDTier(_Tier):
    """Shards as files in a local directory (written atomically; the map lives in memory)."""

    def __init__(self, capacity: int, directory: str) -> None:
        super().__init__("ssd", capacity)
        self.dir = directory
        if os.path.isdir(directory):
            shutil.rmtree(directory)  # a previous run's files are not in our map: start clean
        os.makedirs(directory, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key.replace("/", "%2F"))

    def _store(self, key: str, data: Any) -> None:
        atomic_write(self._path(key), lambda f: f.write(data))

    def _drop(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def load(self, key: str) -> bytes:
        with open(self._path(key), "rb") as f:
            return f.read()


@dataclass
class CacheStats:
    hits: dict[str, int] = field(default_factory=dict)
    """Demands served by each tier (``backend``: a miss everywhere)."""
    bytes_moved: dict[str, int] = field(default_factory=dict)
    """Bytes copied into each tier (demand and prefetch)."""
    demands: int = 0
    stall_seconds: float = 0.0
    """Time demands spent waiting on I/O (a lower tier, the backend, or a prefetch in flight)."""
    prefetch_issued: int = 0
    """Prefetches queued (a resident shard's is only an LRU touch)."""
    prefetch_loaded: int = 0
    """Prefetches that loaded a shard into the top tier."""
    prefetch_dropped: int = 0
    prefetch_errors: int = 0

    def as_dict(self) -> dict[str, Any]:
        top = self.hits.get("top", 0)
        return {"hits": dict(self.hits), "bytes_moved": dict(self.bytes_moved), "demands": self.demands,
                "top_tier_hit_rate": top / self.demands if self.demands else 0.0,
                "stall_seconds": self.stall_seconds, "prefetch_issued": self.prefetch_issued,
                "prefetch_loaded": self.prefetch_loaded, "prefetch_dropped": self.prefetch_dropped,
                "prefetch_errors": self.prefetch_errors}


class ShardCache:
    """Tiered shard cache with background prefetch (see the module docstring).

    ``keys`` is the ordered shard list the prefetcher's shard numbers refer to (the
    order a training pass walks them). ``get(key)`` returns the shard's bytes, or a
    uint8 CUDA tensor when it is served from the GPU tier.
    """

    def __init__(self, backend: Backend | str | os.PathLike, keys: Sequence[str], *,
                 config: CacheConfig | None = None, prefetcher: Prefetcher | None = None,
                 admission: FrequencyAdmission | None = None) -> None:
        self.config = config or CacheConfig()
        self.backend = open_backend(backend)
        self.keys = list(keys)
        if len(set(self.keys)) != len(self.keys):
            raise UserError("keys must be distinct")
        self._index = {k: i for i, k in enumerate(self.keys)}
        self.tiers: list[_Tier] = []
        c = self.config
        if c.gpu_bytes > 0 and _cuda_available():
            self.tiers.append(_GPUTier(c.gpu_bytes, c.device))
        if c.dram_bytes > 0:
            self.tiers.append(_MemoryTier("dram", c.dram_bytes))
        if c.ssd_bytes > 0:
            self.tiers.append(_SSDTier(c.ssd_bytes, c.ssd_dir))  # type: ignore[arg-type]
        if not self.tiers:
            raise UserError("the cache has no tier: give dram_bytes, ssd_bytes or (with CUDA) gpu_bytes")
        self.prefetcher = prefetcher
        self.admission = admission
        self.stats = CacheStats(hits={t.name: 0 for t in self.tiers} | {"backend": 0, "top": 0},
                                bytes_moved={t.name: 0 for t in self.tiers})
        self._lock = threading.Lock()
        self._policy_lock = threading.Lock()
        self._inflight: dict[str, threading.Event] = {}
        self._steps = 0
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._queued: set[str] = set()
        self._loading = 0
        """Prefetches taken off the queue and not yet finished (not yet in ``_inflight`` at first)."""
        self._closed = False
        self._workers: list[threading.Thread] = []
        if prefetcher is not None:
            for n in range(c.prefetch_threads):
                t = threading.Thread(target=self._prefetch_loop, name=f"shard-prefetch-{n}", daemon=True)
                t.start()
                self._workers.append(t)

    # -- demand path -------------------------------------------------------------------
    def get(self, key: str, *, timeout: float | None = None) -> Any:
        """The shard ``key``, loading it (and promoting it) as needed, then queueing prefetches."""
        if self._closed:
            raise StorageError("this ShardCache is closed")
        timeout = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        t0 = time.perf_counter()
        data, tier, waited = self._fetch(key, deadline, demand=True)
        stalled = time.perf_counter() - t0 if tier != "top" or waited else 0.0
        with self._lock:
            self.stats.demands += 1
            self.stats.stall_seconds += stalled
            step = self._steps
            self._steps += 1
        self._after_demand(step, key)
        return data

    def _after_demand(self, step: int, key: str) -> None:
        if self.admission is not None:
            with self._lock:
                self.admission.record(key)
        if self.prefetcher is None or key not in self._index:
            return
        shard = self._index[key]
        with self._policy_lock:  # policies keep state; readers on several threads take turns
            self.prefetcher.observe(step, shard)
            wanted = self.prefetcher.candidates(step, shard)
        for s in wanted:
            if 0 <= s < len(self.keys) and s != shard:
                self._enqueue(self.keys[s])

    def _enqueue(self, key: str) -> None:
        with self._lock:
            if key in self._queued or key in self._inflight:
                return
            if len(self._queued) >= self.config.prefetch_queue:
                self.stats.prefetch_dropped += 1
                return
            self._queued.add(key)
            self.stats.prefetch_issued += 1
        self._queue.put(key)

    def _prefetch_loop(self) -> None:
        while True:
            key = self._queue.get()
            if key is None:
                return
            with self._lock:  # still counted busy until it has landed, so that wait_idle() waits for it
                self._queued.discard(key)
                self._loading += 1
            try:
                # A resident shard is only refreshed (LRU touch), as in the model; in queue order, so
                # that an earlier prefetch's eviction is seen by a later one.
                _, found, _ = self._fetch(key, time.monotonic() + self.config.timeout, demand=False)
                if found != "top":
                    with self._lock:
                        self.stats.prefetch_loaded += 1
            except Exception:  # noqa: BLE001 - a failed prefetch is retried by the demand that needs it
                with self._lock:
                    self.stats.prefetch_errors += 1
            finally:
                with self._lock:
                    self._loading -= 1

    def _fetch(self, key: str, deadline: float, *, demand: bool) -> tuple[Any, str, bool]:
        """Load ``key`` into the top tier. Returns (data, where it was found: 'top', a lower
        tier's name or 'backend', whether it waited for another thread's load of it)."""
        waited = False
        while True:
            with self._lock:
                top = self.tiers[0]
                if key in top and key not in self._inflight:
                    top.touch(key)
                    if demand:
                        self.stats.hits[top.name] += 1
                        self.stats.hits["top"] += 1
                    return top.load(key), "top", waited
                ev = self._inflight.get(key)
                if ev is None:
                    self._inflight[key] = threading.Event()
                    break
            waited = True  # someone else is loading it: wait for them, then look again
            if not ev.wait(max(0.0, deadline - time.monotonic())):
                raise TimedOut(f"shard {key!r} was not loaded within the timeout")
        try:
            data, found = self._load_and_promote(key, demand)
        finally:
            with self._lock:
                self._inflight.pop(key).set()
        return data, found, waited

    def _load_and_promote(self, key: str, demand: bool) -> tuple[Any, str]:
        with self._lock:
            level = next((i for i, t in enumerate(self.tiers) if key in t), len(self.tiers))
            if level < len(self.tiers):
                self.tiers[level].touch(key)
        if level < len(self.tiers):
            tier = self.tiers[level]
            raw = tier.load(key)
            if tier.name == "gpu":  # pragma: no cover - only when the GPU tier is not the top
                raw = raw.cpu().numpy().tobytes()
            found = tier.name
        else:
            raw = self.backend.read(key)
            found = "backend"
        if demand:
            with self._lock:
                self.stats.hits[found] += 1
        nbytes = len(raw)
        out = raw
        for i in range(min(level, len(self.tiers)) - 1, -1, -1):  # one tier at a time, upwards
            tier = self.tiers[i]
            with self._lock:
                if self.admission is not None and demand and key not in tier:
                    victims = tier.victims(nbytes)
                    if victims and any(not self.admission.admit(key, v) for v in victims):
                        continue
            payload = tier.upload(raw) if isinstance(tier, _GPUTier) else raw
            with self._lock:
                tier.put(key, payload, nbytes)
                self.stats.bytes_moved[tier.name] += nbytes
            out = payload
        return out, found

    # -- lifecycle ---------------------------------------------------------------------
    def resident(self) -> dict[str, list[str]]:
        """Keys in each tier, least recent first (for tests and inspection)."""
        with self._lock:
            return {t.name: list(t.sizes) for t in self.tiers}

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until queued prefetches are done: loaded, or (when resident) touched.

        A prefetch counts as pending from the moment it is queued until its loader is done
        with it, including the moment between leaving the queue and marking the key in
        flight; so once this returns, every prefetch queued before the call has landed (or
        failed) and the next demand cannot race it.
        """
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                busy = bool(self._queued) or self._loading > 0 or bool(self._inflight) or not self._queue.empty()
            if not busy:
                return
            if time.monotonic() > deadline:
                raise TimedOut(f"prefetches still running after {timeout:.0f}s")
            time.sleep(0.002)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the prefetch thread (waiting up to ``timeout``) and drop the SSD tier's files."""
        if self._closed:
            return
        self._closed = True
        if self._workers:
            while True:  # drop what is still queued
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            for _ in self._workers:
                self._queue.put(None)
            deadline = time.monotonic() + timeout
            for t in self._workers:
                t.join(max(0.0, deadline - time.monotonic()))
                if t.is_alive():
                    raise TimedOut(f"the prefetch threads did not stop within {timeout:.0f}s")
        for t in self.tiers:
            if isinstance(t, _SSDTier):
                shutil.rmtree(t.dir, ignore_errors=True)

    def __enter__(self) -> "ShardCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CachedBackend(Backend):
    """A read-only view of ``cache.backend`` whose reads of the cache's keys go through the cache.

    ``read_range(key, offset, length)`` of a shard the cache knows takes the slice out of
    :meth:`ShardCache.get` (loading, promoting and prefetching as a demand does); any other
    key (a manifest, an index) is read from the backend below directly. Errors pass through
    as the cache or the backend raised them: both already name the key and retry what is
    worth retrying, so this layer neither retries nor wraps. Writes are refused.
    """

    name = "cached"

    def __init__(self, cache: ShardCache) -> None:
        super().__init__()
        self.cache = cache
        self.base = cache.backend
        self._keys = frozenset(cache.keys)

    def __repr__(self) -> str:
        return f"{self.base!r} (through a ShardCache)"

    def _call(self, op: str, key: str, fn: Any) -> Any:
        return fn()

    def _read(self, key: str) -> bytes:
        if key in self._keys:
            return _as_bytes(self.cache.get(key))
        return self.base.read(key)

    def _read_range(self, key: str, offset: int, length: int) -> bytes:
        if key in self._keys:
            return _as_bytes(self.cache.get(key)[offset:offset + length])
        return self.base.read_range(key, offset, length)

    def _size(self, key: str) -> int:
        return self.base.size(key)

    def _list(self, prefix: str) -> list[str]:
        return self.base.list(prefix)

    def _refuse(self, *args: object) -> None:
        raise UsageError(f"{self!r} is read-only; write to the backend below it")

    _write = _upload = _delete = _refuse


def _as_bytes(data: Any) -> bytes:
    """Bytes of what a tier holds: bytes already, or a uint8 tensor of the GPU tier."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    return data.cpu().numpy().tobytes()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
