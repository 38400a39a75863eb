"""Checkpoints through a storage backend (an object store, or any :class:`~fireflyer.storage.backends.Backend`).

Each rank still writes its part to ``root`` first (node-local disk: the fast, parallel,
verified path), then uploads it: the tensors and skeleton (JSON), then its part's JSON, which
marks the part complete. Rank 0 waits for every rank's JSON *on the backend*, then
writes the manifest and, last, the ``COMMIT`` marker there. Loading a step that is not
on local disk downloads it from the backend into ``root`` and loads it from there, so
every byte is still verified against the manifest's checksums.

Keys mirror the local layout: ``step_0000001200/rank00000.safetensors`` and so on.
"""

from __future__ import annotations

import os
import re
import time

from fireflyer.checkpoint.errors import CheckpointError, CorruptCheckpoint
from fireflyer.checkpoint.names import plain_name
from fireflyer.storage.backends import Backend
from fireflyer.storage.errors import NotFound

_STEP_KEY = re.compile(r"^(step_\d{10})/COMMIT$")


def upload_part(backend: Backend, step_name: str, local_dir: str, files: list[str]) -> None:
    """Upload this rank's files of a step; the last one named (its part's JSON) marks it complete."""
    for name in files:
        backend.upload(f"{step_name}/{name}", os.path.join(local_dir, name))


def wait_part(backend: Backend, step_name: str, name: str, deadline: float, what: str) -> bytes:
    """The bytes of ``step_name/name`` once some rank has uploaded it, or CheckpointError at ``deadline``."""
    key = f"{step_name}/{name}"
    while True:
        try:
            return backend.read(key)
        except NotFound:
            pass
        if time.monotonic() > deadline:
            raise CheckpointError(f"{what} did not reach {backend!r} in time; the checkpoint was not committed")
        time.sleep(0.05)


def committed_steps(backend: Backend) -> list[int]:
    """Steps with a COMMIT marker on the backend, oldest first."""
    steps = []
    for key in backend.list("step_"):
        m = _STEP_KEY.match(key)
        if m:
            steps.append(int(m.group(1)[len("step_"):]))
    return sorted(steps)


def fetch_step(backend: Backend, step_name: str, local_dir: str) -> None:
    """Download a committed step into ``local_dir`` (the COMMIT marker last, so a half fetch is never trusted)."""
    keys = backend.list(step_name + "/")
    if f"{step_name}/COMMIT" not in keys:
        raise CorruptCheckpoint(f"{step_name} has no COMMIT marker on {backend!r}")
    # Every key must be step_name/<plain name>: a key such as step_x/../../.bashrc is refused before
    # anything is written, so a download never lands outside local_dir.
    names = {key: plain_name(key[len(step_name) + 1:], f"key {key!r} on {backend!r}") for key in keys}
    os.makedirs(local_dir, exist_ok=True)
    for key in sorted(keys, key=lambda k: k.endswith("/COMMIT")):
        try:
            backend.download(key, os.path.join(local_dir, names[key]))
        except NotFound:
            raise CorruptCheckpoint(f"{key} disappeared from {backend!r} while loading") from None


def delete_step(backend: Backend, step_name: str) -> None:
    """Remove a step: its COMMIT marker first, so a half-deleted step is never taken for a committed one."""
    keys = backend.list(step_name + "/")
    for key in sorted(keys, key=lambda k: not k.endswith("/COMMIT")):
        backend.delete(key)
