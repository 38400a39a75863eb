"""A platform whose disk fills up, for real: its home on a small tmpfs that the test fills to the last page.

While the disk is full, a real daemon records nothing it cannot (a task that ended is not turned
into a failure, the queued task behind it is not launched), ``platform status`` says the daemon is
unhealthy and why, the CLI's submit and stop print one line and exit 1, and the HTTP API answers
503 with a JSON reason. Once space is back, every task ends as it really did, none of them failed.
Needs root (to mount the tmpfs); skipped otherwise.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fireflyer.platform.scheduler.health import read_heartbeat
from fireflyer.platform.layout import Home
from fireflyer.platform.server.auth import Users
from fireflyer.testing.live_platform import LivePlatform
from fireflyer.testing.server import Server

pytestmark = [pytest.mark.multiproc, pytest.mark.skipif(os.geteuid() != 0, reason="mounting the small tmpfs this test fills needs root")]

DISK = "16m"
# A task that waits for a file outside the full disk, then exits 0 (and gives up after two minutes).
WAITER = ("import os, sys, time\n"
          "deadline = time.monotonic() + 120\n"
          "while not os.path.exists(sys.argv[1]):\n"
          "    if time.monotonic() > deadline:\n"
          "        sys.exit(3)\n"
          "    time.sleep(0.05)\n")


@pytest.fixture
def disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK},mode=0700", "tmpfs", str(mnt)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        filler = mnt / "filler"
        filler.unlink(missing_ok=True)
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30)
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def fill(mnt: Path) -> None:
    """Write ``filler`` until the disk has not one page left."""
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 20, 1 << 12, 1):
            block = b"\0" * size
            while True:
                try:
                    os.write(fd, block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    assert os.statvfs(mnt).f_bavail == 0


def post(server: Server, path: str, token: str, body: dict | None = None) -> tuple[int, dict]:
    conn = server.connection()
    try:
        conn.request("POST", path, body=json.dumps(body or {}),
                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def one_line_failure(done: subprocess.CompletedProcess) -> str:
    err = done.stderr
    assert done.returncode == 1, (done.returncode, done.stdout, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def heartbeat(home: Path) -> dict:
    beat = read_heartbeat(Home(home))
    assert beat is not None, "no heartbeat"
    return beat


def test_a_full_disk_fails_safely(disk, tmp_path):
    home = disk / "home"
    go = tmp_path / "go"
    waiter = (sys.executable, "-c", WAITER, str(go))
    platform = LivePlatform(home, "--nodes", "1")
    server = None
    try:
        with Users(Home(home).db) as users:
            token = users.add("alice")
        server = Server(home, tmp_path / "server.log")
        first = platform.submit(*waiter, user="alice", name="first")
        second = platform.submit(*waiter, user="alice", name="second")  # waits for the only node
        platform.wait_state(first, "running")
        rank = platform.wait("the first task's rank to start", lambda: (home / "tasks" / str(first) / "started" / "rank0")
                    .read_text().split()[0] if (home / "tasks" / str(first) / "started" / "rank0").exists() else None)

        fill(disk)
        err = one_line_failure(platform.cli("submit", "-n", "1", "--", "true", check=False))
        assert "database or disk is full" in err
        assert "database or disk is full" in one_line_failure(platform.cli("stop", str(first), check=False))
        status, reply = post(server, "/api/tasks", token, {"nodes": 1, "command": ["true"], "cwd": "/"})
        assert status == 503 and "database or disk is full" in reply["detail"], (status, reply)
        status, reply = post(server, f"/api/tasks/{first}/stop", token)
        assert status == 503 and "detail" in reply, (status, reply)

        go.touch()  # the first task ends now, while nothing can be written
        platform.wait("the first task's rank to exit", lambda: not Path(f"/proc/{rank}").exists())
        seen = heartbeat(home)["at"]
        platform.wait("ten more cycles", lambda: heartbeat(home)["at"] > seen + 1.0)
        done = platform.cli("platform", "status", check=False)
        assert done.returncode == 1 and "daemon unhealthy: " in done.stdout, done.stdout
        beat = json.loads(platform.cli("platform", "status", "--json", check=False).stdout)
        assert beat["healthy"] is False and beat["problem"], beat
        assert platform.describe(first)["attempts"][0]["stop_code"] == 0  # its end not recorded as anything
        later = platform.describe(second)
        assert later["state"] == "queued" and later["handle"] is None  # not launched: its start not recorded
        assert not (home / "tasks" / str(second)).exists()

        (disk / "filler").unlink()
        for task in (first, second):
            platform.wait(f"task {task} to succeed", lambda t=task: platform.describe(t)["outcome"] == "succeeded")
        for task in (first, second):
            attempts = platform.describe(task)["attempts"]
            assert not [a for a in attempts if a["stop"] and "FAILED" in a["stop"]], attempts
        # the first task succeeded while the disk was full: its supervisor kept its end until it could
        # write it, so it is recorded once, as it was, and not run again
        assert len(platform.describe(first)["attempts"]) == 1, platform.describe(first)["attempts"]
        platform.wait("a healthy status", lambda: platform.cli("platform", "status", check=False).returncode == 0)
        assert "daemon up" in platform.cli("platform", "status").stdout
        assert json.loads(platform.cli("submit", "-n", "1", "--json", "--", "true").stdout)["state"] == "queued"
        assert "Traceback" not in (tmp_path / "server.log").read_text(errors="replace")
    finally:
        if server is not None:
            server.close()
        platform.close()
