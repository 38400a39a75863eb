"""Free TCP ports for rendezvous masters. Imports nothing heavy, so launchers start fast."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for a rendezvous master)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
