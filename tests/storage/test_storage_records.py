"""Record shards: round trips, O(1) addressing, batched reads, append, and every kind of damage."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fireflyer.storage.backends.memory import MemoryBackend
from fireflyer.storage.errors import CorruptRecord, DatasetError
from fireflyer.storage.records import MANIFEST, RecordReader, RecordWriter, from_folder, from_numpy


def _write(root, records, rps=4):
    with RecordWriter(root, records_per_shard=rps) as w:
        ids = [w.append(r) for r in records]
    return ids


def test_round_trip_and_layout(tmp_path):
    recs = [bytes([i]) * (i * 7 % 50) for i in range(11)]
    assert _write(tmp_path, recs) == list(range(11))
    names = sorted(os.listdir(tmp_path))
    assert names == [MANIFEST] + [f"shard-{n:05d}.{ext}" for n in range(3) for ext in ("idx", "rec")]
    with RecordReader(tmp_path) as r:
        assert len(r) == 11
        assert [r.read(i) for i in range(11)] == recs
        assert r.locate(9)[0] == 2  # sample 9 is in shard 9 // 4
        assert r.read_many([10, 0, 5, 5, 3, 4]) == [recs[i] for i in [10, 0, 5, 5, 3, 4]]


@settings(max_examples=25, deadline=None)
@given(recs=st.lists(st.binary(max_size=40), min_size=1, max_size=40), rps=st.integers(1, 9),
       picks=st.lists(st.integers(0, 10_000), max_size=30), threads=st.sampled_from([1, 4]))
def test_any_records_any_batch(tmp_path_factory, recs, rps, picks, threads):
    root = tmp_path_factory.mktemp("ds")
    _write(root, recs, rps)
    ids = [p % len(recs) for p in picks]
    with RecordReader(root, threads=threads) as r:
        assert r.read_many(ids) == [recs[i] for i in ids]


def test_append_reopens_the_short_last_shard(tmp_path):
    _write(tmp_path, [b"a", b"b", b"c"], rps=2)
    with RecordWriter(tmp_path) as w:
        assert w.count == 3
        assert w.append(b"d") == 3
        # the completed shard is committed under a new name; the short one is gone only after the manifest switched
        m = json.loads((tmp_path / MANIFEST).read_text())
        assert m["shards"][1]["data"] == "shard-00001.1.rec" and not (tmp_path / "shard-00001.rec").exists()
        assert w.append(b"e") == 4
    m = json.loads((tmp_path / MANIFEST).read_text())
    assert [s["records"] for s in m["shards"]] == [2, 2, 1]
    with RecordReader(tmp_path) as r:
        assert [r.read(i) for i in range(5)] == [b"a", b"b", b"c", b"d", b"e"]
    with pytest.raises(ValueError, match="records per shard"):
        RecordWriter(tmp_path, records_per_shard=3)


def test_unclosed_writer_keeps_committed_shards_only(tmp_path):
    w = RecordWriter(tmp_path, records_per_shard=2)
    for r in [b"1", b"2", b"3"]:
        w.append(r)
    # no close(): the third record's shard was never committed, the first shard is whole
    with RecordReader(tmp_path) as r:
        assert len(r) == 2 and r.read(1) == b"2"
    w.abort()
    assert not [n for n in os.listdir(tmp_path) if ".tmp." in n]


def test_an_exception_in_the_with_block_commits_nothing_new(tmp_path):
    _write(tmp_path, [b"a", b"b", b"c"], rps=2)
    with pytest.raises(RuntimeError):
        with RecordWriter(tmp_path) as w:
            w.append(b"d")  # completes shard 1 under a new name: committed
            w.append(b"e")  # in the spool only
            raise RuntimeError("job killed")
    with RecordReader(tmp_path) as r:
        assert [r.read(i) for i in range(len(r))] == [b"a", b"b", b"c", b"d"]
    assert not [n for n in os.listdir(tmp_path) if ".tmp." in n]


def test_append_over_a_non_posix_backend():
    b = MemoryBackend()
    _write(b, [b"1", b"2", b"3"], rps=2)
    with RecordWriter(b) as w:
        w.extend([b"4", b"5"])
    with RecordReader(b) as r:
        assert r.read_many(list(range(5))) == [b"1", b"2", b"3", b"4", b"5"]
    assert sorted(k for k in b.objects if k.endswith(".rec")) == ["shard-00000.rec", "shard-00001.1.rec",
                                                                  "shard-00002.rec"]


def test_from_numpy_and_decode(tmp_path):
    a = np.arange(60, dtype=np.int16).reshape(10, 3, 2)
    assert from_numpy(a, tmp_path, records_per_shard=3) == 10
    with RecordReader(tmp_path) as r:
        np.testing.assert_array_equal(r.decode(r.read(7)), a[7])
    with pytest.raises(ValueError):
        from_numpy(np.array([object()]), tmp_path / "x")


def test_from_folder(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_bytes(b"bee")
    (src / "a.txt").write_bytes(b"ay")
    (src / "sub" / "c.bin").write_bytes(b"\x00see")
    names = from_folder(src, tmp_path / "out", records_per_shard=2)
    assert names == ["a.txt", "b.txt", "sub/c.bin"]
    with RecordReader(tmp_path / "out") as r:
        assert [r.read(i) for i in range(3)] == [b"ay", b"bee", b"\x00see"]
    assert json.loads((tmp_path / "out" / "names.json").read_text()) == names
    with pytest.raises(ValueError, match="already holds"):
        from_folder(src, tmp_path / "out")
    with pytest.raises(ValueError, match="not a directory"):
        from_folder(tmp_path / "nope", tmp_path / "o2")


def test_flipped_bit_names_shard_and_offset(tmp_path):
    _write(tmp_path, [b"x" * 10, b"y" * 10, b"z" * 10], rps=4)
    path = tmp_path / "shard-00000.rec"
    data = bytearray(path.read_bytes())
    data[13] ^= 0x01
    path.write_bytes(bytes(data))
    with RecordReader(tmp_path) as r:
        assert r.read(0) == b"x" * 10
        with pytest.raises(CorruptRecord, match=r"offset 10 of shard shard-00000.rec") as e:
            r.read(1)
        assert e.value.shard == "shard-00000.rec" and e.value.offset == 10 and e.value.record == 1
        with pytest.raises(CorruptRecord, match="offset 10"):
            r.read_many([0, 1, 2])


def test_missing_shard_detected_at_open(tmp_path):
    _write(tmp_path, [b"a"] * 9, rps=4)
    os.unlink(tmp_path / "shard-00001.rec")
    with pytest.raises(DatasetError, match="shard shard-00001.rec named in dataset.json is missing"):
        RecordReader(tmp_path)


def test_missing_index_detected_at_open(tmp_path):
    _write(tmp_path, [b"a"] * 9, rps=4)
    os.unlink(tmp_path / "shard-00002.idx")
    with pytest.raises(DatasetError, match="index shard-00002.idx .* is missing"):
        RecordReader(tmp_path)


def test_truncated_data_disagrees_with_index(tmp_path):
    _write(tmp_path, [b"abc"] * 5, rps=4)
    path = tmp_path / "shard-00000.rec"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(DatasetError, match="disagrees with shard shard-00000.rec"):
        RecordReader(tmp_path)


def test_damaged_index_detected_at_open(tmp_path):
    _write(tmp_path, [b"abc"] * 5, rps=4)
    path = tmp_path / "shard-00000.idx"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(DatasetError, match="damaged"):
        RecordReader(tmp_path)
    path.write_bytes(b"nonsense")
    with pytest.raises(DatasetError, match="truncated"):
        RecordReader(tmp_path)


def test_index_count_disagrees_with_manifest(tmp_path):
    _write(tmp_path, [b"abc"] * 5, rps=4)
    m = json.loads((tmp_path / MANIFEST).read_text())
    m["shards"][1]["records"] = 2
    m["records"] = 6
    (tmp_path / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DatasetError, match="lists 1 records but the manifest says 2"):
        RecordReader(tmp_path)


def test_consistent_index_with_gap_is_refused(tmp_path):
    _write(tmp_path, [b"abc"] * 3, rps=4)
    import zlib

    path = tmp_path / "shard-00000.idx"
    raw = path.read_bytes()
    entries = np.frombuffer(raw[28:], dtype=[("offset", "<u8"), ("length", "<u4"), ("crc", "<u4")]).copy()
    entries["offset"][1] = 4
    entries["length"][0] = 3
    body = entries.tobytes()
    path.write_bytes(struct.pack("<8sQQI", b"FFRIDX1\x00", 3, 9, zlib.crc32(body)) + body)
    with pytest.raises(DatasetError, match="overlapping or gapped"):
        RecordReader(tmp_path)


def test_no_dataset_and_bad_ids(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        RecordReader(tmp_path / "nowhere")
    with pytest.raises(DatasetError, match="dataset.json is missing"):
        RecordReader(tmp_path)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(DatasetError, match="not valid JSON"):
        RecordReader(tmp_path)
    d = tmp_path / "ok"
    _write(d, [b"a"], rps=2)
    with RecordReader(d) as r:
        with pytest.raises(IndexError):
            r.read(1)
        with pytest.raises(TypeError):
            r.read("0")
    with pytest.raises(ValueError):
        RecordReader(d, threads=0)


def test_reader_over_a_non_posix_backend_uses_ranged_reads():
    b = MemoryBackend()
    recs = [bytes([i]) * 5 for i in range(8)]
    _write(b, recs, rps=4)
    with RecordReader(b) as r:
        before = b.calls.get("read_range", 0)
        assert r.read_many([3, 0, 1, 2]) == [recs[3], recs[0], recs[1], recs[2]]
        assert b.calls["read_range"] - before == 1  # four neighbours, one ranged read
        assert r.read(6) == recs[6]
        b.objects["shard-00001.rec"] = b.objects["shard-00001.rec"][:5] + b"\xff" * 15
        with pytest.raises(CorruptRecord, match="offset 5 of shard shard-00001.rec"):
            r.read_many([4, 5])


def test_missing_shard_on_a_non_posix_backend():
    b = MemoryBackend()
    _write(b, [b"a"] * 5, rps=4)
    del b.objects["shard-00001.rec"]
    with pytest.raises(DatasetError, match="shard-00001.rec named in dataset.json is missing"):
        RecordReader(b)
