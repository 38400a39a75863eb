"""The job-side client and the pieces ranks start with: outside the platform, in a fake attempt dir, Slurm env."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fireflyer.platform import client
from fireflyer.platform.executors.base import Launch, Timeouts
from fireflyer.platform.layout import AttemptDir
from fireflyer.platform.attempt.rank import rank_env
from fireflyer.testing.waiting import wait_until


@pytest.fixture
def outside(monkeypatch):
    for name in ("FIREFLYER_TASK_DIR", "FIREFLYER_SIMULATE_SUSPEND", "FIREFLYER_WHOLE_LIFE_STATE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(client, "_acknowledged", False)


def test_outside_the_platform_nothing_is_requested(outside):
    assert not client.is_managed() and client.receive_suspend_command() is False
    with pytest.raises(RuntimeError, match="outside a platform task"):
        client.go_suspend()
    assert client.get_whole_life_state() == 0
    assert client.set_whole_life_state(3) is True and client.get_whole_life_state() == 3
    assert client.set_whole_life_state(3) is False


def test_simulated_suspend_arrives_and_exits(outside):
    code = ("from fireflyer.platform import client\n"
            "import time\n"
            "while not client.receive_suspend_command(): time.sleep(0.01)\n"
            "print('saving'); client.go_suspend()\n"
            "print('never')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                          env={"FIREFLYER_SIMULATE_SUSPEND": "0.2", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stdout.strip() == "saving" and "simulated suspend" in done.stderr


def test_inside_an_attempt_the_flags_are_files(outside, tmp_path, monkeypatch):
    adir = AttemptDir(tmp_path / "attempt")
    adir.create()
    monkeypatch.setenv("FIREFLYER_TASK_DIR", str(adir.root))
    monkeypatch.setenv("FIREFLYER_WHOLE_LIFE_STATE", "5")
    assert client.is_managed() and client.receive_suspend_command() is False
    assert not adir.has_flag("received")
    adir.raise_flag("suspend", "preempted")
    assert client.receive_suspend_command() is True and adir.has_flag("received")
    assert client.get_whole_life_state() == 5
    assert client.set_whole_life_state(6) is True and adir.flag("whole_life_state").read_text() == "6"
    with pytest.raises(ValueError, match="32-bit int"):
        client.set_whole_life_state(2**40)
    with pytest.raises(ValueError, match="32-bit int"):
        client.set_whole_life_state("7")  # type: ignore[arg-type]


def test_suspend_if_requested_announces_the_suspend_it_decides_and_only_that(tmp_path):
    """The announcement comes from the call that decides: a request that arrives after the caller last looked
    at the flag is still announced before the save, and no request means no announcement."""
    adir = AttemptDir(tmp_path / "attempt")
    adir.create()
    code = ("from fireflyer.platform import client\n"
            "class Manager:\n"
            "    def save(self, step, state, blocking): print('saved', step, state)\n"
            "    def wait(self): print('committed')\n"
            "said = lambda: print('announced')\n"
            "assert client.suspend_if_requested(Manager(), 3, lambda: 'state', announce=said) is False\n"
            "from fireflyer.platform.layout import AttemptDir\n"
            f"AttemptDir({str(adir.root)!r}).raise_flag('suspend', 'preempted')\n"
            "client.suspend_if_requested(Manager(), 4, lambda: 'state', announce=said)\n")
    job = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={"FIREFLYER_TASK_DIR": str(adir.root), "PATH": "/usr/bin:/bin"})
    try:  # go_suspend waits for the platform to stop the process: the test stops it, as the platform would
        wait_until(lambda: adir.has_flag("can_suspend") or job.poll() is not None, timeout=60,
                   what="the job to say it can suspend")
    finally:
        job.terminate()
        out, err = job.communicate(timeout=30)
    assert adir.has_flag("can_suspend"), err
    assert out.split("\n")[:3] == ["announced", "saved 4 state", "committed"]
    assert adir.has_flag("received")


def test_go_suspend_raises_the_flag_and_ends_the_process_if_nobody_stops_it(tmp_path):
    adir = AttemptDir(tmp_path / "attempt")
    adir.create()
    code = "from fireflyer.platform import client\nclient.go_suspend(timeout=0.3)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                          env={"FIREFLYER_TASK_DIR": str(adir.root), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and adir.has_flag("can_suspend")


def test_rank_env_fills_torchrun_variables_from_slurm():
    env = rank_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
                    "SLURMD_NODENAME": "gpu07", "SLURM_NTASKS_PER_NODE": "2(x4)"})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["GROUP_RANK"], env["FIREFLYER_NODE_ID"],
            env["LOCAL_WORLD_SIZE"]) == ("5", "8", "1", "2", "gpu07", "2")
    assert rank_env({"RANK": "0", "SLURM_PROCID": "3"})["RANK"] == "0"  # the launcher's own values win
    with pytest.raises(ValueError, match="no RANK"):
        rank_env({})


def test_launch_round_trips_and_timeouts_check_themselves():
    launch = Launch(task_id=3, chain_id=1, attempt=2, name="t", user="u", command=("python", "x.py"),
                    nodes=("node0", "node1"), ranks_per_node=4, master_port=1234, cwd="/tmp", env={"A": "1"},
                    timeouts=Timeouts(suspend_ack=2))
    assert Launch.from_json(launch.to_json()) == launch and launch.world_size == 8
    with pytest.raises(ValueError, match="suspend_grace"):
        Timeouts(suspend_grace=0)
