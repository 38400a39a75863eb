"""Tasks run as their owners' Unix accounts: real accounts, a real daemon and the real HTTP server.

As root, the test makes two accounts with useradd, maps platform users alice and bob to
them, and has each submit through ``POST /api/tasks``. bob's task leaves a secret in its
environment and its log; alice's task is a probe that reports who it runs as and tries to
read the home, ``state.db``, bob's attempt folder and log, and to write the store. A
third task of alice's swaps its log for a link to a file of root's, which the API must
not serve. Skipped (with the reason) where accounts cannot be made: not root, or no
useradd/setfacl.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from fireflyer.platform.layout import Home  # noqa: E402
from fireflyer.platform.executors.local import kill_active  # noqa: E402
from fireflyer.testing.users import account_site, accounts_unavailable  # noqa: E402

from test_platform_server import call, ok  # noqa: E402

from fireflyer.testing.server import Server  # noqa: E402

needs_accounts = pytest.mark.skipif(accounts_unavailable() is not None, reason=str(accounts_unavailable()))

CANARY = "FIREFLYER_TEST_DAEMON_CANARY"
BOB_SECRET = "bob-wandb-key-7f3a"

PROBE = r"""
import json, os, sys
home, runs, bob_dir = sys.argv[1:4]

def attempt(fn):
    try:
        fn()
        return "ok"
    except PermissionError:
        return "denied"
    except OSError as exc:
        return type(exc).__name__

mine = os.environ["FIREFLYER_TASK_DIR"]
report = {
    "uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
    "cwd": os.getcwd(), "umask": os.umask(0o077), "env": sorted(os.environ),
    "home_var": os.environ.get("HOME"),
    "list_home": attempt(lambda: os.listdir(home)),
    "read_db": attempt(lambda: open(os.path.join(home, "state.db"), "rb").read(1)),
    "write_db": attempt(lambda: open(os.path.join(home, "state.db"), "ab").close()),
    "list_runs": attempt(lambda: os.listdir(runs)),
    "list_bob": attempt(lambda: os.listdir(bob_dir)),
    "read_bob_spec": attempt(lambda: open(os.path.join(bob_dir, "spec.json")).read()),
    "read_bob_log": attempt(lambda: open(os.path.join(bob_dir, "logs", "rank0.log")).read()),
    "read_bob_secret": attempt(lambda: open(os.path.join(bob_dir, "secret")).read()),
    "my_dir_owner": os.stat(mine).st_uid, "my_dir_mode": oct(os.stat(mine).st_mode & 0o777),
}
print("PROBE " + json.dumps(report), flush=True)
"""

SWAP = r"""
import os
log = os.path.join(os.environ["FIREFLYER_LOG_DIR"], "rank0.log")
print("this line goes to the real log", flush=True)
os.rename(log, log + ".moved")
os.symlink("/etc/shadow", log)
"""


@pytest.fixture()
def site():
    """Two real accounts, and a folder for the platform's home and runs that they can enter."""
    with account_site("a", "b") as (base, accounts):
        yield base, accounts


def _cli(home: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "fireflyer", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "FIREFLYER_PLATFORM_HOME": str(home), **(env or {})},
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"fireflyer {' '.join(args)}: {done.stderr.strip()}"
    return done


def _wait_finished(server: Server, token: str, task: int, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        d = ok(call(server, "GET", f"/api/tasks/{task}", token=token))
        if d["state"] == "finished":
            return d
        time.sleep(0.2)
    raise AssertionError(f"task {task} did not finish in {timeout:g} s: {d}")


@needs_accounts
def test_tasks_run_as_their_owners_accounts_and_cannot_reach_each_other(site):
    base, accounts = site
    alice, bob = accounts["a"], accounts["b"]
    home, runs = base / "home", base / "runs"
    _cli(home, "platform", "start", "--tick", "0.1", "--nodes", "2", "--runs-dir", str(runs),
         env={CANARY: "the daemon's own secret"})
    server = None
    try:
        tokens = {}
        for user, account in (("alice", alice), ("bob", bob)):
            tokens[user] = _cli(home, "platform", "user", "add", user, "--unix", account.name).stdout.strip()
        tokens["carol"] = _cli(home, "platform", "user", "add", "carol").stdout.strip()  # no account
        tokens["rooty"] = _cli(home, "platform", "user", "add", "rooty", "--unix", "root").stdout.strip()
        server = Server(Home(home), base / "server.log")

        # a user without an account, and one mapped to root, get a clear refusal and nothing runs
        for user, says in (("carol", "carol has none"), ("rooty", "maps to root")):
            reply = call(server, "POST", "/api/tasks", token=tokens[user], body={"nodes": 1, "command": ["true"]})
            assert reply.status == 403 and says in reply.json["detail"], reply.text

        bob_task = ok(call(server, "POST", "/api/tasks", token=tokens["bob"], body={
            "nodes": 1, "name": "bob-secret", "env": {"WANDB_API_KEY": BOB_SECRET},
            "command": [sys.executable, "-c", "import os; print('key', os.environ['WANDB_API_KEY'])"]}), 201)
        done = _wait_finished(server, tokens["bob"], bob_task["id"])
        assert done["outcome"] == "succeeded", done
        bob_dir = runs / str(done["task_id"])
        log = bob_dir / "logs" / "rank0.log"
        assert BOB_SECRET in log.read_text()
        for path, mode in ((bob_dir, 0o700), (log, 0o600), (bob_dir / "spec.json", 0o600)):
            st = os.lstat(path)
            assert st.st_uid == bob.uid and stat.S_IMODE(st.st_mode) == mode, (path, st.st_uid, oct(st.st_mode))
        assert stat.S_IMODE(os.stat(home).st_mode) == 0o700 and stat.S_IMODE(os.stat(home / "state.db").st_mode) \
            == 0o600
        assert stat.S_IMODE(os.stat(runs).st_mode) == 0o711

        probe = Path(alice.home) / "probe.py"
        probe.write_text(PROBE)
        os.chown(probe, alice.uid, alice.gid)
        alice_task = ok(call(server, "POST", "/api/tasks", token=tokens["alice"], body={
            "nodes": 1, "name": "probe", "command": [sys.executable, str(probe), str(home), str(runs), str(bob_dir)]}),
            201)
        done = _wait_finished(server, tokens["alice"], alice_task["id"])
        text = ok(call(server, "GET", f"/api/tasks/{alice_task['id']}/logs", token=tokens["alice"]))["text"]
        assert done["outcome"] == "succeeded", (done, text)
        report = json.loads(next(line for line in text.splitlines() if line.startswith("PROBE "))[6:])

        assert (report["uid"], report["euid"], report["gid"]) == (alice.uid, alice.uid, alice.gid)
        assert set(report["groups"]) == set(alice.groups) and 0 not in report["groups"]
        assert report["cwd"] == alice.home and report["home_var"] == alice.home
        assert report["umask"] == 0o077
        assert CANARY not in report["env"], "the daemon's environment reached the task"
        assert "WANDB_API_KEY" not in report["env"]
        for what in ("list_home", "read_db", "write_db", "list_runs", "list_bob", "read_bob_spec", "read_bob_log",
                     "read_bob_secret"):
            assert report[what] == "denied", (what, report[what])
        assert report["my_dir_owner"] == alice.uid and report["my_dir_mode"] == "0o700"

        # alice may not read bob's task through the API either
        assert call(server, "GET", f"/api/tasks/{bob_task['id']}/logs", token=tokens["alice"]).status == 403

        # a task that swaps its log for a link to root's file: the API shows nothing of that file
        swap = Path(alice.home) / "swap.py"
        swap.write_text(SWAP)
        os.chown(swap, alice.uid, alice.gid)
        swap_task = ok(call(server, "POST", "/api/tasks", token=tokens["alice"], body={
            "nodes": 1, "command": [sys.executable, str(swap)]}), 201)
        _wait_finished(server, tokens["alice"], swap_task["id"])
        reply = call(server, "GET", f"/api/tasks/{swap_task['id']}/logs", token=tokens["alice"])
        assert reply.status == 403 and "not a file of the task's own account" in reply.json["detail"], reply.text
        assert "root:" not in reply.text
    finally:
        if server is not None:
            server.close()
        _stop(home)


def test_without_a_mapping_the_platform_runs_tasks_as_itself(tmp_path):
    """The single-user default is unchanged: no account mapped, the task runs as the daemon's user."""
    home = tmp_path / "home"
    _cli(home, "platform", "start", "--tick", "0.1", "--nodes", "1")
    try:
        out = json.loads(_cli(home, "submit", "-n", "1", "--json", "--", sys.executable, "-c",
                              "import os; print('uid', os.getuid())").stdout)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            d = json.loads(_cli(home, "describe", str(out["id"]), "--json").stdout)
            if d["state"] == "finished":
                break
            time.sleep(0.2)
        assert d["outcome"] == "succeeded", d
        assert f"uid {os.getuid()}" in _cli(home, "logs", str(out["id"])).stdout
    finally:
        _stop(home)


def _stop(home: Path) -> None:
    subprocess.run([sys.executable, "-m", "fireflyer", "platform", "stop", "--home", str(home)], capture_output=True,
                   timeout=60)
    kill_active(Home(home))
