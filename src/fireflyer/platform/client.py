"""The job side of the platform: what a task's own code calls (HAI's ``hfai.client``).

A task is told to suspend when the scheduler needs its nodes (a higher priority, a
drained node, its user). The protocol, with HAI's timeouts:

1. :func:`receive_suspend_command` turns True. The job must notice within the
   platform's ``suspend_ack`` (5 s by default), so call it every step: it is one
   ``stat``. The first True acknowledges the command.
2. The job saves a checkpoint and calls :func:`go_suspend`, which never returns: the
   platform stops the task and queues the next attempt of its chain in the chain's
   old place. A job that acknowledged but takes longer than ``suspend_grace`` is
   stopped anyway, and one that never acknowledges is stopped after ``suspend_ack``.
3. The next attempt runs the same command from the start; the job finds its
   checkpoint and continues. :func:`get_whole_life_state` returns what the previous
   attempt left with :func:`set_whole_life_state` (an int kept for the chain's life).

:func:`suspend_if_requested` does all three for a data-parallel job with a
:class:`~fireflyer.checkpoint.CheckpointManager`: every rank calls it each step; rank
0's answer is shared, so all ranks save the same step and stop together.

Outside the platform nothing is ever requested, unless ``FIREFLYER_SIMULATE_SUSPEND=S``
is set: then the command arrives S seconds after import and :func:`go_suspend` exits
the process (HAI's local simulation). This module imports no torch until it must.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Callable, NoReturn

from fireflyer.fsutil import atomic_write
from fireflyer.platform import env
from fireflyer.platform.layout import AttemptDir
from fireflyer.errors import UsageError, UserError

SIMULATE_ENV = env.SIMULATE_SUSPEND
_IMPORTED_AT = time.monotonic()
_acknowledged = False


def _attempt() -> AttemptDir | None:
    root = os.environ.get(env.TASK_DIR)
    return AttemptDir(root) if root else None


def _simulated_after() -> float | None:
    raw = os.environ.get(SIMULATE_ENV)
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise UserError(f"{SIMULATE_ENV}={raw!r} must be a number of seconds") from None


def is_managed() -> bool:
    """Whether this process is a rank of a platform task."""
    return _attempt() is not None


def _int_env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def task_id() -> int | None:
    """This attempt's task id (None outside the platform)."""
    return _int_env(env.TASK_ID, 0) or None


def chain_id() -> int | None:
    """The chain's id: the first attempt's id, the one users refer to."""
    return _int_env(env.CHAIN_ID, 0) or None


def attempt() -> int:
    """0 for a chain's first run, one more for each resume or restart."""
    return _int_env(env.ATTEMPT, 0)


def rank() -> int:
    return _int_env("RANK", 0)


def world_size() -> int:
    """Ranks in the task (torchrun's ``WORLD_SIZE``)."""
    return _int_env("WORLD_SIZE", 1)


def node_rank() -> int:
    return _int_env("GROUP_RANK", _int_env("NODE_RANK", 0))


def nnodes() -> int:
    return _int_env(env.NNODES, 1)


def master_addr() -> str:
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


def master_port() -> int:
    return _int_env("MASTER_PORT", 29500)


def receive_suspend_command() -> bool:
    """True once the platform wants this task to suspend. Cheap: call it every step."""
    global _acknowledged
    adir = _attempt()
    if adir is None:
        after = _simulated_after()
        return after is not None and time.monotonic() - _IMPORTED_AT >= after
    if not adir.has_flag("suspend"):
        return False
    if not _acknowledged:
        adir.raise_flag("received", f"rank {rank()} pid {os.getpid()} {time.time():.3f}")
        _acknowledged = True
    return True


def go_suspend(*, timeout: float = 60.0) -> NoReturn:
    """Tell the platform the task's state is saved; the platform then stops it. Never returns.

    If the platform has not stopped the process within ``timeout`` seconds (its
    supervisor is gone), the process exits by itself rather than wait forever.
    """
    adir = _attempt()
    if adir is None:
        if _simulated_after() is not None:
            print("fireflyer: simulated suspend: exiting", file=sys.stderr, flush=True)
            sys.exit(0)
        raise UsageError("go_suspend() outside a platform task: nothing would stop or resume this process "
                           f"(set {SIMULATE_ENV}=SECONDS to try the protocol locally)")
    try:  # the state is saved: the platform's SIGTERM ends this process as it is, with nothing left to finish
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # not the main thread: whatever handler the job set stays
        pass
    # What the job printed goes out before the flag: the platform may stop the process the moment it sees it.
    sys.stdout.flush()
    sys.stderr.flush()
    adir.raise_flag("can_suspend", f"rank {rank()} pid {os.getpid()} {time.time():.3f}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.1)
    os._exit(0)


def get_whole_life_state() -> int:
    """The int the chain's previous attempt left (0 on a chain's first run)."""
    adir = _attempt()
    if adir is not None:
        try:
            return int(adir.flag("whole_life_state").read_text().strip())
        except (FileNotFoundError, ValueError):
            pass
    return _int_env(env.WHOLE_LIFE_STATE, 0)


def set_whole_life_state(state: int) -> bool:
    """Keep ``state`` for the chain's next attempts; False when it was already that value."""
    if not isinstance(state, int) or isinstance(state, bool) or not -2**31 <= state < 2**31:
        raise UserError(f"a whole-life state is a 32-bit int, got {state!r}")
    if get_whole_life_state() == state:
        return False
    adir = _attempt()
    if adir is None:
        os.environ[env.WHOLE_LIFE_STATE] = str(state)
        return True
    path = adir.flag("whole_life_state")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(str(path), lambda f: f.write(str(state).encode()), tmp_name=f".whole_life_state.{os.getpid()}")
    return True


def suspend_if_requested(manager: Any, step: int, state: Callable[[], Any] | None, *, group: Any = None,
                         announce: Callable[[], None] | None = None) -> bool:
    """If a suspend was requested: save ``state()`` as ``step``, wait until it is committed, go_suspend.

    A collective: every rank of ``group`` (default: the whole job, when torch.distributed
    is initialised) calls it at the same step. ``state=None`` means ``step`` was just
    handed to the manager already; only its commit is waited for. ``announce``, where given,
    is called on every rank once the ranks have agreed to suspend and before the save (the
    place for a log line: the decision is this call's, so a line printed from an earlier look
    at the flag could miss a request that arrives in between). Returns False when nothing was
    requested; otherwise it does not return.
    """
    wanted = receive_suspend_command() if rank() == 0 or not _dist_ready() else False
    if _dist_ready():
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(wanted)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        wanted = bool(flag.item())
    if not wanted:
        return False
    if announce is not None:
        announce()
    if state is not None:
        manager.save(step, state(), blocking=True)
    manager.wait()
    if _dist_ready():
        import torch.distributed as dist

        dist.barrier(group=group)
    go_suspend()


def _dist_ready() -> bool:
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
