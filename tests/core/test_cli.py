"""The fireflyer command: bad input gets one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest


def fireflyer(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fireflyer.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["nosuch"], "invalid choice"),
        (["bench", "nosuch"], "unknown benchmark part"),
        (["bench", "allreduce", "--dtypes", "fp64"], "fp64"),
        (["bench", "allreduce", "--max-bytes", "lots"], "lots"),
        (["hfreduce", "demo", "--nodes", "0"], "--nodes"),
        (["hfreduce", "demo", "--mib", "x"], "--mib"),
        (["hfreduce", "explode"], "invalid choice"),
        (["hfreduce", "trace", "/no/such/trace/dir"], "no such directory"),
        (["bench", "ddp", "--layouts", "2by2"], "NODESxRANKS"),
        (["bench", "fsdp", "--steps", "many"], "--steps"),
        (["bench", "pp", "--schedules", "zigzag"], "zigzag"),
        (["train", "--steps", "-3"], "steps"),
        (["demo", "no-such-config.toml"], "no-such-config.toml"),
    ],
)
def test_bad_input_is_one_line_and_non_zero(args, needle):
    done = fireflyer(*args)
    assert done.returncode != 0
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, done.stderr
    assert needle in lines[0] and "Traceback" not in done.stderr


def test_help_lists_the_subcommands():
    done = fireflyer("--help")
    assert done.returncode == 0
    for cmd in ("demo", "bench", "hfreduce"):
        assert cmd in done.stdout


def test_hfreduce_clean_reports_what_it_removed():
    done = fireflyer("hfreduce", "clean")
    assert done.returncode == 0, done.stderr
    assert "removed" in done.stdout and "stale arena" in done.stdout


def test_every_user_facing_error_derives_from_the_one_root():
    from fireflyer.checkpoint.errors import CheckpointError
    from fireflyer.errors import FireflyerError, UserError
    from fireflyer.hfreduce.errors import HFReduceError
    from fireflyer.launch import LaunchFailed
    from fireflyer.platform.accounts import AccountProblem
    from fireflyer.platform.scheduler.api import ApiError, Conflict, Forbidden, NotFound, Unavailable
    from fireflyer.platform.scheduler.pidlock import AlreadyRunning
    from fireflyer.platform.commands.remote import Unauthorized
    from fireflyer.platform.server.auth import UserProblem
    from fireflyer.platform.executors.slurm import SlurmError
    from fireflyer.platform.state.store import StoreUnavailable, UnknownTask
    from fireflyer.storage.errors import StorageError
    from fireflyer.validator.profiles import ProfileError

    errors = [CheckpointError, HFReduceError, LaunchFailed, AccountProblem, ApiError, Conflict, Forbidden, NotFound,
              Unavailable, AlreadyRunning, Unauthorized, UserProblem, SlurmError, StoreUnavailable, UnknownTask,
              StorageError, ProfileError, UserError]
    assert [e.__name__ for e in errors if not issubclass(e, FireflyerError)] == []
    # the standard bases they had stay, so every handler that caught them still does
    assert issubclass(SlurmError, RuntimeError) and issubclass(UnknownTask, LookupError)
    assert issubclass(AccountProblem, ValueError) and not issubclass(AccountProblem, UserError)


@pytest.mark.parametrize("args", [["hfreduce"], ["hfreduce", "demo"], ["hfreduce", "trace"]], ids=" ".join)
def test_hfreduce_help_is_plain_text(args):
    done = fireflyer(*args, "--help")
    assert done.returncode == 0, done.stderr
    assert "``" not in done.stdout and ":mod:`" not in done.stdout and ":func:`" not in done.stdout, done.stdout
    assert done.stdout.startswith("usage: fireflyer hfreduce")
