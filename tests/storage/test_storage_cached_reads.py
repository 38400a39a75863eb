"""Records read through the shard cache: CachedBackend under RecordDataset, and the sampler-driven prefetcher."""

from __future__ import annotations

import numpy as np
import pytest

from fireflyer.errors import UsageError
from fireflyer.storage.backends import LocalBackend
from fireflyer.storage.cache import CacheConfig, CachedBackend, ShardCache
from fireflyer.storage.dataset import RecordDataset
from fireflyer.storage.errors import CorruptRecord
from fireflyer.storage.policy import SamplerPrefetch
from fireflyer.storage.records import MANIFEST, RecordReader, from_numpy
from fireflyer.storage.sampler import ResumableSampler

RPS = 10


@pytest.fixture
def rows(tmp_path):
    data = np.arange(100 * 7, dtype=np.uint16).reshape(100, 7)
    from_numpy(data, tmp_path / "ds", records_per_shard=RPS)
    return tmp_path / "ds", data


def _cache(root, **kw):
    base = LocalBackend(root, create=False)
    keys = [s["data"] for s in RecordReader(base).shards]
    return ShardCache(base, keys, config=CacheConfig(dram_bytes=1 << 20), **kw)


def test_records_come_out_of_the_cached_shards(rows):
    root, data = rows
    with _cache(root) as cache:
        ds = RecordDataset(CachedBackend(cache), threads=1, as_tensor=False)
        ids = [3, 57, 8, 99, 3, 12]
        got = ds.__getitems__(ids)
        assert all(np.array_equal(g, data[i]) for g, i in zip(got, ids, strict=True))
        assert np.array_equal(ds[42], data[42])
        st = cache.stats
        assert st.demands == 6 and st.hits["backend"] == 5, "one storage read per shard, the rest from DRAM"
        assert set(cache.resident()["dram"]) == {"shard-00000.rec", "shard-00001.rec", "shard-00004.rec",
                                                 "shard-00005.rec", "shard-00009.rec"}


def test_the_view_is_read_only_and_passes_the_manifest_through(rows):
    root, _ = rows
    with _cache(root) as cache:
        view = CachedBackend(cache)
        assert view.read(MANIFEST) == LocalBackend(root).read(MANIFEST)
        assert view.size("shard-00000.rec") == 10 * 7 * 2
        assert view.cache.stats.demands == 0, "the manifest and sizes do not go through the cache"
        with pytest.raises(UsageError, match="read-only"):
            view.write("x", b"y")
        with pytest.raises(UsageError, match="read-only"):
            view.delete("shard-00000.rec")


def test_a_damaged_record_in_a_cached_shard_is_named(rows):
    root, _ = rows
    shard = root / "shard-00002.rec"
    raw = bytearray(shard.read_bytes())
    raw[3 * 14 + 1] ^= 0xFF  # record 23: the fourth of shard 2, 14 bytes each
    shard.write_bytes(bytes(raw))
    with _cache(root) as cache:
        ds = RecordDataset(CachedBackend(cache), threads=1, as_tensor=False)
        ds.__getitems__([20, 21, 22])
        with pytest.raises(CorruptRecord, match=r"record 23 \(at offset 42 of shard shard-00002.rec") as e:
            ds.__getitems__([5, 23])
        assert (e.value.record, e.value.shard, e.value.offset) == (23, "shard-00002.rec", 42)


def test_sampler_prefetch_names_the_next_batches_shards_once_per_step():
    sampler = ResumableSampler(100, batch_size=4, rank=1, world_size=2, seed=3)
    pf = SamplerPrefetch(sampler, records_per_shard=RPS, lookahead=2)
    sampler.set_step(5)
    want = []
    for i in sampler.batch(6) + sampler.batch(7):
        if i // RPS not in want:
            want.append(i // RPS)
    assert pf.candidates(0, 0) == want
    assert pf.candidates(1, 0) == [], "a batch's later demands name nothing more"
    sampler.set_step(6)
    assert pf.candidates(2, 0) == pf.upcoming(6) != []
    with pytest.raises(ValueError):
        SamplerPrefetch(sampler, records_per_shard=0)


def test_the_cache_prefetches_what_the_sampler_reads_next(rows):
    root, data = rows
    sampler = ResumableSampler(100, batch_size=5, seed=1)
    base = LocalBackend(root, create=False)
    keys = [s["data"] for s in RecordReader(base).shards]
    pf = SamplerPrefetch(sampler, records_per_shard=RPS, lookahead=1)
    with ShardCache(base, keys, config=CacheConfig(dram_bytes=1 << 20), prefetcher=pf) as cache:
        ds = RecordDataset(CachedBackend(cache), threads=1, as_tensor=False)
        sampler.set_step(0)
        first = ds.__getitems__(sampler.batch(0))
        assert all(np.array_equal(r, data[i]) for r, i in zip(first, sampler.batch(0), strict=True))
        cache.wait_idle(10)
        resident = set(cache.resident()["dram"])
        assert {keys[i // RPS] for i in sampler.batch(1)} <= resident
