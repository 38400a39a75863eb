"""ShardCache: the simulator's model on real bytes, prefetch in the background, waits, timeouts, threads."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fireflyer.storage.backends.memory import MemoryBackend
from fireflyer.storage.cache import CacheConfig, ShardCache
from fireflyer.storage.cachesim import SimConfig, make_trace, simulate
from fireflyer.storage.errors import NotFound
from fireflyer.storage.policy import FrequencyAdmission, LocalityPrefetch

SIZE = 1000


def _backend(n):
    b = MemoryBackend()
    keys = [f"shard-{i:04d}" for i in range(n)]
    for i, k in enumerate(keys):
        b.write(k, bytes([i % 251]) * SIZE)
    return b, keys


class GatedBackend(MemoryBackend):
    """Reads of gated keys block until the test opens the gate (a slow storage server)."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.gated: set[str] = set()
        self.reads: list[str] = []

    def _read(self, key):
        self.reads.append(key)
        if key in self.gated:
            assert self.gate.wait(10)
        return super()._read(key)


@pytest.mark.parametrize("distance", [0, 1, 3])
def test_same_hits_and_cost_as_the_simulator(tmp_path, distance):
    cfg = SimConfig(trace_len=600, shards=48)
    trace = make_trace(cfg)
    pf = LocalityPrefetch(distance=distance, num_shards=cfg.shards)
    sim = simulate(trace, cfg, pf if distance else None)
    b, keys = _backend(cfg.shards)
    cache = ShardCache(b, keys, config=CacheConfig(dram_bytes=cfg.hbm_slots * SIZE, ssd_bytes=cfg.dram_slots * SIZE,
                                                   ssd_dir=str(tmp_path / "ssd")),
                       prefetcher=LocalityPrefetch(distance=distance, num_shards=cfg.shards) if distance else None)
    with cache:
        for s in trace:
            assert cache.get(keys[s]) == bytes([s % 251]) * SIZE
            cache.wait_idle()
        st = cache.stats
        assert st.hits["top"] == sim.hits
        # Model cost: every load into the top tier came from the SSD tier (4) or the backend (40), +2 if speculative.
        loads_from_ssd = st.bytes_moved["dram"] // SIZE - st.bytes_moved["ssd"] // SIZE
        loads_from_backend = st.bytes_moved["ssd"] // SIZE
        assert 4 * loads_from_ssd + 40 * loads_from_backend + 2 * st.prefetch_loaded == sim.cost


def test_lru_by_bytes_and_promotion(tmp_path):
    b, keys = _backend(6)
    with ShardCache(b, keys, config=CacheConfig(dram_bytes=2 * SIZE, ssd_bytes=4 * SIZE,
                                                ssd_dir=str(tmp_path / "ssd"))) as c:
        for k in keys[:5]:
            c.get(k)
        assert c.resident() == {"dram": keys[3:5], "ssd": keys[1:5]}
        c.get(keys[1])  # found on SSD: promoted into DRAM
        assert c.stats.hits["ssd"] == 1 and c.resident()["dram"] == [keys[4], keys[1]]
        c.get(keys[1])
        assert c.stats.hits["top"] == 1 and c.stats.hits["backend"] == 5
        assert sorted((tmp_path / "ssd").iterdir()) != []
    assert not (tmp_path / "ssd").exists()  # close() drops the SSD tier's files


def test_a_shard_larger_than_a_tier_still_reads(tmp_path):
    b = MemoryBackend()
    b.write("big", b"x" * 5000)
    with ShardCache(b, ["big"], config=CacheConfig(dram_bytes=1000)) as c:
        assert c.get("big") == b"x" * 5000 and c.resident() == {"dram": []}


def test_prefetch_runs_ahead_in_the_background():
    b, keys = _backend(20)
    with ShardCache(b, keys, config=CacheConfig(dram_bytes=8 * SIZE),
                    prefetcher=LocalityPrefetch(distance=3, num_shards=20)) as c:
        c.get(keys[0])
        c.wait_idle()
        assert c.resident()["dram"] == keys[0:4]
        for k in keys[1:4]:
            c.get(k)
        assert c.stats.hits["top"] == 3 and c.stats.prefetch_loaded >= 3


def test_wait_idle_waits_for_a_prefetch_taken_off_the_queue_but_not_yet_started():
    """A loader that has dequeued a prefetch, and not yet marked it in flight, is still busy: wait_idle()
    returning then let the next demand race the prefetch (an LRU order, so a hit, decided by thread timing)."""
    b, keys = _backend(4)
    with ShardCache(b, keys, config=CacheConfig(dram_bytes=4 * SIZE),
                    prefetcher=LocalityPrefetch(distance=1, num_shards=4)) as c:
        fetch = c._fetch

        def late(key, deadline, *, demand):
            if not demand:
                time.sleep(0.2)  # the loader is descheduled between the queue and the fetch
            return fetch(key, deadline, demand=demand)

        c._fetch = late
        c.get(keys[0])
        c.wait_idle()
        assert c.resident()["dram"] == keys[0:2] and c.stats.prefetch_loaded == 1


def test_demand_waits_for_the_prefetch_in_flight_instead_of_reading_twice():
    b = GatedBackend()
    keys = ["a", "b"]
    for k in keys:
        b.write(k, k.encode() * 10)
    b.gated.add("b")
    with ShardCache(b, keys, config=CacheConfig(dram_bytes=100),
                    prefetcher=LocalityPrefetch(distance=1, num_shards=2)) as c:
        c.get("a")  # queues a prefetch of b, which blocks in the backend
        deadline = time.monotonic() + 5
        while "b" not in b.reads and time.monotonic() < deadline:
            time.sleep(0.001)
        threading.Timer(0.05, b.gate.set).start()
        assert c.get("b") == b"b" * 10
        assert b.reads.count("b") == 1
        assert c.stats.stall_seconds >= 0.03  # the demand stalled on the late prefetch


def test_get_times_out_when_storage_hangs():
    b = GatedBackend()
    b.write("k", b"v")
    b.gated.add("k")
    with ShardCache(b, ["k"], config=CacheConfig(dram_bytes=100),
                    prefetcher=LocalityPrefetch(distance=1, num_shards=1)) as c:
        holder = threading.Thread(target=c.get, args=("k",), kwargs={"timeout": 10})
        holder.start()
        time.sleep(0.05)
        with pytest.raises(TimeoutError, match="'k'"):
            c.get("k", timeout=0.1)
        b.gate.set()
        holder.join(5)
        assert not holder.is_alive() and c.get("k") == b"v"


def test_missing_shard_raises_not_found_and_the_cache_recovers():
    b, keys = _backend(2)
    with ShardCache(b, [*keys, "gone"], config=CacheConfig(dram_bytes=10 * SIZE)) as c:
        with pytest.raises(NotFound, match="'gone'"):
            c.get("gone")
        with pytest.raises(NotFound):
            c.get("gone")  # no stale in-flight marker left behind
        assert c.get(keys[0]) == bytes([0]) * SIZE


@pytest.mark.parametrize("loaders", [1, 3])
def test_many_threads_read_correct_bytes(tmp_path, loaders):
    b, keys = _backend(40)
    cfg = CacheConfig(dram_bytes=6 * SIZE, ssd_bytes=15 * SIZE, ssd_dir=str(tmp_path / "ssd"), prefetch_threads=loaders)
    errors = []
    with ShardCache(b, keys, config=cfg, prefetcher=LocalityPrefetch(distance=2, num_shards=40)) as c:
        def worker(seed):
            import random

            rng = random.Random(seed)
            for _ in range(300):
                i = rng.randrange(40)
                if c.get(keys[i]) != bytes([i % 251]) * SIZE:
                    errors.append(i)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and c.stats.demands == 1200
        res = c.resident()
        assert len(res["dram"]) <= 6 and len(res["ssd"]) <= 15


def test_admission_keeps_hot_shards_in_the_top_tier():
    b, keys = _backend(60)
    adm = FrequencyAdmission(window=10_000)
    with ShardCache(b, keys, config=CacheConfig(dram_bytes=4 * SIZE), admission=adm) as c:
        for _ in range(10):
            for k in keys[:4]:
                c.get(k)
        for k in keys[10:50]:
            c.get(k)  # a scan
        assert set(c.resident()["dram"]) == set(keys[:4])


@pytest.mark.parametrize("bad", [dict(dram_bytes=-1), dict(ssd_bytes=10), dict(timeout=0), dict(prefetch_queue=0),
                                 dict(prefetch_threads=0)])
def test_bad_config(bad):
    with pytest.raises(ValueError):
        CacheConfig(**bad)


def test_no_tier_and_duplicate_keys_refused():
    b, keys = _backend(2)
    with pytest.raises(ValueError, match="no tier"):
        ShardCache(b, keys, config=CacheConfig(dram_bytes=0))
    with pytest.raises(ValueError, match="distinct"):
        ShardCache(b, ["a", "a"])
    c = ShardCache(b, keys)
    c.close()
    with pytest.raises(Exception, match="closed"):
        c.get(keys[0])


def _cuda():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_gpu_tier_serves_cuda_tensors(tmp_path):
    import torch

    b, keys = _backend(8)
    cfg = CacheConfig(gpu_bytes=2 * SIZE, dram_bytes=4 * SIZE, ssd_bytes=8 * SIZE, ssd_dir=str(tmp_path / "ssd"))
    with ShardCache(b, keys, config=cfg, prefetcher=LocalityPrefetch(distance=1, num_shards=8)) as c:
        for i, k in enumerate(keys):
            t = c.get(k)
            assert t.is_cuda and t.dtype == torch.uint8 and bytes(t.cpu().numpy()) == bytes([i]) * SIZE
            c.wait_idle()
        res = c.resident()
        assert list(res) == ["gpu", "dram", "ssd"] and len(res["gpu"]) == 2 and len(res["dram"]) == 4
        assert c.stats.hits["gpu"] >= 6


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 1000), shards=st.integers(3, 30), hbm=st.integers(1, 5), dram=st.integers(1, 10),
       d=st.integers(0, 3))
def test_matches_the_simulator_on_random_configs(tmp_path_factory, seed, shards, hbm, dram, d):
    cfg = SimConfig(seed=seed, shards=shards, hbm_slots=hbm, dram_slots=dram, trace_len=120)
    trace = make_trace(cfg)
    sim = simulate(trace, cfg, LocalityPrefetch(distance=d, num_shards=shards) if d else None)
    b, keys = _backend(shards)
    cc = CacheConfig(dram_bytes=hbm * SIZE, ssd_bytes=dram * SIZE, ssd_dir=str(tmp_path_factory.mktemp("ssd")))
    with ShardCache(b, keys, config=cc,
                    prefetcher=LocalityPrefetch(distance=d, num_shards=shards) if d else None) as cache:
        for s in trace:
            cache.get(keys[s])
            cache.wait_idle()
        assert cache.stats.hits["top"] == sim.hits
