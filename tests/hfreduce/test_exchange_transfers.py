"""What the exchange moves, without any peer: digests, byte views, calls, and argument checks."""

from __future__ import annotations

import pytest
import torch

from fireflyer.hfreduce.errors import HFReduceError, PeerFailure
from fireflyer.hfreduce.transport.exchange import _overlap, split_rows, direct_bytes
from fireflyer.hfreduce.transport.transfers import Kind, Op, Transfer, dest_bytes, describe_digest, digest, source_bytes


def test_a_digest_tells_calls_apart_and_reads_as_words():
    a = digest(Kind.ALL_TO_ALL, torch.float32, 12)
    assert len(a) == 16
    assert a != digest(Kind.ALL_TO_ALL, torch.int32, 12) != digest(Kind.ALL_TO_ALL, torch.float32, 13)
    assert digest(Kind.GATHER, torch.float32, 12, root=0) != digest(Kind.GATHER, torch.float32, 12, root=1)
    assert describe_digest(a) == "all_to_all of 12 x float32"
    assert describe_digest(digest(Kind.SCATTER, torch.bfloat16, 3, root=2)) == "scatter (root 2) of 3 x bfloat16"
    assert describe_digest(digest(Kind.P2P, torch.bool, 0)) == "send/recv of 0 x bool"


@pytest.mark.parametrize("make", [
    lambda: torch.arange(12, dtype=torch.float32).view(3, 4),
    lambda: torch.arange(24, dtype=torch.float64).view(4, 6)[:, ::2],  # not contiguous
    lambda: torch.tensor(5, dtype=torch.int16),  # 0-dim
    lambda: torch.zeros(4, 2)[:1, 1],  # one element with a stride
    lambda: torch.empty(0, 3),
    lambda: torch.tensor([True, False, True]),
])
def test_tensors_travel_as_their_bytes_and_land_back_in_place(make):
    t = make()
    raw = source_bytes(t)
    assert raw.dtype == torch.uint8 and raw.numel() == t.numel() * t.element_size()
    target = torch.zeros_like(t) if t.dim() == 0 or t.is_contiguous() else torch.zeros(t.shape[0], t.shape[1] * 2,
                                                                                         dtype=t.dtype)[:, ::2]
    finish: list = []
    into = dest_bytes(target, finish)
    into.copy_(raw)
    for fn in finish:
        fn()
    assert torch.equal(target, t)
    assert bool(finish) == (not target.is_contiguous())


def test_a_call_completes_with_its_last_transfer_and_fails_once():
    forgotten = []
    op = Op(3, "all_to_all", deadline=0.0, timeout=5.0, result=["r"], finish=[], forget=forgotten.append)
    trs = [Transfer(op, p, p == 1, (2, 0), torch.zeros(4, dtype=torch.uint8), digest(Kind.ALL_TO_ALL, torch.uint8, 4),
                    "rank 0") for p in (1, 2)]
    for tr in trs:
        op.add(tr)
    assert op.waiting_on() == ["receiving from rank 2", "sending to rank 1"]
    assert "receiving all_to_all of 4 x uint8 (all_to_all #3, timeout 5s) on rank 0" == trs[1].what
    op.done(trs[0])
    assert not op.future.done()
    op.done(trs[1])
    assert op.future.wait() == ["r"] and forgotten == [op]
    op.fail(PeerFailure("late"))  # a settled call stays as it was
    assert op.future.wait() == ["r"]

    failing = Op(4, "gather", deadline=0.0, timeout=1.0, result=[], finish=[], forget=lambda _: None)
    failing.add(Transfer(failing, 1, False, (2, 1), torch.zeros(1, dtype=torch.uint8), b"\0" * 16, "rank 0"))
    failing.fail(PeerFailure("rank 1 died"))
    with pytest.raises(PeerFailure, match="rank 1 died"):
        failing.future.wait()


def test_a_copy_back_that_fails_reaches_the_caller():
    def broken() -> None:
        raise RuntimeError("device lost")

    op = Op(0, "recv from rank 1", deadline=0.0, timeout=1.0, result=[], finish=[broken], forget=lambda _: None)
    op.done(None)
    with pytest.raises(HFReduceError, match="copying the result out failed: device lost"):
        op.future.wait()


def test_all_to_all_single_splits_are_checked_as_gloo_checks_them():
    t = torch.zeros(10, 3).shape
    assert split_rows(t, [], 5, "input") == [2] * 5
    assert split_rows(t, [0, 4, 6], 3, "input") == [0, 4, 6]
    with pytest.raises(ValueError, match="dim 0 \\(10\\) does not divide into 3 equal parts"):
        split_rows(t, None, 3, "input")
    with pytest.raises(ValueError, match="output_split_sizes=\\[1, 2\\] must give 3"):
        split_rows(t, [1, 2], 3, "output")
    with pytest.raises(ValueError, match="sum to the input's dim 0"):
        split_rows(t, [1, 2, 3], 3, "input")
    with pytest.raises(ValueError, match="at least one dimension"):
        split_rows(torch.tensor(1.0).shape, [], 1, "input")


def test_overlap_of_tensors_in_one_buffer():
    buf = torch.zeros(100)
    assert _overlap(buf[:50], buf[40:]) and not _overlap(buf[:50], buf[50:]) and not _overlap(buf, torch.zeros(3))
    assert _overlap(buf.view(10, 10)[:, 0], buf[5:8])  # not contiguous: by storage


def test_direct_read_threshold_from_the_environment(monkeypatch):
    monkeypatch.delenv("FIREFLYER_HFREDUCE_DIRECT_BYTES", raising=False)
    assert direct_bytes() == 256 << 10
    monkeypatch.setenv("FIREFLYER_HFREDUCE_DIRECT_BYTES", "0")
    assert direct_bytes() == 0
    for bad in ("-1", "big"):
        monkeypatch.setenv("FIREFLYER_HFREDUCE_DIRECT_BYTES", bad)
        with pytest.raises(ValueError, match="FIREFLYER_HFREDUCE_DIRECT_BYTES"):
            direct_bytes()
