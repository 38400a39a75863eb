"""The Slurm executor's command building and parsing, against fake ``sbatch``, ``squeue``,
``scancel``, ``sinfo``, ``scontrol`` and ``srun`` executables put first on PATH (the process
boundary is the one thing faked). The real Slurm runs in test_platform_slurm.py."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fireflyer.platform.executors import slurm
from fireflyer.platform.attempt import starters
from fireflyer.platform.executors.base import Launch, Timeouts
from fireflyer.platform.layout import AttemptDir, write_json
from fireflyer.platform.state.policy import Node
from fireflyer.platform.executors.slurm import SlurmError, SlurmExecutor

FAKE = textwrap.dedent("""\
    #!{python}
    # A fake Slurm command: records its argv (and some env) and answers as the rules file says.
    import json, os, sys, time
    name = os.path.basename(sys.argv[0])
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "calls.jsonl"), "a") as f:
        f.write(json.dumps({{"cmd": name, "argv": sys.argv[1:],
                            "env": {{k: v for k, v in os.environ.items()
                                    if k.startswith(("MASTER_", "WORLD_", "FIREFLYER_", "LOCAL_"))}}}}) + "\\n")
    with open(os.path.join(here, "rules.json")) as f:
        rules = json.load(f).get(name, [])
    joined = " ".join(sys.argv[1:])
    for rule in rules:
        if rule.get("match", "") in joined:
            time.sleep(rule.get("sleep", 0))
            sys.stdout.write(rule.get("out", ""))
            sys.stderr.write(rule.get("err", ""))
            sys.exit(rule.get("rc", 0))
    sys.exit(0)
""")
COMMANDS = ("sbatch", "squeue", "scancel", "sinfo", "scontrol", "srun")


class FakeSlurm:
    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.rules: dict[str, list[dict]] = {}
        self.write()

    def on(self, cmd: str, *, out: str = "", err: str = "", rc: int = 0, sleep: float = 0,
           match: str = "") -> FakeSlurm:
        self.rules.setdefault(cmd, []).append({"out": out, "err": err, "rc": rc, "sleep": sleep, "match": match})
        self.write()
        return self

    def write(self) -> None:
        (self.bin / "rules.json").write_text(json.dumps(self.rules))

    def calls(self, cmd: str | None = None) -> list[dict]:
        path = self.bin / "calls.jsonl"
        if not path.exists():
            return []
        calls = [json.loads(line) for line in path.read_text().splitlines()]
        return [c for c in calls if cmd is None or c["cmd"] == cmd]

    def argv(self, cmd: str) -> list[str]:
        calls = self.calls(cmd)
        assert calls, f"{cmd} was not called"
        return calls[-1]["argv"]


@pytest.fixture
def fake(tmp_path, monkeypatch) -> FakeSlurm:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for cmd in COMMANDS:
        path = bin_dir / cmd
        path.write_text(FAKE.format(python=sys.executable))
        path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return FakeSlurm(bin_dir)


def make_launch(tmp_path: Path, **kw) -> tuple[Launch, AttemptDir]:
    fields = {"task_id": 42, "chain_id": 40, "attempt": 2, "name": "train", "user": "alice",
              "command": ("python", "train.py"), "nodes": ("n1", "n2"), "ranks_per_node": 4, "master_port": 29511,
              "cwd": str(tmp_path), "timeouts": Timeouts(suspend_ack=5, suspend_grace=60), **kw}
    launch = Launch(**fields)
    adir = AttemptDir(tmp_path / "tasks" / str(launch.task_id))
    adir.create()
    write_json(adir.spec, launch.to_json(), sort_keys=True)
    return launch, adir


def option(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} not in {argv}"
    return argv[argv.index(name) + 1]


# ---------------------------------------------------------------------- run_slurm
def test_a_missing_client_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SlurmError, match=r"'squeue' not found: Slurm's client is not installed \(apt-get install"):
        slurm.run_slurm(["squeue", "-h"])


def test_a_failing_command_names_itself_and_slurms_last_word(fake):
    fake.on("squeue", err="squeue: error: some detail\nslurm_load_jobs error: Unable to contact slurm controller\n",
            rc=1)
    with pytest.raises(SlurmError) as err:
        slurm.run_slurm(["squeue", "-h", "-o", "%T x"])
    assert str(err.value) == ("`squeue -h -o '%T x'` failed (exit 1): "
                              "slurm_load_jobs error: Unable to contact slurm controller")


def test_a_hung_command_times_out(fake):
    fake.on("sinfo", sleep=10)
    with pytest.raises(SlurmError, match=r"`sinfo -N` did not answer within 0.3 s; is slurmctld up"):
        slurm.run_slurm(["sinfo", "-N"], timeout=0.3)


def test_known_harmless_errors_return_nothing(fake):
    fake.on("scancel", err="scancel: error: Kill job error on job id 5: Invalid job id specified\n", rc=1)
    assert slurm.run_slurm(["scancel", "5"], ok_errors=("Invalid job id",)) == ""


# ---------------------------------------------------------------------- launch
def test_launch_submits_the_supervisor_on_exactly_the_chosen_nodes(fake, tmp_path):
    fake.on("sbatch", out="1234\n")
    launch, adir = make_launch(tmp_path)
    ex = SlurmExecutor(partition="low", time_limit="4:00:00", extra_args=("--gres=gpu:8",))
    assert ex.launch(launch, str(adir.root)) == "1234"
    argv = fake.argv("sbatch")
    assert argv[0] == "--parsable"
    assert option(argv, "--job-name") == "fireflyer-42"
    assert option(argv, "--nodes") == "2" and option(argv, "--nodelist") == "n1,n2"
    assert option(argv, "--ntasks-per-node") == "4"
    assert "--requeue" in argv and "--exclusive" in argv and "--gres=gpu:8" in argv
    assert "--signal=B:USR1@75" in argv  # suspend_ack + suspend_grace + 10 s of slack
    assert option(argv, "--output") == str(adir.logs / "slurm-%j.out")
    assert option(argv, "--chdir") == str(tmp_path) and option(argv, "--comment") == str(adir.root)
    assert option(argv, "--partition") == "low" and option(argv, "--time") == "4:00:00"
    script = Path(argv[-1])
    assert script == adir.root / "slurm.sh" and os.access(script, os.X_OK)
    text = script.read_text()
    assert text.startswith("#!/bin/sh\n")
    assert f"\n{sys.executable} -m fireflyer.platform.attempt.supervisor {adir.root} --slurm &\n" in text


def test_launch_without_options_leaves_them_to_slurm(fake, tmp_path):
    fake.on("sbatch", out="77;cluster2\n")
    launch, adir = make_launch(tmp_path, nodes=("n3",), ranks_per_node=1)
    assert SlurmExecutor(exclusive=False).launch(launch, str(adir.root)) == "77"
    argv = fake.argv("sbatch")
    for absent in ("--partition", "--time", "--exclusive"):
        assert absent not in argv
    assert option(argv, "--nodelist") == "n3"


def test_launch_quotes_paths_in_the_batch_script(fake, tmp_path):
    fake.on("sbatch", out="5\n")
    root = tmp_path / "a dir with 'quotes'"
    launch = Launch(task_id=1, chain_id=1, attempt=0, name="x", user="u", command=("true",), nodes=("n1",),
                    ranks_per_node=1, master_port=1, cwd=str(tmp_path))
    SlurmExecutor(python="/opt/my python/bin/python").launch(launch, str(root))
    line = next(ln for ln in (root / "slurm.sh").read_text().splitlines() if "supervisor" in ln)
    assert line.startswith("'/opt/my python/bin/python' -m fireflyer.platform.attempt.supervisor '")
    assert shlex.split(line)[3] == str(root)


FAKE_SUPERVISOR = textwrap.dedent("""\
    #!{python}
    # Stands in for the supervisor: slow to start (USR1 as it inherited it meanwhile), then counts USR1s.
    import os, signal, sys, time
    adir = sys.argv[3]
    def mark(name, text=""):  # the test reads a marker as soon as it exists: publish it whole (rename)
        tmp = os.path.join(adir, "." + name)
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(adir, name))
    def count(name, text):  # appended once per signal; read only after the process has exited
        with open(os.path.join(adir, name), "a") as f:
            f.write(text)
    mark("child-started", str(signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN))
    deadline = time.monotonic() + 20
    while not os.path.exists(os.path.join(adir, "go-on")) and time.monotonic() < deadline:
        time.sleep(0.01)
    signal.signal(signal.SIGUSR1, lambda *_: count("child-got", "USR1 "))
    mark("child-ready")
    while not os.path.exists(os.path.join(adir, "release")) and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(7)
""")


def _wait_file(path: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def test_the_batch_script_turns_early_and_late_signals_into_a_suspend(tmp_path):
    """Slurm may signal the batch script the instant the job starts (a time limit shorter
    than the warning): the script itself raises the suspend, and the supervisor, still
    starting, ignores the signal instead of dying of it."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_SUPERVISOR.format(python=sys.executable))
    fake.chmod(0o755)
    launch, adir = make_launch(tmp_path)
    script = adir.root / "slurm.sh"
    script.write_text(SlurmExecutor(python=str(fake)).batch_script(launch, adir))
    proc = subprocess.Popen(["/bin/sh", str(script)], start_new_session=True)
    try:
        _wait_file(adir.root / "child-started")
        assert (adir.root / "child-started").read_text() == "True", "the supervisor starts with USR1 ignored"
        proc.send_signal(signal.SIGUSR1)  # before the supervisor's handler
        _wait_file(adir.flag("suspend"))
        assert adir.flag("suspend").read_text().startswith("signal SIGUSR1")
        (adir.root / "go-on").touch()
        _wait_file(adir.root / "child-ready")
        proc.send_signal(signal.SIGUSR1)  # once it has one, the supervisor gets the signal too
        _wait_file(adir.root / "child-got")
        (adir.root / "release").touch()
        assert proc.wait(timeout=20) == 7, "the script ends with the supervisor's exit code"
        assert (adir.root / "child-got").read_text() == "USR1 "
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("out", ["", "Submitted batch job 12\n", "error\n"])
def test_launch_without_a_job_id_is_an_error(fake, tmp_path, out):
    fake.on("sbatch", out=out)
    launch, adir = make_launch(tmp_path)
    with pytest.raises(SlurmError, match="sbatch for task 42 printed no job id"):
        SlurmExecutor().launch(launch, str(adir.root))


def test_launch_refused_by_slurm(fake, tmp_path):
    fake.on("sbatch", err="sbatch: error: Batch job submission failed: Invalid node name specified\n", rc=1)
    launch, adir = make_launch(tmp_path)
    with pytest.raises(SlurmError, match=r"failed \(exit 1\): sbatch: error: Batch job submission failed: Invalid node"):
        SlurmExecutor().launch(launch, str(adir.root))


def test_launch_with_no_nodes_is_refused(fake, tmp_path):
    launch, adir = make_launch(tmp_path, nodes=())
    with pytest.raises(ValueError, match="no nodes"):
        SlurmExecutor().launch(launch, str(adir.root))
    assert fake.calls("sbatch") == []


def test_the_warning_before_a_time_limit_covers_the_handshake(tmp_path):
    launch, _ = make_launch(tmp_path, timeouts=Timeouts(suspend_ack=5, suspend_grace=0.5))
    assert SlurmExecutor.signal_lead(launch) == 16
    launch, _ = make_launch(tmp_path, timeouts=Timeouts(suspend_ack=5, suspend_grace=10 ** 6))
    assert SlurmExecutor.signal_lead(launch) == 65535


# ---------------------------------------------------------------------- alive, kill, signal, find
@pytest.mark.parametrize("state,alive", [
    ("PENDING", True), ("RUNNING", True), ("CONFIGURING", True), ("COMPLETING", True), ("REQUEUED", True),
    ("SUSPENDED", True), ("REQUEUE_HOLD", True), ("COMPLETED", False), ("FAILED", False), ("CANCELLED", False),
    ("TIMEOUT", False), ("NODE_FAIL", False), ("OUT_OF_MEMORY", False),
])
def test_alive_follows_the_job_state(fake, state, alive):
    fake.on("squeue", out=f"{state}\n")
    assert SlurmExecutor().alive("17") is alive
    assert fake.argv("squeue") == ["-h", "-j", "17", "--states=all", "-o", "%T"]


def test_a_job_slurm_forgot_is_not_alive(fake):
    fake.on("squeue", out="", match="-j 5 ")
    fake.on("squeue", err="slurm_load_jobs error: Invalid job id specified\n", rc=1)
    ex = SlurmExecutor()
    assert ex.alive("5") is False and ex.state("5") is None
    assert ex.alive("6") is False


def test_alive_does_not_guess_when_slurm_cannot_answer(fake):
    fake.on("squeue", err="slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n", rc=1)
    with pytest.raises(SlurmError, match="Unable to contact slurm controller"):
        SlurmExecutor().alive("5")
    fake.rules.clear()
    fake.on("squeue", out="RUNNING 12\n")
    with pytest.raises(SlurmError, match="unexpected state"):
        SlurmExecutor().alive("5")


@pytest.mark.parametrize("handle", ["", "12; rm -rf /", "-1", "abc"])
def test_handles_are_job_ids(fake, handle):
    ex = SlurmExecutor()
    for call in (ex.alive, ex.kill, ex.signal):
        with pytest.raises(ValueError, match="not a Slurm job id"):
            call(handle)
    assert fake.calls() == []


def test_kill_cancels_and_tolerates_a_job_already_gone(fake):
    ex = SlurmExecutor()
    ex.kill("31")
    assert fake.argv("scancel") == ["31"]
    fake.on("scancel", err="scancel: error: Kill job error on job id 31: Job/step already completing or completed\n",
            rc=1, match="31")
    fake.on("scancel", err="scancel: error: Kill job error on job id 32: Invalid job id specified\n", rc=1,
            match="32")
    fake.on("scancel", err="scancel: error: Kill job error on job id 33: Access/permission denied\n", rc=1)
    ex.kill("31")
    ex.kill("32")
    with pytest.raises(SlurmError, match="permission denied"):
        ex.kill("33")


def test_signal_reaches_only_the_batch_script(fake):
    ex = SlurmExecutor()
    ex.signal("8")
    assert fake.argv("scancel") == ["--signal=USR1", "--batch", "8"]
    ex.signal("8", "TERM")
    assert fake.argv("scancel") == ["--signal=TERM", "--batch", "8"]
    with pytest.raises(ValueError, match="bad signal"):
        ex.signal("8", "USR1 --user=root")


def test_find_takes_the_newest_job_of_this_attempt(fake, tmp_path):
    mine, other = tmp_path / "home" / "tasks" / "3", tmp_path / "other" / "tasks" / "3"
    fake.on("squeue", out=f"101|{other}\n99|{mine}\n104|{mine}\n")
    ex = SlurmExecutor()
    assert ex.find(3, str(mine)) == "104"
    assert fake.argv("squeue") == ["-h", "--states=all", "--name", "fireflyer-3", "-o", "%i|%k"]
    assert ex.find(3, str(tmp_path / "nowhere")) is None
    assert ex.find(3) == "104"  # no directory given: any job of that name


def test_find_when_slurm_has_none_or_prints_garbage(fake):
    fake.on("squeue", out="", match="fireflyer-1 ")
    fake.on("squeue", out="not-a-job|x\n")
    ex = SlurmExecutor()
    assert ex.find(1) is None
    with pytest.raises(SlurmError, match="unexpected job id"):
        ex.find(2)


# ---------------------------------------------------------------------- nodes
def test_nodes_from_sinfo(fake):
    fake.on("sinfo", out=textwrap.dedent("""\
        n1|idle|low*|(null)
        n1|idle|high|(null)
        n2|allocated|low*|zone=b,fast
        n3|drained|low*|zone:b
        n4|draining|low*|(null)
        n5|down*|low*|(null)
        n6|idle*|low*|(null)
        n7|mixed-|low*|(null)
        n8|fail|low*|(null)
        n9|drained*|low*|(null)
        n10|completing|low*|(null)
        n11|maint|low*|(null)
    """))
    nodes = {n.name: n for n in slurm.slurm_nodes()}
    assert fake.argv("sinfo") == ["-N", "-h", "-o", "%N|%T|%P|%f"]
    assert nodes["n1"] == Node("n1", "zone0", healthy=True, drained=False)
    assert nodes["n2"] == Node("n2", "b", healthy=True, drained=False)
    assert nodes["n3"] == Node("n3", "b", healthy=True, drained=True)
    assert nodes["n4"].drained and not nodes["n4"].usable
    for bad in ("n5", "n6", "n8", "n11"):
        assert not nodes[bad].healthy and not nodes[bad].drained, bad
    assert nodes["n7"].usable and nodes["n10"].usable
    assert nodes["n9"].drained and not nodes["n9"].healthy
    assert [n.name for n in slurm.slurm_nodes()] == sorted(nodes)


def test_nodes_of_one_partition(fake):
    fake.on("sinfo", out="n1|idle|high|(null)\n")
    assert slurm.slurm_nodes("high") == [Node("n1")]
    assert fake.argv("sinfo")[-2:] == ["-p", "high"]


@pytest.mark.parametrize("out,match", [
    ("n1 idle low\n", "unexpected line"),
    ("|idle|low|x\n", "unexpected line"),
    ("n1|idle|low|(null)\nn1|down|high|(null)\n", "twice, differently"),
])
def test_garbage_from_sinfo_is_an_error(fake, out, match):
    fake.on("sinfo", out=out)
    with pytest.raises(SlurmError, match=match):
        slurm.slurm_nodes()


def test_drain_and_undrain(fake):
    slurm.drain("n2", "failed validation: gemm")
    assert fake.argv("scontrol") == ["update", "nodename=n2", "state=drain", "reason=failed validation: gemm"]
    slurm.undrain("n2")
    assert fake.argv("scontrol") == ["update", "nodename=n2", "state=resume"]
    fake.on("scontrol", err="slurm_update error: Invalid node state specified\n", rc=1, match="n2")
    fake.on("scontrol", err="slurm_update error: Invalid node name specified\n", rc=1)
    slurm.undrain("n2")  # not drained: nothing to do
    with pytest.raises(SlurmError, match="Invalid node name"):
        slurm.drain("nosuch", "x")
    for bad in ("", "n1 n2", "n1,n2", "a=b"):
        with pytest.raises(ValueError, match="bad node name"):
            slurm.drain(bad, "x")


# ---------------------------------------------------------------------- inside the job
def test_srun_starts_every_rank_with_the_task_env(fake, tmp_path, monkeypatch):
    fake.on("scontrol", out="n1\nn2\n", match="show hostnames")
    fake.on("scontrol", out="NodeName=n1 Arch=x86_64 NodeAddr=10.0.0.7 NodeHostName=n1 State=ALLOCATED\n",
            match="show node n1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "16")
    launch, adir = make_launch(tmp_path)
    procs = starters.srun_ranks(launch, adir)
    assert [label for label, _ in procs] == ["srun"]
    assert procs[0][1].wait(timeout=30) == 0
    call = fake.calls("srun")[-1]
    argv = call["argv"]
    assert option(argv, "--nodes") == "2" and option(argv, "--ntasks") == "8"
    assert option(argv, "--ntasks-per-node") == "4" and option(argv, "--cpus-per-task") == "4"
    assert "--kill-on-bad-exit=1" in argv
    tail = argv[argv.index(sys.executable):]
    assert tail == [sys.executable, "-m", "fireflyer.platform.attempt.rank", str(adir.root), "--", "python", "train.py"]
    env = call["env"]
    assert env["MASTER_ADDR"] == "10.0.0.7" and env["MASTER_PORT"] == "29511"
    assert env["WORLD_SIZE"] == "8" and env["LOCAL_WORLD_SIZE"] == "4"
    assert env["FIREFLYER_TASK_DIR"] == str(adir.root)
    assert fake.argv("scontrol") == ["show", "node", "n1", "-o"]


def test_srun_outside_an_allocation_uses_the_launch_nodes(fake, tmp_path, monkeypatch):
    fake.on("scontrol", err="Node nX not found\n", rc=1)
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.delenv("SLURM_CPUS_ON_NODE", raising=False)
    launch, adir = make_launch(tmp_path, nodes=("nX",), ranks_per_node=1)
    _, proc = starters.srun_ranks(launch, adir)[0]
    assert proc.wait(timeout=30) == 0
    call = fake.calls("srun")[-1]
    assert call["env"]["MASTER_ADDR"] == "nX"  # no NodeAddr known: the name
    assert "--cpus-per-task" not in call["argv"]


def test_node_addr_falls_back_to_the_name(fake):
    fake.on("scontrol", out="NodeName=n1 NodeAddr=(null) State=IDLE\n")
    assert slurm.node_addr("n1") == "n1"
