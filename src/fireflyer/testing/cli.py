"""The command as tests use it: ``fireflyer ARGS`` in a child process, and the one line a refusal prints."""

from __future__ import annotations

import subprocess
import sys


def fireflyer(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    """``python -m fireflyer.cli ARGS``, its output captured as text."""
    return subprocess.run([sys.executable, "-m", "fireflyer.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """A failed command's stderr, which must be one line and no traceback."""
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]
