"""What the checkpoint manager raises."""

from __future__ import annotations

from fireflyer.errors import FireflyerError


class CheckpointError(FireflyerError):
    """A save or load failed; the message says which checkpoint and why."""


class CorruptCheckpoint(CheckpointError):
    """A committed checkpoint's bytes do not match its manifest (flipped bit, truncation, missing file)."""


class NoCheckpoint(CheckpointError):
    """There is no committed, intact checkpoint to load."""


class UnsafeCheckpoint(CheckpointError):
    """Loading a checkpoint would run code: an old pickled skeleton, or a class that is not allowlisted.

    Not a :class:`CorruptCheckpoint`: ``load()`` does not fall back past it to an older
    checkpoint, since the bytes are intact and the choice is the user's.
    """
