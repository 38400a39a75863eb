"""The backend interface on the local directory and the in-process store: keys, atomicity, retries."""

from __future__ import annotations

import os

import pytest

from fireflyer.storage.backends import LocalBackend, RetryConfig, open_backend
from fireflyer.storage.backends.memory import MemoryBackend
from fireflyer.storage.backends.threefs import usrbio_available
from fireflyer.storage.errors import BackendError, NotFound


@pytest.fixture(params=["local", "memory"])
def backend(request, tmp_path):
    if request.param == "local":
        return LocalBackend(tmp_path / "root")
    return MemoryBackend()


def test_write_read_list_delete(backend):
    backend.write("a/b/c.bin", b"0123456789")
    backend.write("a/d.bin", bytearray(b"xy"))
    backend.write("z", memoryview(b"last"))
    assert backend.read("a/b/c.bin") == b"0123456789"
    assert backend.read_range("a/b/c.bin", 3, 4) == b"3456"
    assert backend.read_range("a/b/c.bin", 8, 10) == b"89"  # short at the end, like a file
    assert backend.read_range("a/b/c.bin", 3, 0) == b""
    assert backend.size("a/d.bin") == 2 and backend.exists("z") and not backend.exists("nope")
    assert backend.list("a/") == ["a/b/c.bin", "a/d.bin"]
    assert backend.list() == ["a/b/c.bin", "a/d.bin", "z"]
    assert backend.list("a/b/c") == ["a/b/c.bin"] and backend.list("a/d") == ["a/d.bin"] and backend.list("q") == []
    backend.write("z", b"new")
    assert backend.read("z") == b"new"
    backend.delete("z")
    backend.delete("z")  # deleting a missing key is fine
    assert not backend.exists("z")


def test_missing_key_raises_not_found_naming_it(backend):
    with pytest.raises(NotFound, match="'no/such' does not exist") as e:
        backend.read("no/such")
    assert e.value.key == "no/such"
    assert isinstance(e.value, FileNotFoundError)


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a", "a/"])
def test_bad_keys_are_refused(backend, key):
    with pytest.raises(ValueError):
        backend.write(key, b"x")


def test_negative_range_refused(backend):
    with pytest.raises(ValueError):
        backend.read_range("k", -1, 2)


def test_transient_failures_are_retried_with_backoff():
    b = MemoryBackend(retry=RetryConfig(attempts=4, backoff=0.001))
    b.write("k", b"v")
    b.fail_next = 3
    assert b.read("k") == b"v"
    assert b.retries == 3


def test_persistent_failure_raises_with_the_key_after_retries():
    b = MemoryBackend(retry=RetryConfig(attempts=3, backoff=0.001))
    b.fail_next = 10
    with pytest.raises(BackendError, match=r"write of 'ckpt/x' failed after 3 tries: ConnectionError") as e:
        b.write("ckpt/x", b"v")
    assert e.value.key == "ckpt/x" and b.retries == 2


def test_non_transient_error_is_not_retried(tmp_path):
    b = LocalBackend(tmp_path, retry=RetryConfig(attempts=5, backoff=0.001))
    (tmp_path / "adir").mkdir()
    with pytest.raises(BackendError, match="'adir'"):
        b.read("adir")  # IsADirectoryError: permanent
    assert b.retries == 0


def test_local_writes_are_atomic_and_leave_no_temp_files(tmp_path):
    b = LocalBackend(tmp_path)
    b.write("f", b"old")

    class Boom(Exception):
        pass

    def failing(f):
        f.write(b"half")
        raise Boom

    from fireflyer.fsutil import atomic_write

    with pytest.raises(Boom):
        atomic_write(b.local_path("f"), failing)
    assert b.read("f") == b"old" and os.listdir(tmp_path) == ["f"]


def test_open_backend_urls(tmp_path):
    assert isinstance(open_backend(tmp_path), LocalBackend)
    assert open_backend(f"file://{tmp_path}").root == str(tmp_path)
    m = MemoryBackend()
    assert open_backend(m) is m
    with pytest.raises(ValueError, match="unknown storage URL scheme 'ftp'"):
        open_backend("ftp://host/x")
    with pytest.raises(FileNotFoundError):
        LocalBackend(tmp_path / "missing", create=False)
    with pytest.raises(ValueError):
        RetryConfig(attempts=0)


def test_threefs_backend_needs_its_binding(tmp_path):
    if usrbio_available():  # pragma: no cover - only on a 3FS client machine
        pytest.skip("3FS USRBIO binding present: this test checks the guard on machines without it")
    from fireflyer.storage.backends.threefs import ThreeFSBackend

    with pytest.raises(ImportError, match="hf3fs_fuse"):
        ThreeFSBackend(tmp_path)
    with pytest.raises(ImportError, match="hf3fs_fuse"):
        open_backend(f"3fs://{tmp_path}")
