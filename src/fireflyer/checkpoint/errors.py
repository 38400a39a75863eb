"""What the checkpoint manager raises."""

from __future__ import annotations

from fireflyer.errors import FireflyerError


class CheckpointError(FireflyerError):
    """A save or load failed; the message says which checkpoint and why."""


class CorruptCheckpoint(CheckpointError):
    """A committed checkpoint's bytes do not match its manifest (flipped bit, truncation, missing file)."""


class NoCheckpoint(CheckpointError):
    """There is no committed, intact checkpoint to load."""
