"""What the storage part raises. Each message names the shard, offset or object key involved."""

from __future__ import annotations

from fireflyer.errors import FireflyerError


class StorageError(FireflyerError):
    """A storage operation failed; the message names the file or object key."""


class BackendError(StorageError):
    """A backend kept failing after its retries; ``key`` is the object involved."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message)
        self.key = key


class NotFound(BackendError, FileNotFoundError):
    """The object does not exist (not retried)."""


class CorruptRecord(StorageError):
    """A record's bytes fail their checksum; ``shard`` and ``offset`` say where, ``record`` is its sample id."""

    def __init__(self, message: str, *, shard: str, offset: int, record: int | None = None) -> None:
        super().__init__(message)
        self.shard, self.offset, self.record = shard, offset, record


class DatasetError(StorageError):
    """A record dataset is inconsistent at open: a missing shard, or an index that disagrees with the data."""
