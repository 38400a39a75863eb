"""The Work a ``"hfreduce"`` collective returns to torch.distributed: it tells the truth about failures.

torch calls a backend's Work from Python (``dist.all_reduce`` calls ``wait()``,
FSDP2 keeps async Works and waits on them) and from C++ (DDP's reducer takes
``get_future()``, functional collectives call ``wait()`` through the trampoline).
Every one of those doors must see the collective's error: ``wait()`` raises it,
``get_future()`` carries it, and ``exception()``, ``is_success()`` and
``is_completed()`` report it. A ``wait(timeout)`` that expires fails the whole
group with a :class:`~fireflyer.hfreduce.errors.CollectiveTimeout` naming the
ranks the collective was waiting for, because a collective abandoned half way
leaves the ranks out of step.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fireflyer.hfreduce.errors import HFReduceError, fresh
from fireflyer.errors import UserTypeError

if TYPE_CHECKING:
    from fireflyer.hfreduce.engine.communicator import Communicator

_POLL = 1.0  # seconds between checks that the engine is alive while a caller waits without a deadline


def seconds(timeout: Any) -> float | None:
    """A torch timeout (timedelta, or seconds) as positive seconds; None for torch's "unset" (zero or negative)."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise UserTypeError(f"a timeout must be a datetime.timedelta or seconds, got {type(timeout).__name__}")
    return value if value > 0 else None


_DONE = threading.Event()
_DONE.set()


def _succeeded(future: torch.futures.Future) -> bool:
    """Whether ``future`` has completed without an error."""
    if not future.done():
        return False
    try:
        future.value()
    except BaseException:  # noqa: BLE001 - its error: the Work made by ``then`` below carries it
        return False
    return True


class HFReduceWork(dist.Work):
    """One collective (or a coalesced batch) in flight on this rank."""

    def __init__(self, comm: "Communicator", futures: list[torch.futures.Future], result: list[torch.Tensor],
                 seqs: list[int], what: str) -> None:
        super().__init__()
        self._comm = comm
        self._result = result
        self._seqs = seqs
        self._what = what
        self._error: BaseException | None = None
        if len(futures) == 1 and _succeeded(futures[0]):  # a call its caller drove to the end: nothing to wait on
            self._done = _DONE
            self._future = torch.futures.Future()
            self._future.set_result(result)
            return
        self._done = threading.Event()
        # The future torch sees must carry a C++-level error for C++ consumers (DDP's reducer
        # reads its value and would misread an exception object as a result), so it is made
        # by ``then``, whose callback raises: only then is the error a real one.
        self._batch = len(futures) > 1  # the source is then collect_all's: a list of their futures
        if not futures:
            source = torch.futures.Future()
            source.set_result(None)
        elif len(futures) == 1:
            source = futures[0]
        else:
            source = torch.futures.collect_all(futures)
        self._future: torch.futures.Future = source.then(self._unwrap)
        self._future.add_done_callback(lambda _: self._done.set())

    # -- completion (engine threads) --------------------------------------------------
    def _unwrap(self, fut: torch.futures.Future) -> list[torch.Tensor]:
        try:
            value = fut.wait()  # one collective's error, or (several) the list of their futures
            for one in value if self._batch else ():
                one.wait()  # the first error wins
        except BaseException as exc:  # noqa: BLE001 - the collective's own error
            self._error = exc
            raise fresh(exc) from None
        return self._result

    # -- torch's Work API --------------------------------------------------------------
    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until the collective finished; raise its error. ``timeout`` bounds the wait and, if it
        expires, fails the group with CollectiveTimeout (as NCCL aborts its communicator)."""
        limit = seconds(timeout)
        if not self._done.is_set():
            if limit is not None:
                if not self._done.wait(limit):
                    error = self._comm.time_out(self._seqs[0] if self._seqs else -1, self._what, limit)
                    self._done.wait(_POLL)  # the engine settles the collective with the error at once
                    raise fresh(self._error or error)
            else:
                # The engine's own deadline settles every collective; only a dead engine thread could not.
                while not self._done.wait(_POLL):
                    if not self._comm.alive():
                        raise HFReduceError(f"hfreduce's engine thread stopped while {self._what} was in flight")
        if self._error is not None:
            raise fresh(self._error)
        return True

    def synchronize(self) -> None:
        self.wait()

    def block_current_stream(self) -> None:
        # Results are in place (CUDA copies synchronised) when the engine completes a collective.
        self.wait()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return fresh(self._error) if self._error is not None else None

    def get_future(self) -> torch.futures.Future:
        """Completes with the output tensors, or carries the collective's error."""
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._result

    def source_rank(self) -> int:
        raise NotImplementedError("hfreduce has no receive-from-any-source, so its Work has no source rank")

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "completed" if self._done.is_set() else "pending"
        return f"HFReduceWork({self._what}, #{','.join(map(str, self._seqs))}, {state})"


class DoneWork(dist.Work):
    """A collective that already succeeded in the caller's thread (``Communicator.run_now``): nothing to wait for."""

    def __init__(self, result: list[torch.Tensor], seq: int, what: str) -> None:
        super().__init__()
        self._result = result
        self._seq = seq
        self._what = what
        self._future: torch.futures.Future | None = None

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        seconds(timeout)  # still refuses a timeout of the wrong type
        return True

    def synchronize(self) -> None:
        pass

    def block_current_stream(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = torch.futures.Future()
            self._future.set_result(self._result)
        return self._future

    def result(self) -> list[torch.Tensor]:
        return self._result

    def source_rank(self) -> int:
        raise NotImplementedError("hfreduce has no receive-from-any-source, so its Work has no source rank")

    def __repr__(self) -> str:
        return f"HFReduceWork({self._what}, #{self._seq}, completed)"
