"""HFReduceWork on its own: what each of torch's Work methods reports for a success, a failure and a timeout.

The communicator is a stand-in here (the process boundary); the multi-process tests in
tests/hfreduce/test_torch_faults.py drive the real one through torch.distributed.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from fireflyer.hfreduce.errors import CollectiveTimeout, PeerFailure
from fireflyer.hfreduce.backend.work import HFReduceWork, seconds


class FakeComm:
    def __init__(self) -> None:
        self.timed_out: list[tuple[int, str, float]] = []
        self.engine_alive = True

    def time_out(self, seq: int, desc: str, limit: float):
        self.timed_out.append((seq, desc, limit))
        return CollectiveTimeout(f"{desc} (#{seq}) did not finish within {limit:g}s: it was waiting for rank 3")

    def alive(self) -> bool:
        return self.engine_alive


def _work(futures, result=None, seqs=(7,)):
    return HFReduceWork(FakeComm(), futures, result if result is not None else [torch.ones(2)], list(seqs), "all_reduce")


def test_success_reports_success_everywhere():
    out = [torch.full((2,), 4.0)]
    fut = torch.futures.Future()
    fut.set_result(None)
    work = _work([fut], out)
    assert work.wait() is True
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert work.result() is out
    assert work.get_future().wait() is out


def test_a_collective_that_failed_before_its_work_was_made_raises_everywhere():
    """A call its caller drove to the end gets a Work at once; one that failed on the way must still raise."""
    fut = torch.futures.Future()
    fut.set_exception(PeerFailure("rank 3 (node 1, local rank 1), pid 42, died"))
    work = _work([fut])
    with pytest.raises(PeerFailure, match="rank 3"):
        work.wait()
    with pytest.raises(Exception, match="rank 3"):
        work.get_future().wait()
    assert work.is_completed() and not work.is_success()
    assert isinstance(work.exception(), PeerFailure)


def test_a_failure_raises_the_engines_class_from_wait_and_reports_it():
    fut = torch.futures.Future()
    work = _work([fut])
    assert not work.is_completed() and not work.is_success()
    fut.set_exception(PeerFailure("rank 3 (node 1, local rank 1), pid 42, died"))
    for _ in range(2):  # every wait raises, each time a fresh exception of the same class
        with pytest.raises(PeerFailure, match=r"rank 3 \(node 1"):
            work.wait()
    assert work.is_completed() and not work.is_success()
    exc = work.exception()
    assert isinstance(exc, PeerFailure) and "rank 3" in str(exc)


def test_the_future_carries_the_error_to_waiters_and_callbacks():
    """(That C++ consumers see a real error, not an exception object as a value, is what the DDP
    cells of the fault matrix check: DDP's reducer crashed on the latter.)"""
    fut = torch.futures.Future()
    work = _work([fut])
    fut.set_exception(PeerFailure("rank 1 died"))
    with pytest.raises(RuntimeError, match="PeerFailure: rank 1 died"):
        work.get_future().wait()
    # a chained callback that reads the value sees the error too (as DDP's C++ reducer does)
    chained = work.get_future().then(lambda f: f.value())
    with pytest.raises(RuntimeError, match="rank 1 died"):
        chained.wait()


def test_the_first_error_of_a_coalesced_batch_wins():
    a, b = torch.futures.Future(), torch.futures.Future()
    work = _work([a, b], seqs=(3, 4))
    a.set_result(None)
    b.set_exception(CollectiveTimeout("allreduce (#4) timed out waiting for rank 2"))
    with pytest.raises(CollectiveTimeout, match="rank 2"):
        work.wait()


def test_wait_with_a_timeout_fails_the_group_through_the_communicator():
    fut = torch.futures.Future()
    work = _work([fut], seqs=(11,))
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="waiting for rank 3"):
        work.wait(timeout=timedelta(milliseconds=200))
    assert time.monotonic() - t0 >= 0.2
    assert work._comm.timed_out == [(11, "all_reduce", 0.2)]


def test_wait_with_a_timeout_returns_when_the_collective_finishes_in_time():
    fut = torch.futures.Future()
    work = _work([fut])
    threading.Timer(0.05, lambda: fut.set_result(None)).start()
    assert work.wait(timeout=timedelta(seconds=10)) is True
    assert work._comm.timed_out == []


def test_a_dead_engine_thread_cannot_leave_a_caller_waiting_forever():
    fut = torch.futures.Future()
    work = _work([fut])
    work._comm.engine_alive = False
    with pytest.raises(Exception, match="engine thread stopped"):
        work.wait()


def test_a_barrier_with_no_collective_is_complete_at_once():
    work = _work([], result=[], seqs=())
    assert work.wait() and work.is_success()


@pytest.mark.parametrize("value,expected", [
    (None, None), (timedelta(0), None), (timedelta(milliseconds=-1), None),  # torch's "no timeout" and "unset"
    (timedelta(seconds=2), 2.0), (1.5, 1.5), (3, 3.0),
])
def test_torch_timeouts_as_seconds(value, expected):
    assert seconds(value) == expected


def test_a_timeout_of_the_wrong_type_is_refused():
    with pytest.raises(TypeError, match="timedelta"):
        seconds("10s")
