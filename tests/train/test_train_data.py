"""The training data path: text to record shards once per content hash, reused, read through the storage part.

Records built once and reused (also by several processes at once), a damaged record named,
batches that resume mid-epoch, and bad ``--data`` refused with one line through the CLI.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fireflyer import cli
from fireflyer.errors import TimedOut
from fireflyer.storage.errors import CorruptRecord
from fireflyer.storage.records import RecordReader
from fireflyer.train import records
from fireflyer.train.config import TrainConfig
from fireflyer.train.data import TrainingData
from fireflyer.train.env import DATA_CACHE, data_cache_dir
from fireflyer.train.records import DESCRIPTION, load_corpus, prepare, read_corpus

CPU = torch.device("cpu")


def _prepare(text_file, cache, **kw):
    return prepare(read_corpus(text_file), cache, context=kw.pop("context", 16), val_fraction=0.1, **kw)


def test_records_are_built_once_and_reused(tmp_path, text_file, monkeypatch):
    writes = []
    real = records.from_numpy
    monkeypatch.setattr(records, "from_numpy", lambda *a, **k: writes.append(a[1]) or real(*a, **k))
    first = _prepare(text_file, tmp_path / "cache")
    assert first.built and len(writes) == 2  # train and val
    desc = first.dir / DESCRIPTION
    shard = first.dir / "train" / "shard-00000.rec"
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in (first.dir, desc, shard)]
    again = _prepare(text_file, tmp_path / "cache")
    assert not again.built and len(writes) == 2, "the second run builds nothing"
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in (first.dir, desc, shard)] == before
    assert again.dir == first.dir and again.key == first.key and again.splits == first.splits
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")) == [first.key]
    assert not list((tmp_path / "cache").glob(".*.tmp-*")), "no temporary folder is left"


def test_the_hash_is_of_the_content_and_the_layout(tmp_path, text_file):
    first = _prepare(text_file, tmp_path / "cache")
    copy = tmp_path / "elsewhere" / "same.txt"
    copy.parent.mkdir()
    copy.write_bytes(text_file.read_bytes())
    same = _prepare(copy, tmp_path / "cache")
    assert same.key == first.key and not same.built and same.source == str(copy.resolve())
    longer = _prepare(text_file, tmp_path / "cache", context=24)
    assert longer.key != first.key and longer.built
    text_file.write_text(text_file.read_text() + "More.\n")
    assert _prepare(text_file, tmp_path / "cache").key != first.key


def test_windows_cover_the_split_once_each(tmp_path, text_file):
    p = _prepare(text_file, tmp_path / "cache")
    vocab, tokens = records.tokenize(read_corpus(text_file).text)
    train, _ = records.split(tokens, 0.1)
    with RecordReader(p.dir / "train") as r:
        assert len(r) == p.records("train") == (len(train) - 1) // 16
        rows = [r.decode(r.read(i)) for i in range(len(r))]
    assert all(len(row) == 17 for row in rows)
    assert all((rows[i][-1] == rows[i + 1][0]) for i in range(len(rows) - 1)), "neighbours share one token"
    assert [int(t) for row in rows for t in row[:-1]] == [int(t) for t in train[:16 * len(rows)]]


def test_a_crashed_build_leaves_nothing_and_the_next_one_builds(tmp_path, text_file, monkeypatch):
    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(records, "from_numpy", crash)
    with pytest.raises(OSError, match="disk full"):
        _prepare(text_file, tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.undo()
    assert _prepare(text_file, tmp_path / "cache").built


def test_a_builder_that_holds_the_lock_too_long_times_out(tmp_path, text_file):
    key = records.cache_key(read_corpus(text_file), context=16, val_fraction=0.1)
    (tmp_path / "cache").mkdir()
    fd = os.open(tmp_path / "cache" / f".{key}.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another builder at work
        with pytest.raises(TimedOut, match="still building the training records"):
            _prepare(text_file, tmp_path / "cache", timeout=0.2)
    finally:
        os.close(fd)
    assert _prepare(text_file, tmp_path / "cache").built


BUILDER = """
import sys
from fireflyer.train.records import prepare, read_corpus
p = prepare(read_corpus(sys.argv[1]), sys.argv[2], context=16, val_fraction=0.1, timeout=60)
print(p.built, p.dir)
"""


@pytest.mark.multiproc
def test_processes_starting_at_once_build_once(tmp_path, text_file):
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(text_file), str(tmp_path / "cache")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    built = [out.split()[0] for out, _ in outs]
    assert built.count("True") == 1 and built.count("False") == 2
    assert len({out.split()[1] for out, _ in outs}) == 1
    assert len([p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]) == 1


def _data(text_file, cache="", **kw):
    cfg = TrainConfig.from_fields(data=str(text_file), data_cache=str(cache), context=16, global_batch=8, micro_batch_size=4, nodes=1,
                      ranks_per_node=2, seed=5)
    return TrainingData.open(cfg, device=CPU, **kw)


def test_ranks_read_different_windows_and_evaluation_is_fixed(text_file):
    r0, r1 = _data(text_file, rank=0, world_size=2), _data(text_file, rank=1, world_size=2)
    try:
        s0, s1 = r0.splits["train"][0].sampler, r1.splits["train"][0].sampler
        spe = s0.steps_per_epoch
        ids0 = {i for step in range(spe) for i in s0.batch(step)}
        ids1 = {i for step in range(spe) for i in s1.batch(step)}
        assert len(ids0) == len(ids1) == spe * 4 and not ids0 & ids1, "an epoch deals each window to one rank"
        assert not torch.equal(r0.train(step=1)[0][0], r1.train(step=1)[0][0])
        assert torch.equal(r0.eval(index=1)[0][0], r0.eval(index=1)[0][0])
        assert not torch.equal(r0.eval(index=1)[0][0], r1.eval(index=1)[0][0])
        stats = r0.reader_stats()
        assert stats["demands"] > 0 and stats["hits"] <= stats["demands"] and stats["stall_s"] >= 0
    finally:
        r0.close()
        r1.close()


def test_micro_batches_depend_on_their_global_index_not_on_the_layout(text_file):
    """One rank accumulating 4 micro-batches reads the windows that 2 ranks of 2 and 4 ranks of 1 read."""
    def micro(ranks: int, step: int) -> list[torch.Tensor]:
        out = []
        for r in range(ranks):
            cfg = TrainConfig.from_fields(data=str(text_file), context=16, global_batch=16, micro_batch_size=4,
                              nodes=1, ranks_per_node=ranks, seed=5)
            data = TrainingData.open(cfg, device=CPU, rank=r, world_size=ranks)
            try:
                out += [x for x, _ in data.train(step=step)] + [x for x, _ in data.eval(index=step)]
            finally:
                data.close()
        return out

    for step in (1, 7):
        alone = micro(1, step)
        assert [t.shape for t in alone] == [(4, 16)] * 8
        for ranks in (2, 4):
            spread = micro(ranks, step)  # each rank's train micro-batches, then its val ones: reorder to compare
            per = 4 // ranks
            train = [t for r in range(ranks) for t in spread[2 * per * r: 2 * per * r + per]]
            val = [t for r in range(ranks) for t in spread[2 * per * r + per: 2 * per * (r + 1)]]
            assert all(torch.equal(a, b) for a, b in zip(alone, train + val, strict=True))
    assert not torch.equal(micro(1, 1)[0], micro(1, 1)[1])


def test_batches_resumed_mid_epoch_equal_an_uninterrupted_reader(text_file):
    straight = _data(text_file, rank=1, world_size=2)
    spe = straight.splits["train"][0].sampler.steps_per_epoch
    stop = spe // 2  # resume inside the first epoch and read on across the next one's start
    try:
        ran = [straight.train(step=s)[0][0] for s in range(1, spe + 4)]
        resumed = _data(text_file, rank=1, world_size=2)
        try:
            again = [resumed.train(step=s)[0][0] for s in range(stop + 1, spe + 4)]
        finally:
            resumed.close()
        assert all(torch.equal(a, b) for a, b in zip(ran[stop:], again, strict=True))
        assert not torch.equal(ran[0], ran[spe]), "the next epoch is another order"
    finally:
        straight.close()


def test_a_damaged_record_is_named_with_its_dataset_shard_and_record(text_file, tmp_path):
    data = _data(text_file, tmp_path / "cache", rank=0, world_size=2)
    split = data.splits["train"][0]
    victim = split.sampler.batch(2)[1]  # the second window of step 3
    shard_no, offset, _, _ = split.dataset.reader.locate(victim)
    data.close()
    path = data.prepared.dir / "train" / f"shard-{shard_no:05d}.rec"
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x5A
    path.write_bytes(bytes(raw))
    fresh = _data(text_file, tmp_path / "cache", rank=0, world_size=2)
    try:
        fresh.train(step=1)
        with pytest.raises(CorruptRecord) as e:
            fresh.train(step=3)
    finally:
        fresh.close()
    msg = str(e.value)
    assert f"the train split of {text_file.resolve()}" in msg and f"record {victim} " in msg
    assert f"shard-{shard_no:05d}.rec" in msg and "CRC-32" in msg and f"delete {data.prepared.dir}" in msg
    assert e.value.record == victim and "\n" not in msg


def test_the_cache_folder_comes_from_the_field_the_environment_or_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(DATA_CACHE, str(tmp_path / "env"))
    assert data_cache_dir(str(tmp_path / "field")) == tmp_path / "field"
    assert data_cache_dir() == tmp_path / "env"
    monkeypatch.delenv(DATA_CACHE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data_cache_dir() == tmp_path / "xdg" / "fireflyer" / "data"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/is/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data_cache_dir() == tmp_path / "home" / ".cache" / "fireflyer" / "data"


def test_a_folder_is_read_as_its_txt_files_in_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first\n")
    (tmp_path / ".hidden.txt").write_text("never")
    (tmp_path / "notes.md").write_text("never")
    c = read_corpus(tmp_path)
    assert c.text == "first\nsecond\n" and c.files == 2 and c.source == str(tmp_path.resolve())
    assert read_corpus("").text == load_corpus() and read_corpus("").source == "shakespeare.txt (shipped)"


@pytest.fixture
def bad(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1"))
    (tmp_path / "no-text").mkdir()
    (tmp_path / "no-text" / "a.csv").write_text("1,2\n")
    (tmp_path / "short.txt").write_text("To be, or not to be.\n")
    (tmp_path / "few.txt").write_text(load_corpus()[:2000])
    return tmp_path


@pytest.mark.parametrize("args,needle", [
    (["--data", "{d}/missing.txt"], "missing.txt' does not exist; give a UTF-8 text file or a folder of .txt"),
    (["--data", "{d}/empty.txt"], "empty.txt' is empty"),
    (["--data", "{d}/latin1.txt"], "is not UTF-8 text: byte 0xe9 at offset 3"),
    (["--data", "{d}/no-text"], "holds no .txt files"),
    (["--data", "{d}/short.txt"], "too few for one window of context 64 + 1"),
    (["--data", "{d}/few.txt"], "fewer than one step reads (global_batch 64)"),
    (["--data", "{d}/few.txt", "--context", "4096"], "too few for one window of context 4096 + 1"),
    (["--context", "999999999"], "context must be at most 65,536, got 999,999,999"),
])
def test_bad_data_through_the_cli_is_one_line(args, needle, bad, capsys):
    out = bad / "run"
    assert cli.main(["train", *[a.format(d=bad) for a in args], "--out", str(out)]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("fireflyer train: error: ") and needle in lines[0], err
    assert not (out / "logs").exists(), "refused before any rank started"
    assert not any(Path(os.environ[DATA_CACHE]).glob(".*.tmp-*"))


def test_the_summary_line_says_built_or_reused(tmp_path, text_file):
    first = _prepare(text_file, tmp_path / "cache")
    assert "built in" in first.summary() and str(first.dir) in first.summary()
    assert "reused" in _prepare(text_file, tmp_path / "cache").summary()
    assert json.loads((first.dir / DESCRIPTION).read_text())["source"] == str(text_file.resolve())
