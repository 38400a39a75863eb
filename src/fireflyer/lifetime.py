"""Processes that end when the command that started them ends, however it ends.

fireflyer starts processes: torchrun agents and their ranks (``fireflyer train``, the
benchmarks, ``fireflyer hfreduce demo``), a platform task's ranks, the test harness's ranks.
None of them may outlive its starter. Three things tie them to it:

1. **A mark.** Every process a starter launches carries ``FIREFLYER_RUN_MARK`` in its
   environment: a path of random tokens, the starter's own mark (if it has one) with a new
   token below it (``3f9a…/c01d…``). Whatever those processes start inherits it. On every
   way out, the starter's last act is :func:`sweep`, which finds each live process under its
   mark through ``/proc/PID/environ`` and kills it. A test finds a run's processes the same
   way (:func:`marked`), by the mark and not by a name.
2. **The parent-death signal** (Linux ``PR_SET_PDEATHSIG``). A starter killed with SIGKILL
   runs no code, so it cannot sweep: its children asked the kernel beforehand to be signalled
   when their parent dies (:func:`die_with_parent`, or :func:`tied_to_me` as a ``Popen``
   ``preexec_fn``). A torchrun agent gets SIGTERM, which it forwards to its ranks as it does
   for any stop, with its shutdown timeout; a rank gets SIGKILL, since its agent is gone only
   after its own shutdown or when it was killed. A rank started through ``python -m
   fireflyer.lifetime TARGET...`` sets this, then replaces itself with ``python TARGET...``
   (the setting survives ``execve``). Process groups cannot do this job: torchrun starts
   every rank in a session of its own, and nothing signals a group when its leader is killed.
3. **Stops forwarded with a grace.** :func:`stop_signals` turns SIGINT, SIGTERM and SIGHUP in
   a starter into :class:`Stopped`, so the starter can stop its children in order (SIGTERM,
   a bounded grace, SIGKILL, the sweep) rather than vanish; a signal the starter was started
   with ignored (``nohup``, ``&`` in a script) stays ignored. In a rank, :func:`graceful`
   does the same with a hard bound: past the grace the process exits even when its main
   thread is stuck in native code (``faulthandler``'s watchdog thread, which needs no GIL).

The grace a starter gives is handed to its ranks in ``FIREFLYER_STOP_GRACE`` (seconds).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import secrets
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

MARK = "FIREFLYER_RUN_MARK"
"""The variable that marks every process of one run (a path of tokens, one per starter)."""
GRACE = "FIREFLYER_STOP_GRACE"
"""Seconds a stopped rank has to finish what is in flight (a checkpoint save) before it is killed."""
DEFAULT_GRACE = 10.0
"""The grace where nobody set one: a small model's checkpoint commits well within it."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What a terminal, a batch system, a container runtime or a supervisor sends to stop a command."""

_PR_SET_PDEATHSIG = 1


class Stopped(BaseException):
    """This process was asked to stop (SIGINT, SIGTERM or SIGHUP).

    A ``BaseException``, as ``KeyboardInterrupt`` is, so that ``except Exception`` handlers on
    the way up do not swallow it; ``fireflyer``'s command line turns it into one line and the
    shell's exit code for the signal (128 + its number).
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal_name(signum)}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# -- marks ---------------------------------------------------------------------------------

def child_mark(env: dict[str, str] | None = None) -> str:
    """A new mark for the processes this process is about to start: below its own, if it has one."""
    own = (os.environ if env is None else env).get(MARK, "")
    token = secrets.token_hex(8)
    return f"{own}/{token}" if own else token


def is_under(value: str, mark: str) -> bool:
    """Whether a process marked ``value`` belongs to the run marked ``mark`` (itself or below it)."""
    return bool(mark) and (value == mark or value.startswith(mark + "/"))


def _mark_of(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:  # gone, or not ours to read
        return None
    prefix = MARK.encode() + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix):].decode(errors="replace")
    return None


def marked(mark: str) -> list[int]:
    """The live processes of the run marked ``mark`` (this process excluded), read from ``/proc``."""
    if not mark or not os.path.isdir("/proc"):
        return []
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        value = _mark_of(int(name))
        if value is not None and is_under(value, mark) and _alive(int(name)):
            found.append(int(name))
    return sorted(found)


def _alive(pid: int) -> bool:
    """True unless ``pid`` is gone or a zombie (a zombie holds no memory, no file and no segment)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")


def sweep(mark: str, *, timeout: float = 5.0) -> list[int]:
    """SIGKILL every live process under ``mark`` until none is left or ``timeout`` passes; return those killed.

    Repeats, since a process may start another while it is being swept. What survives the
    timeout (a process in uninterruptible sleep) is left to the kernel; the caller is told
    through the return value only, as nothing more can be done from here.
    """
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        pids = marked(mark)
        if not pids:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                if pid not in killed:
                    killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        if time.monotonic() > deadline:
            return killed
        time.sleep(0.02)


# -- the parent-death signal ----------------------------------------------------------------

def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def die_with_parent(sig: int = signal.SIGKILL, *, parent: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; False where it cannot (not Linux).

    ``parent`` is the pid the parent had: if it is already gone (this process was reparented
    before the request took hold), ``sig`` is sent at once, as the kernel would have.
    """
    if _PRCTL is None:
        return False
    if _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def die_with(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to this process when process ``pid`` (not necessarily the parent) ends.

    For a process whose parent is not its owner: a rank forked by a fork server, which outlives
    the test process that owns the rank. A daemon thread waits on a pidfd (Linux 5.3+), which
    wakes the moment ``pid`` ends and cannot be fooled by a reused pid; elsewhere it polls. If
    ``pid`` is already gone, ``sig`` is sent at once.
    """
    def signal_me() -> None:
        os.kill(os.getpid(), sig)

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        signal_me()
        return
    except (AttributeError, OSError):  # no pidfd here: poll
        def poll() -> None:
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    signal_me()
                    return
                except PermissionError:
                    pass
                time.sleep(0.5)

        threading.Thread(target=poll, name=f"die-with-{pid}", daemon=True).start()
        return

    def wait() -> None:
        import select

        select.select([fd], [], [])  # readable once the process has ended
        signal_me()

    threading.Thread(target=wait, name=f"die-with-{pid}", daemon=True).start()


def tied_to_me(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``Popen(preexec_fn=...)`` that makes the child get ``sig`` when this process dies, even by SIGKILL."""
    me = os.getpid()

    def tie() -> None:
        die_with_parent(sig, parent=me)

    return tie


# -- stops ------------------------------------------------------------------------------------

class StopRequests:
    """The stop signals one :func:`stop_signals` block received: the first raised, the rest counted."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.armed = True
        """Whether the first signal raises; the starter disarms it before it cleans up, so nothing interrupts that."""

    @property
    def hurry(self) -> bool:
        """A second stop signal came: skip what is left of the grace."""
        return len(self.received) > 1


@contextmanager
def stop_signals() -> Iterator[StopRequests]:
    """Within the block, SIGINT, SIGTERM and SIGHUP raise :class:`Stopped` once; later ones only count.

    Signals this process inherited as ignored stay ignored. Outside the main thread (where
    Python cannot set handlers) the block changes nothing. The previous handlers come back
    when the block ends.
    """
    requests = StopRequests()
    if threading.current_thread() is not threading.main_thread():
        yield requests
        return

    def on_signal(signum: int, _frame: object) -> None:
        requests.received.append(signum)
        if len(requests.received) == 1 and requests.armed:
            raise Stopped(signum)

    previous = {}
    for sig in STOP_SIGNALS:
        old = signal.getsignal(sig)
        if old == signal.SIG_IGN:
            continue
        previous[sig] = old
        signal.signal(sig, on_signal)
    try:
        yield requests
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


@contextmanager
def owning() -> Iterator[StopRequests]:
    """A command that starts processes: within the block they carry a new mark, a stop signal raises
    :class:`Stopped`, and on the way out, however it goes, every process under the mark is killed."""
    previous = os.environ.get(MARK)
    mark = os.environ[MARK] = child_mark()
    try:
        with stop_signals() as stops:
            try:
                yield stops
            finally:
                stops.armed = False
                sweep(mark)
    finally:
        if previous is None:
            os.environ.pop(MARK, None)
        else:
            os.environ[MARK] = previous


def grace_from_env(env: dict[str, str] | None = None) -> float:
    """``FIREFLYER_STOP_GRACE`` as seconds (the default where unset or not a sane number)."""
    raw = (os.environ if env is None else env).get(GRACE, "")
    try:
        grace = float(raw)
    except ValueError:
        return DEFAULT_GRACE
    return grace if 0 <= grace <= 3600 else DEFAULT_GRACE


def graceful(grace: float | None = None) -> None:
    """In a rank: SIGINT, SIGTERM and SIGHUP raise :class:`Stopped`, and ``grace`` seconds later the process exits.

    The exception unwinds the rank (its ``finally`` blocks, a checkpoint in flight waited
    for); the exit past the grace holds even when the main thread never returns to Python
    (a watchdog thread of ``faulthandler``'s, which prints the stacks it was stuck in and
    calls ``_exit(1)``). Call it from the main thread.
    """
    grace = grace_from_env() if grace is None else grace

    def on_signal(signum: int, _frame: object) -> None:
        faulthandler.dump_traceback_later(max(grace, 0.1), exit=True)
        for sig in STOP_SIGNALS:  # one stop is enough: later signals no longer interrupt the unwinding
            if signal.getsignal(sig) is on_signal:
                signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)

    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) != signal.SIG_IGN:
            signal.signal(sig, on_signal)


def run_tied(target: list[str]) -> None:
    """``python -m fireflyer.lifetime TARGET...``: die with the parent (SIGKILL), then become ``python -u TARGET...``."""
    if not target:
        print("usage: python -m fireflyer.lifetime (-m MODULE | SCRIPT) [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    parent = os.getppid()
    if parent == 1:  # the parent died before this process could ask to follow it
        raise SystemExit(128 + signal.SIGKILL)
    die_with_parent(signal.SIGKILL, parent=parent)
    os.execv(sys.executable, [sys.executable, "-u", *target])


if __name__ == "__main__":
    run_tied(sys.argv[1:])
