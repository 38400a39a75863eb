"""Atomic writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fireflyer.fsutil import atomic_write


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON to ``path`` via a temporary file, fsync and rename (:func:`fireflyer.fsutil.atomic_write`)."""
    path = Path(path)
    text = json.dumps(data, indent=1) + "\n"
    atomic_write(str(path), lambda f: f.write(text.encode()), tmp_name=f".{path.name}.{os.getpid()}.tmp")
    return path
