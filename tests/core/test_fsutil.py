"""The project's one JSON writer (fireflyer.fsutil.write_json): whole files or none, and the old file kept on
any failure."""

from __future__ import annotations

import json
import os
import threading

import pytest

from fireflyer import fsutil
from fireflyer.errors import CannotWrite


def test_write_json_writes_the_whole_document_and_returns_its_path(tmp_path):
    path = fsutil.write_json(tmp_path / "sub" / "a.json", {"b": 1, "a": [1.5, None]}, sort_keys=True)
    assert path == tmp_path / "sub" / "a.json"
    text = path.read_text()
    assert text == json.dumps({"a": [1.5, None], "b": 1}, indent=1, sort_keys=True) + "\n"
    assert fsutil.write_json(tmp_path / "c.json", {"b": 1, "a": 2}, indent=2).read_text().index('"b"') < \
        (tmp_path / "c.json").read_text().index('"a"')  # the caller's order unless sorted
    assert sorted(os.listdir(tmp_path)) == ["c.json", "sub"] and os.listdir(tmp_path / "sub") == ["a.json"]


def test_a_value_json_cannot_hold_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path):
    path = fsutil.write_json(tmp_path / "a.json", {"v": 1})
    with pytest.raises(TypeError):
        fsutil.write_json(path, {"v": object()})
    assert json.loads(path.read_text()) == {"v": 1} and os.listdir(tmp_path) == ["a.json"]


def test_a_failed_write_is_named_and_keeps_the_old_file(tmp_path, monkeypatch):
    path = fsutil.write_json(tmp_path / "a.json", {"v": 1})

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(CannotWrite, match="a.json"):
        fsutil.write_json(path, {"v": 2})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"v": 1} and os.listdir(tmp_path) == ["a.json"]


def test_threads_writing_one_file_never_tear_it(tmp_path):
    path = tmp_path / "a.json"
    docs = [{"writer": w, "pad": "x" * (1000 * w)} for w in range(8)]
    errors: list[BaseException] = []

    def write(doc):
        try:
            for _ in range(20):
                fsutil.write_json(path, doc)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(d,)) for d in docs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert json.loads(path.read_text()) in docs and os.listdir(tmp_path) == ["a.json"]
