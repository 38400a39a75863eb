"""The engine in one process (world size 1): inline small collectives, ordering, bad input."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fireflyer.hfreduce import Communicator, HFReduceConfig
from fireflyer.hfreduce.engine.communicator import INLINE_BYTES


def _comm() -> Communicator:
    return Communicator(dist.HashStore(), 0, 1, config=HFReduceConfig(timeout=10))


def test_a_small_collective_on_an_idle_engine_is_done_when_submit_returns():
    with _comm() as comm:
        x = torch.arange(16, dtype=torch.float32)
        fut = comm.allreduce(x, "avg")
        assert fut.done()
        assert torch.equal(x, torch.arange(16, dtype=torch.float32))


def test_collectives_finish_in_submission_order_even_when_small_ones_could_run_inline():
    with _comm() as comm:
        order: list[str] = []
        big = torch.ones(8 * INLINE_BYTES)  # goes to the engine thread
        small = torch.ones(4)
        f_big = comm.allreduce(big)
        after_big = f_big.then(lambda f: order.append("big"))
        f_small = comm.allreduce(small)  # something is pending: it must queue behind the big one
        after_small = f_small.then(lambda f: order.append("small"))
        # Wait for the callbacks themselves: a future's waiters may wake before its callbacks have run.
        after_small.wait()
        after_big.wait()
        assert order == ["big", "small"]


def test_a_closed_communicator_fails_fast():
    comm = _comm()
    comm.close()
    fut = comm.allreduce(torch.ones(3))
    try:
        fut.wait()
        raised = None
    except Exception as exc:  # noqa: BLE001
        raised = exc
    assert raised is not None and "closed" in str(raised)


# ---- the job's secret: from the launcher's environment, never from the store when it can be
def _keys(store) -> dict[str, bool]:
    return {k: store.check([k]) for k in ("hfreduce/0/secret", "hfreduce/0/salt")}


def test_with_a_launcher_secret_the_store_never_holds_one(monkeypatch, caplog):
    import logging

    monkeypatch.setenv("FIREFLYER_JOB_SECRET", "x" * 64)
    store = dist.HashStore()
    with caplog.at_level(logging.WARNING, logger="fireflyer.hfreduce"):
        with Communicator(store, 0, 1, config=HFReduceConfig(timeout=10)) as comm:
            x = torch.ones(4)
            comm.allreduce(x).wait()
    assert _keys(store) == {"hfreduce/0/secret": False, "hfreduce/0/salt": True}
    assert "rendezvous store" not in caplog.text


def test_without_one_the_store_carries_it_and_a_warning_says_so(monkeypatch, caplog):
    import logging

    from fireflyer.hfreduce.engine import communicator as engine

    monkeypatch.delenv("FIREFLYER_JOB_SECRET", raising=False)
    monkeypatch.setattr(engine, "_warned_store_secret", False)
    store = dist.HashStore()
    with caplog.at_level(logging.WARNING, logger="fireflyer.hfreduce"):
        with Communicator(store, 0, 1, config=HFReduceConfig(timeout=10)):
            pass
    assert _keys(store)["hfreduce/0/secret"]
    (line,) = [r.getMessage() for r in caplog.records if "FIREFLYER_JOB_SECRET" in r.getMessage()]
    assert "\n" not in line and "rendezvous store" in line


def test_a_short_launcher_secret_is_refused(monkeypatch):
    import pytest

    monkeypatch.setenv("FIREFLYER_JOB_SECRET", "short")
    with pytest.raises(ValueError, match="FIREFLYER_JOB_SECRET must be at least 16"):
        Communicator(dist.HashStore(), 0, 1, config=HFReduceConfig(timeout=10))
