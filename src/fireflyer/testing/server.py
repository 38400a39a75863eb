"""The platform's HTTP server run for real in a test: ``serve --port 0`` in a subprocess, on loopback."""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fireflyer.platform.layout import Home

START_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 20.0


class Server:
    """``python -m fireflyer platform serve --port 0``; its URL comes from its first lines of output."""

    def __init__(self, home: "Path | Home", log: Path, *flags: str) -> None:
        if not isinstance(home, (str, os.PathLike)):
            home = home.root
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "fireflyer", "platform", "serve", "--home",
                                          str(home), "--port", "0", *flags], stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            text = log.read_text(errors="replace")
            found = re.search(r"on http://([\d.]+):(\d+) ", text)
            if found and "Application startup complete" in text:
                self.host, self.port = found.group(1), int(found.group(2))
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"the server did not start: {text[-2000:]}")
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def connection(self, source: str | None = None, timeout: float = REQUEST_TIMEOUT_S) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout,
                                          source_address=(source, 0) if source else None)
