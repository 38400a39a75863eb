"""The Slurm executor against a real Slurm (started by ``.ci/setup-slurm``: slurmctld and two
slurmd daemons emulating nodes fnode0 and fnode1 on this host).

Skipped, with the reason, when no Slurm controller answers. Every wait is bounded; nothing
asserts on timing.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fireflyer.platform.scheduler.pidlock import daemon_pid
from fireflyer.platform.executors.base import Launch, Timeouts
from fireflyer.platform.layout import AttemptDir, Home, open_runs_dir, read_json, write_json
from fireflyer.platform.executors.slurm import (
    SlurmError,
    SlurmExecutor,
    drain,
    run_slurm,
    slurm_nodes,
    undrain,
)
from fireflyer.platform.state.store import StopCode, Store
from fireflyer.testing.users import account_site, accounts_unavailable

pytestmark = pytest.mark.integration

SETUP_STATUS = Path("/run/fireflyer-slurm.status")
WAIT_S = 40.0


@functools.cache
def _why_no_slurm() -> str | None:
    if shutil.which("sbatch") is None:
        return "Slurm's client is not installed (run .ci/setup-slurm as root)"
    try:
        nodes = slurm_nodes(timeout=10)
    except SlurmError as exc:
        setup = SETUP_STATUS.read_text().strip() if SETUP_STATUS.exists() else "not run"
        return f"no Slurm controller answers ({exc}); .ci/setup-slurm said: {setup}"
    if not any(n.usable for n in nodes):
        return f"Slurm has no usable node: {nodes}"
    return None


@pytest.fixture(scope="module")
def nodes() -> list[str]:
    why = _why_no_slurm()
    if why:
        pytest.skip(why)
    usable = [n.name for n in slurm_nodes(partition="low") if n.usable] or \
        [n.name for n in slurm_nodes() if n.usable]
    return usable[:2]


@pytest.fixture
def run_attempt(tmp_path: Path):
    """Write an attempt's spec and launch it on Slurm; every job it started is cancelled at the end."""
    ex = SlurmExecutor()
    jobs: list[str] = []
    counter = iter(range(1, 1000))

    def start(command: list[str], nodes: list[str], *, ranks_per_node: int = 1, chain: int = 1,
              attempt: int = 0, timeouts: Timeouts | None = None,
              executor: SlurmExecutor | None = None) -> tuple[AttemptDir, str, Launch]:
        task_id = 900_000 + os.getpid() % 1000 * 100 + next(counter)
        launch = Launch(task_id=task_id, chain_id=chain, attempt=attempt, name="it", user="test",
                        command=tuple(command), nodes=tuple(nodes), ranks_per_node=ranks_per_node,
                        master_port=29600 + task_id % 1000, cwd=str(tmp_path),
                        timeouts=timeouts or Timeouts(suspend_ack=5, suspend_grace=20, unschedulable=60))
        adir = AttemptDir(tmp_path / f"task{task_id}")
        adir.create()
        write_json(adir.spec, launch.to_json(), sort_keys=True)
        handle = (executor or ex).launch(launch, str(adir.root))
        jobs.append(handle)
        return adir, handle, launch

    start.executor = ex  # type: ignore[attr-defined]
    yield start
    for job in jobs:
        try:
            ex.kill(job)
        except SlurmError:
            pass


def wait_for(what: str, cond: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.2)


def wait_ended(ex: SlurmExecutor, adir: AttemptDir, handle: str, timeout: float = WAIT_S) -> dict:
    wait_for(f"job {handle} to end", lambda: not ex.alive(handle), timeout)
    status = read_json(adir.status)
    assert status is not None, f"job {handle} ended without status.json; {_logs(adir)}"
    return status


def _logs(adir: AttemptDir) -> str:
    out = []
    for log in sorted(adir.logs.glob("*")):
        out.append(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}")
    return "\n".join(out)


def script(tmp_path: Path, name: str, body: str) -> list[str]:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


ENV_DUMP = """
    import json, os
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT", "FIREFLYER_NODE_ID", "FIREFLYER_TASK_ID", "FIREFLYER_NNODES", "SLURM_JOB_ID"]
    print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
"""

COUNTER = """
    # counts to TARGET, one step per 10 ms; on a suspend request it saves its step and suspends
    import os, sys, time
    from fireflyer.platform import client
    TARGET = 500
    progress = os.path.join(os.path.dirname(os.path.abspath(__file__)), "progress")
    step = int(open(progress).read()) if os.path.exists(progress) else 0
    print(f"start at {step} (attempt {client.attempt()})", flush=True)
    while step < TARGET:
        if client.receive_suspend_command():
            with open(progress + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(progress + ".tmp", progress)
            client.set_whole_life_state(step)
            print(f"suspending at {step}", flush=True)
            client.go_suspend()
        step += 1
        time.sleep(0.01)
    with open(progress, "w") as f:
        f.write(str(step))
    print(f"done at {step}", flush=True)
"""


def _rank_envs(adir: AttemptDir) -> list[dict]:
    envs = []
    for log in adir.rank_logs():
        for line in log.read_text().splitlines():
            if line.startswith("ENV "):
                envs.append(json.loads(line[4:]))
    return sorted(envs, key=lambda e: int(e["RANK"]))


def test_launch_runs_every_rank_through_the_supervisor(nodes, run_attempt, tmp_path):
    ex: SlurmExecutor = run_attempt.executor
    adir, handle, launch = run_attempt(script(tmp_path, "env.py", ENV_DUMP), nodes, ranks_per_node=2)
    assert handle.isdigit()
    assert ex.find(launch.task_id, str(adir.root)) == handle
    assert ex.find(launch.task_id, str(tmp_path / "another-home")) is None
    status = wait_ended(ex, adir, handle)
    assert status["stop_code"] == StopCode.STOP, _logs(adir)
    assert status["exit_codes"] == {"srun": 0}
    envs = _rank_envs(adir)
    world = 2 * len(nodes)
    assert [int(e["RANK"]) for e in envs] == list(range(world)), _logs(adir)
    for e in envs:
        rank = int(e["RANK"])
        assert e["WORLD_SIZE"] == str(world) and e["LOCAL_WORLD_SIZE"] == "2"
        assert e["LOCAL_RANK"] == str(rank % 2) and e["GROUP_RANK"] == str(rank // 2)
        assert e["FIREFLYER_NODE_ID"] == nodes[rank // 2], "ranks run on the nodes the platform chose, in order"
        assert e["MASTER_ADDR"] == "127.0.0.1" and e["MASTER_PORT"] == str(launch.master_port)
        assert e["FIREFLYER_TASK_ID"] == str(launch.task_id) and e["SLURM_JOB_ID"] == handle
    assert (adir.logs / f"slurm-{handle}.out").exists()
    assert ex.state(handle) == "COMPLETED"

    # Slurm requeues the finished job (as after a node failure): its supervisor sees
    # status.json and exits at once; no rank runs a second time.
    before = {p.name: p.read_text() for p in adir.rank_logs()}
    # A requeue within a moment of the end can find slurmd still cleaning the job up ("Job N
    # already killed, do not launch batch job"): the relaunch then fails in Slurm, before our
    # script runs. Pause first, and try again if Slurm failed it that way.
    for _ in range(3):
        time.sleep(2.0)
        run_slurm(["scontrol", "requeue", handle])
        run_slurm(["scontrol", "update", f"jobid={handle}", "starttime=now"])  # no requeue delay
        wait_for(f"requeued job {handle} to run again and end",
                 lambda: ex.state(handle) in ("COMPLETED", "FAILED") and
                 "(requeued)" not in (run_slurm(["squeue", "-h", "-j", handle, "--states=all", "-o", "%r"])))
        if ex.state(handle) == "COMPLETED":
            break
    assert ex.state(handle) == "COMPLETED"
    assert {p.name: p.read_text() for p in adir.rank_logs()} == before
    assert read_json(adir.status) == status


WHO = """
    import json, os
    print("WHO " + json.dumps({"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
                               "rank": os.environ.get("RANK"), "cwd": os.getcwd(),
                               "canary": os.environ.get("FIREFLYER_TEST_DAEMON_CANARY")}), flush=True)
"""


@pytest.mark.skipif(accounts_unavailable() is not None, reason=str(accounts_unavailable()))
def test_an_attempt_of_a_mapped_user_is_their_slurm_job(nodes, monkeypatch):
    """The daemon (root) submits with sbatch as the task's account, so slurmd starts the job as that user:
    the job, its supervisor and every rank run with the account's uid and groups, nothing of the daemon's
    environment, and every file of the attempt is the account's."""
    monkeypatch.setenv("FIREFLYER_TEST_DAEMON_CANARY", "the daemon's own secret")
    with account_site("s") as (base, accounts):
        account = accounts["s"]
        runs = base / "runs"
        open_runs_dir(runs)
        who = Path(account.home) / "who.py"
        who.write_text(textwrap.dedent(WHO))
        os.chown(who, account.uid, account.gid)
        task_id = 950_000 + os.getpid() % 1000
        launch = Launch(task_id=task_id, chain_id=task_id, attempt=0, name="as-user", user="sam",
                        command=(sys.executable, str(who)), nodes=tuple(nodes), ranks_per_node=1,
                        master_port=29900 + task_id % 100, cwd=account.home, account=account.to_json(),
                        timeouts=Timeouts(suspend_ack=5, suspend_grace=20, unschedulable=60))
        adir = AttemptDir(runs / str(task_id))
        adir.prepare(launch.to_json(), account.uid, account.gid)
        ex = SlurmExecutor()
        handle = ex.launch(launch, str(adir.root))
        try:
            owner = run_slurm(["squeue", "-h", "-j", handle, "--states=all", "-o", "%u"]).strip()
            assert owner in (account.name, ""), f"job {handle} belongs to {owner!r}"  # "" once it is gone
            wait_for(f"job {handle} to end", lambda: not ex.alive(handle))
            status = adir.read_json(adir.status)  # a file of the account's, or this raises
            assert status is not None and status["stop_code"] == StopCode.STOP, _logs(adir)
            seen = [json.loads(line[4:]) for log in adir.rank_logs() for line in log.read_text().splitlines()
                    if line.startswith("WHO ")]
            assert sorted(int(w["rank"]) for w in seen) == list(range(len(nodes))), _logs(adir)
            for w in seen:
                assert (w["uid"], w["gid"]) == (account.uid, account.gid) and set(w["groups"]) == set(account.groups)
                assert w["cwd"] == account.home and w["canary"] is None
            for path in [adir.status, adir.logs / f"slurm-{handle}.out", *adir.rank_logs()]:
                st = os.lstat(path)
                assert st.st_uid == account.uid and not st.st_mode & 0o077, (path, st.st_uid, oct(st.st_mode))
        finally:
            ex.kill(handle)


def test_a_failed_rank_stops_its_peers(nodes, run_attempt, tmp_path):
    ex: SlurmExecutor = run_attempt.executor
    cmd = script(tmp_path, "fail.py", """
        import os, sys, time
        if os.environ["RANK"] == "1":
            print("rank 1 fails", flush=True)
            sys.exit(3)
        time.sleep(600)  # a peer that would hang in its next collective
    """)
    adir, handle, _ = run_attempt(cmd, nodes, ranks_per_node=1 if len(nodes) > 1 else 2)
    status = wait_ended(ex, adir, handle)
    assert status["stop_code"] == StopCode.FAILED, _logs(adir)
    assert "srun" in status["detail"]
    srun_log = (adir.logs / "srun.log").read_text()
    assert "task 1" in srun_log and "code 3" in srun_log, srun_log


def test_suspend_by_slurm_signal_then_resume_as_a_new_job(nodes, run_attempt, tmp_path):
    ex: SlurmExecutor = run_attempt.executor
    cmd = script(tmp_path, "counter.py", COUNTER)
    adir, handle, _ = run_attempt(cmd, nodes[:1], chain=7)
    wait_for("the rank to start", lambda: adir.started_marker(0).exists())
    wait_for("the first steps", lambda: "start at 0" in adir.rank_log(0).read_text())
    time.sleep(0.5)
    ex.signal(handle, "USR1")  # Slurm's own signal path: scancel --signal=USR1 --batch
    status = wait_ended(ex, adir, handle)
    assert status["stop_code"] == StopCode.INTERRUPT, _logs(adir)
    assert status["signal"] == "SIGUSR1"
    assert "go_suspend" in status["detail"]
    saved = int((tmp_path / "progress").read_text())
    assert 0 < saved < 500
    assert status["whole_life_state"] == saved
    assert adir.has_flag("received") and adir.has_flag("can_suspend")

    # the chain's next attempt is a new sbatch that resumes from the saved step
    adir2, handle2, _ = run_attempt(cmd, nodes[:1], chain=7, attempt=1)
    assert handle2 != handle
    status2 = wait_ended(ex, adir2, handle2)
    assert status2["stop_code"] == StopCode.STOP, _logs(adir2)
    log = adir2.rank_log(0).read_text()
    assert f"start at {saved} (attempt 1)" in log and "done at 500" in log, log
    assert (tmp_path / "progress").read_text() == "500"


def test_slurms_own_signals_run_the_suspend_handshake(nodes, run_attempt, tmp_path):
    """Slurm's two signals, at once when there are two nodes (the first waits on Slurm's
    periodic time-limit check, up to about 30 s):

    * the warning before a time limit: ``--signal=B:USR1@S`` with S (suspend-ack +
      suspend-grace + 10 s) above a one-minute limit, so it is due at once;
    * Slurm's own preemption: a job of the higher-priority partition takes the node, and
      Slurm sends the batch script USR1 (``preempt_send_user_signal``) within GraceTime.

    Either way the job saves and suspends, and the Slurm job ends by the handshake.
    """
    parts = run_slurm(["sinfo", "-h", "-o", "%R"]).split()
    if "high" not in parts or "low" not in parts:
        pytest.skip(f"needs partitions low and high (as .ci/setup-slurm makes), found {parts}")
    limited = SlurmExecutor(time_limit="1")
    tl_cmd = script(tmp_path, "tl/counter.py", COUNTER.replace("TARGET = 500", "TARGET = 100_000"))
    tl_adir, tl_job, _ = run_attempt(tl_cmd, nodes[-1:], timeouts=Timeouts(suspend_ack=5, suspend_grace=20),
                                     executor=limited)

    def check_time_limit() -> None:
        status = wait_ended(limited, tl_adir, tl_job, timeout=90)
        assert status["stop_code"] == StopCode.INTERRUPT, _logs(tl_adir)
        assert "go_suspend" in status["detail"]
        # the warning may come as the job starts, before the supervisor has its handler:
        # the batch script raises the suspend itself
        assert tl_adir.flag("suspend").read_text().startswith("signal SIGUSR1")
        assert int((tmp_path / "tl" / "progress").read_text()) >= 0
        assert limited.state(tl_job) == "COMPLETED", "it ended by the handshake, not by Slurm's kill at the limit"

    if len(nodes) == 1:
        check_time_limit()
    ex: SlurmExecutor = run_attempt.executor
    adir, handle, _ = run_attempt(script(tmp_path, "pre/counter.py", COUNTER), nodes[:1])
    wait_for("the rank to start", lambda: adir.started_marker(0).exists())
    wait_for("the first steps", lambda: "start at 0" in adir.rank_log(0).read_text())
    high = run_slurm(["sbatch", "--parsable", "--partition", "high", "--exclusive", "--nodelist", nodes[0],
                      "--job-name", "fireflyer-it-high", "--output", "/dev/null", "--wrap", "sleep 1"]).strip()
    try:
        status = wait_ended(ex, adir, handle)
        assert status["stop_code"] == StopCode.INTERRUPT, _logs(adir)
        assert adir.flag("suspend").read_text().startswith("signal SIGUSR1") and "go_suspend" in status["detail"]
        assert 0 < int((tmp_path / "pre" / "progress").read_text()) < 500
        wait_for("the high-priority job to run", lambda: ex.state(high) == "COMPLETED")
    finally:
        ex.kill(high)
    if len(nodes) > 1:
        check_time_limit()


def test_kill_cancels_the_job_and_is_idempotent(nodes, run_attempt, tmp_path):
    ex: SlurmExecutor = run_attempt.executor
    cmd = script(tmp_path, "sleep.py", "import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    adir, handle, _ = run_attempt(cmd, nodes[:1])
    wait_for("the rank to start", lambda: adir.started_marker(0).exists())
    assert ex.alive(handle) and ex.state(handle) == "RUNNING"
    ex.kill(handle)
    wait_for(f"job {handle} to go", lambda: not ex.alive(handle))
    assert ex.state(handle) == "CANCELLED"
    ex.kill(handle)  # again: nothing to do, no error
    wait_for("the rank to be gone", lambda: subprocess.run(
        ["pgrep", "-f", str(tmp_path / "sleep.py")], capture_output=True, check=False).returncode != 0)


def test_drain_and_undrain_a_node(nodes):
    node = nodes[-1]
    try:
        drain(node, "fireflyer integration test")
        state = {n.name: n for n in slurm_nodes()}[node]
        assert state.drained and not state.usable
    finally:
        undrain(node)
    wait_for(f"{node} to be usable again", lambda: {n.name: n for n in slurm_nodes()}[node].usable, timeout=10)
    undrain(node)  # not drained: nothing to do


def test_a_zone_feature_sets_the_node_zone(nodes):
    node = nodes[-1]
    try:
        run_slurm(["scontrol", "update", f"nodename={node}", "availablefeatures=zone=z1,fast"])
        found = {n.name: n for n in slurm_nodes()}
        assert found[node].zone == "z1"
        assert all(n.zone == "zone0" for name, n in found.items() if name != node)
    finally:
        run_slurm(["scontrol", "update", f"nodename={node}", "activefeatures=", "availablefeatures="])
    assert {n.name: n for n in slurm_nodes()}[node].zone == "zone0"


# ---------------------------------------------------------------------- the platform on Slurm
STEPPER = """
    # counts STEPS steps (20 ms each), logging "attempt step" per step; saves and suspends when asked
    import os, sys, time
    from fireflyer.platform import client
    state, steps = sys.argv[1], int(sys.argv[2])
    if client.rank() != 0:  # other ranks live as long as rank 0 needs them
        while not os.path.exists(state + ".done"):
            time.sleep(0.05)
        sys.exit(0)
    step = int(open(state).read()) if os.path.exists(state) else 0
    print(f"attempt {client.attempt()} starts at {step} on {os.environ['FIREFLYER_NODE_ID']} "
          f"in Slurm job {os.environ.get('SLURM_JOB_ID')}", flush=True)
    while step < steps:
        if client.receive_suspend_command():
            with open(state + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(state + ".tmp", state)
            print(f"suspending at {step}", flush=True)
            client.go_suspend()
        with open(state + ".log", "a") as f:
            f.write(f"{client.attempt()} {step}\\n")
        step += 1
        time.sleep(0.02)
    with open(state + ".done", "w") as f:
        f.write(str(step))
"""


class SlurmPlatform:
    """``fireflyer platform start --executor slurm`` in a temporary home, driven through the CLI."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.cli("platform", "start", "--executor", "slurm", "--tick", "0.2", "--suspend-ack", "5",
                 "--suspend-grace", "20", "--unschedulable-after", "60")

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        env = {**os.environ, "FIREFLYER_PLATFORM_HOME": str(self.home)}
        done = subprocess.run([sys.executable, "-m", "fireflyer", *args], capture_output=True, text=True,
                              env=env, timeout=60, check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"fireflyer {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def submit(self, command: list[str], *, nodes: int, priority: str, name: str) -> int:
        out = self.cli("submit", "-n", str(nodes), "-p", priority, "--name", name, "--json", "--", *command)
        return int(json.loads(out.stdout)["id"])

    def describe(self, task: int) -> dict:
        return json.loads(self.cli("describe", str(task), "--json").stdout)

    def wait_state(self, task: int, state: str, timeout: float = 60) -> dict:
        found: dict = {}

        def check() -> bool:
            found.update(self.describe(task))
            return found["state"] == state
        try:
            wait_for(f"task {task} to be {state}", check, timeout)
        except AssertionError as exc:
            log = (self.home / "daemon.log")
            tail = log.read_text().splitlines()[-10:] if log.exists() else []
            raise AssertionError(f"{exc}; last seen {found.get('state')}; daemon log: {' | '.join(tail)}") from None
        return found

    def close(self) -> None:
        self.cli("platform", "stop", check=False)
        store = Store(self.home / "state.db")
        try:
            for t in store.tasks():
                if t.handle:
                    try:
                        SlurmExecutor().kill(t.handle)
                    except SlurmError:
                        pass
        finally:
            store.close()


def test_platform_on_slurm_preempts_requeues_and_resumes(nodes, tmp_path):
    """The HAI flow with executor=slurm: a low-priority task runs (and is adopted by a new
    daemon after the first is killed with -9); a HIGH task needs its node; the low one
    acknowledges, saves and ends; the high one runs; the low chain's next attempt is a new
    Slurm job that resumes from the saved step and finishes."""
    platform = SlurmPlatform(tmp_path / "home")
    try:
        stepper = script(tmp_path, "stepper.py", STEPPER)
        low_state = tmp_path / "low"
        low_log = tmp_path / "low.log"
        low = platform.submit([*stepper, str(low_state), "400"], nodes=1, priority="LOW", name="low")
        wait_for("the low task to make progress",
                 lambda: low_log.exists() and len(low_log.read_text().splitlines()) >= 10)
        first = platform.describe(low)
        assert first["state"] == "running" and first["handle"].isdigit()
        assert SlurmExecutor().state(first["handle"]) == "RUNNING"

        # the daemon dies with -9 as if between sbatch and recording the job id: the next
        # daemon finds the Slurm job by name and attempt directory and adopts it
        home = Home(tmp_path / "home")
        pid = daemon_pid(home)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for("the daemon's lock to be free", lambda: daemon_pid(home) is None, timeout=10)
        store = Store(home.db)
        try:
            store.set_handle(first["task_id"], None)
        finally:
            store.close()
        platform.cli("platform", "start")
        wait_for("the running attempt to be adopted", lambda: platform.describe(low)["handle"] == first["handle"])
        assert platform.describe(low)["state"] == "running"
        high = platform.submit([*stepper, str(tmp_path / "high"), "5"], nodes=len(nodes), priority="HIGH",
                               name="high")
        done_high = platform.wait_state(high, "finished")
        assert done_high["stop"] == "STOP", done_high
        assert sorted(done_high["attempts"][0]["assigned"]) == sorted(nodes)
        done_low = platform.wait_state(low, "finished", timeout=60)
        attempts = done_low["attempts"]
        assert [a["stop"] for a in attempts] == ["INTERRUPT", "STOP"], attempts
        assert "go_suspend" in attempts[0]["detail"]
        jobs = [a["handle"] for a in attempts]
        assert len(set(jobs)) == 2 and jobs[0] == first["handle"], "each attempt is its own Slurm job"
        assert done_high["handle"] not in jobs
        # every step ran exactly once, in order, over the two attempts; the second began after 'high' ended
        ran = [tuple(map(int, line.split())) for line in low_log.read_text().splitlines()]
        assert [s for _, s in ran] == list(range(400))
        assert {a for a, _ in ran} == {0, 1}
        assert (tmp_path / "low.done").read_text() == "400"
        assert attempts[1]["started_at"] >= done_high["attempts"][0]["finished_at"]
        logs = platform.cli("logs", str(low)).stdout
        saved = min(s for a, s in ran if a == 1)
        assert 0 < saved < 400
        assert f"attempt 1 starts at {saved} on " in logs and f"in Slurm job {jobs[1]}" in logs, logs
    finally:
        platform.close()
