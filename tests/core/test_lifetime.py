"""No process outlives the command that started it (fireflyer.lifetime), with real processes.

The marks and their sweep, the parent-death signal through ``python -m fireflyer.lifetime``,
stop signals in a starter (an ignored one stays ignored), the hard bound of a rank's grace,
``run_local`` killed outright, and the test harness's ranks when the test process is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from fireflyer import lifetime
from fireflyer.testing.waiting import wait_until

pytestmark = pytest.mark.multiproc


def gone(mark: str, within: float) -> list[int]:
    """The processes still under ``mark`` after waiting up to ``within`` seconds for them to go."""
    deadline = time.monotonic() + within
    while lifetime.marked(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    return lifetime.marked(mark)


def python(code: str, mark: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, lifetime.MARK: mark},
                            stdin=subprocess.DEVNULL, **kw)


def test_marks_nest_and_a_sweep_kills_what_is_under_its_mark_only():
    outer = lifetime.child_mark()
    inner = lifetime.child_mark({lifetime.MARK: outer})
    assert inner.startswith(outer + "/") and lifetime.is_under(inner, outer)
    assert not lifetime.is_under(outer, inner) and not lifetime.is_under(outer + "x", outer)
    keep = python("import time; time.sleep(60)", outer)
    sweep_me = python("import time; time.sleep(60)", inner)
    try:
        wait_until(lambda: len(lifetime.marked(outer)) == 2)
        assert lifetime.marked(inner) == [sweep_me.pid]
        assert lifetime.sweep(inner) == [sweep_me.pid]
        assert sweep_me.wait(timeout=10) == -signal.SIGKILL
        assert keep.poll() is None, "a process of the outer run is not the inner run's to kill"
    finally:
        keep.kill()
        keep.wait()


def test_a_tied_child_dies_with_its_parent_killed_outright():
    mark = lifetime.child_mark()
    # the parent starts a child through python -m fireflyer.lifetime, then is SIGKILLed: it runs no code after that
    parent = python("""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-m", "fireflyer.lifetime", "-c", "import time; time.sleep(120)"])
        time.sleep(120)
    """, mark)
    wait_until(lambda: len(lifetime.marked(mark)) == 2)
    parent.kill()
    parent.wait()
    assert gone(mark, 5) == []


def test_tied_to_me_makes_popen_children_follow_with_the_signal_asked_for():
    mark = lifetime.child_mark()
    parent = python("""
        import signal, subprocess, sys, time
        from fireflyer import lifetime
        code = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); time.sleep(120)"
        child = subprocess.Popen([sys.executable, "-c", code], preexec_fn=lifetime.tied_to_me(signal.SIGTERM))
        print(child.pid, flush=True)
        time.sleep(120)
    """, mark, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    wait_until(lambda: child in lifetime.marked(mark))
    parent.kill()
    parent.wait()
    assert gone(mark, 5) == []


def test_the_guard_refuses_an_empty_target():
    done = subprocess.run([sys.executable, "-m", "fireflyer.lifetime"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage" in done.stderr


def test_stop_signals_raise_once_and_an_ignored_signal_stays_ignored():
    code = """
        import os, signal, sys, time
        from fireflyer import lifetime
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts a command
        with lifetime.stop_signals() as stops:
            try:
                os.kill(os.getpid(), signal.SIGHUP)  # ignored: nothing happens
                time.sleep(0.2)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
                print("not stopped")
            except lifetime.Stopped as exc:
                os.kill(os.getpid(), signal.SIGINT)  # a second one only counts
                time.sleep(0.2)
                print(exc, exc.exit_code, stops.hurry)
        print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, signal.getsignal(signal.SIGHUP) == signal.SIG_IGN)
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert done.stdout.split("\n")[:2] == ["stopped by SIGTERM 143 True", "True True"], done.stdout + done.stderr


def test_a_rank_stuck_past_its_grace_exits_anyway():
    # graceful(): the stop raises, and past the grace the process exits even though it swallowed the stop
    code = """
        import os, signal, time
        from fireflyer import lifetime
        lifetime.graceful(1.0)
        try:
            print("ready", flush=True)  # inside the try: the stop may land the moment the test reads this
            time.sleep(60)
        except lifetime.Stopped:
            pass
        while True:
            time.sleep(1)  # stuck: only the watchdog ends this
    """
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 1
    assert time.monotonic() - t0 < 15
    assert "Timeout" in p.stderr.read(), "the watchdog says where the process was stuck"


def test_grace_from_the_environment_is_range_checked():
    assert lifetime.grace_from_env({lifetime.GRACE: "3.5"}) == 3.5
    for bad in ("", "abc", "-1", "1e9", "nan"):
        assert lifetime.grace_from_env({lifetime.GRACE: bad}) == lifetime.DEFAULT_GRACE


JOB = """
import time
time.sleep(120)
"""


def test_run_local_killed_outright_takes_its_agents_and_ranks_along(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    mark = lifetime.child_mark()
    launcher = python(f"""
        from fireflyer.launch import LocalJob, run_local
        run_local(LocalJob(target=[{str(script)!r}], nodes=2, ranks_per_node=2, quiet=True, grace=2))
    """, mark)
    wait_until(lambda: len(lifetime.marked(mark)) >= 7, timeout=120)  # the launcher, 2 agents, 4 ranks
    launcher.kill()
    launcher.wait()
    assert gone(mark, 2 + 5) == []


def test_run_local_stopped_stops_everything_and_says_how(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    mark = lifetime.child_mark()
    launcher = python(f"""
        import sys
        from fireflyer import lifetime
        from fireflyer.launch import LocalJob, run_local
        try:
            run_local(LocalJob(target=[{str(script)!r}], nodes=2, ranks_per_node=1, quiet=True, grace=2))
        except lifetime.Stopped as exc:
            print("RAISED", exc, flush=True)
            sys.exit(exc.exit_code)
    """, mark, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: len(lifetime.marked(mark)) >= 5, timeout=120)
    t0 = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 143
    assert time.monotonic() - t0 < 2 + 5
    assert "RAISED stopped by SIGTERM" in launcher.stdout.read()
    assert "its ranks have 2 s to finish a checkpoint in flight" in launcher.stderr.read()
    assert gone(mark, 1) == []


def test_the_harness_ranks_die_with_the_test_process(tmp_path):
    mark = lifetime.child_mark()
    owner = python("""
        import time
        from fireflyer.testing.cluster import LocalCluster
        cluster = LocalCluster([2], env={"FIREFLYER_TEST_COMM": "0"})
        print("up", flush=True)
        time.sleep(120)
    """, mark, stdout=subprocess.PIPE, text=True)
    assert owner.stdout.readline().strip() == "up"
    assert len(lifetime.marked(mark)) >= 3  # the owner, its fork server, and the ranks the fork server forked
    owner.kill()
    owner.wait()
    assert gone(mark, 10) == []
