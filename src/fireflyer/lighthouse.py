"""torchft's Lighthouse, found and started for a fault-tolerant run (``fireflyer train --fault-tolerant``) or task
(``fireflyer submit --fault-tolerant``).

The Lighthouse is torchft's quorum server, a binary its wheel installs beside the Python. It
runs on a free loopback port, in a session of its own (a terminal's Ctrl-C stops the run, not
it, first) and dies with the process that started it. The replicas find it through
:data:`LIGHTHOUSE_ENV`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from fireflyer import lifetime
from fireflyer.errors import FireflyerError
from fireflyer.ports import free_port

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""Where the ranks find the Lighthouse (torchft's own variable)."""
HEARTBEAT_TIMEOUT_MS = 1500
"""A replica that has not heartbeated for this long is left out of the next quorum."""
JOIN_TIMEOUT_MS = 5000
"""How long a quorum waits for a member of the previous quorum that still heartbeats but has not asked for this one
(a replica slow on a busy host) before forming without it. A dead replica stops heartbeating, so the quorum forms
without it after :data:`HEARTBEAT_TIMEOUT_MS` whatever this is; a shorter wait only drops live replicas that must
then heal back in."""
QUORUM_TICK_MS = 50
"""How often the Lighthouse looks for a quorum it can form."""


class LighthouseFailed(FireflyerError, RuntimeError):
    """torchft's Lighthouse could not be found or started."""


def lighthouse_binary() -> str:
    """torchft's Lighthouse, as its wheel installs it beside this Python (or on PATH)."""
    found = Path(sys.executable).parent / "torchft_lighthouse"
    if found.exists():
        return str(found)
    other = shutil.which("torchft_lighthouse")
    if other:
        return other
    raise LighthouseFailed("torchft's Lighthouse (torchft_lighthouse) is not installed: "
                           "pip install 'fireflyer[ft]' (torchft==0.2.0)")


def start_lighthouse(log: Path, *, wait_s: float = 15.0) -> tuple[subprocess.Popen, str]:
    """Start the Lighthouse on a free loopback port, its output appended to ``log``; its process and address once
    it answers (within ``wait_s`` seconds, or :class:`LighthouseFailed`)."""
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen([lighthouse_binary(), "--min_replicas", "1", "--join_timeout_ms", str(JOIN_TIMEOUT_MS),
                                 "--quorum_tick_ms", str(QUORUM_TICK_MS), "--heartbeat_timeout_ms",
                                 str(HEARTBEAT_TIMEOUT_MS), "--bind", f"127.0.0.1:{port}"],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, env={**os.environ, "RUST_LOG": "warn"},
                                start_new_session=True, preexec_fn=lifetime.tied_to_me(signal.SIGKILL))
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LighthouseFailed(f"torchft's Lighthouse exited with code {proc.returncode}; see {log}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise LighthouseFailed(f"torchft's Lighthouse did not answer on 127.0.0.1:{port} within {wait_s:g} s")
