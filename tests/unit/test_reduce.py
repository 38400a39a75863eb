"""Chunk arithmetic (reduce.py) and collective plans (collectives.py): pure tensor code."""

from __future__ import annotations

import pytest
import torch

from fireflyer.hfreduce import collectives
from fireflyer.hfreduce.reduce import (
    DESCRIPTOR_BYTES,
    DTYPES,
    LOW_PRECISION,
    REDUCIBLE,
    Descriptor,
    Kind,
    Op,
    Reducer,
    acc_dtype,
    check_dtype,
    check_op,
    chunk_elems,
)

INT_DTYPES = [d for d in REDUCIBLE if not d.is_floating_point]


def _name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.dtype.itemsize])


def _inputs(dtype: torch.dtype, k: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        # fp8 e4m3fn tops out at 448; keep every partial sum in range for every dtype.
        return [(torch.randn(n, generator=g, dtype=torch.float64) * 8).to(dtype) for _ in range(k)]
    return [torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype) for _ in range(k)]


# -- Descriptor ------------------------------------------------------------------------


_CASES = [(Op.SUM, 0, -1), (Op.MAX, 2**40 + 3, 7), (Op.COPY, 1, 2**31 - 1), (Op.AVG, 12345, 0)]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=_name)
@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
def test_descriptor_pack_unpack_round_trip(kind: Kind, dtype: torch.dtype) -> None:
    for op, numel, root in _CASES:
        desc = Descriptor(kind, dtype, numel, op, root)
        back = Descriptor.unpack(desc.pack())
        # field by field, so a swap of two equal-valued fields (Op.SUM == 0) cannot hide
        assert (back.kind, back.dtype, back.numel, back.op, back.root) == (kind, dtype, numel, op, root)
        assert isinstance(back.op, Op) and isinstance(back.kind, Kind)
        assert back == desc
        assert str(back) == str(desc)


def test_unpacked_descriptor_str_matches_original() -> None:
    # What the engine prints in a CollectiveMismatch message for the other rank's call.
    desc = Descriptor(Kind.ALLREDUCE, torch.float32, 1000, Op.SUM)
    assert str(Descriptor.unpack(desc.pack())) == "allreduce(float32[1000], SUM)"
    desc = Descriptor(Kind.BROADCAST, torch.int64, 77, Op.COPY, 3)
    assert str(Descriptor.unpack(desc.pack())) == "broadcast(int64[77], root=3)"


@pytest.mark.parametrize("dtype", list(DTYPES), ids=_name)
@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
def test_descriptor_pack_layout(kind: Kind, dtype: torch.dtype) -> None:
    """The wire format: kind, dtype code, op (one byte each), a pad byte, numel (int64), root (int32)."""
    for op, numel, root in _CASES:
        data = Descriptor(kind, dtype, numel, op, root).pack()
        assert len(data) == DESCRIPTOR_BYTES == 16
        assert (data[0], data[1], data[2]) == (int(kind), DTYPES[dtype], int(op))
        assert int.from_bytes(data[4:12], "little", signed=True) == numel
        assert int.from_bytes(data[12:16], "little", signed=True) == root
        back = Descriptor.unpack(data)
        assert (back.kind, back.dtype, back.root) == (kind, dtype, root)
        assert back.pack() == data


def test_descriptor_unpack_unknown_dtype_code_does_not_match_a_real_dtype() -> None:
    data = bytearray(Descriptor(Kind.ALLREDUCE, torch.float32, 4, Op.SUM).pack())
    data[1] = 200
    assert Descriptor.unpack(bytes(data)).dtype not in DTYPES


def test_descriptor_packs_fields_distinctly() -> None:
    a = Descriptor(Kind.ALLREDUCE, torch.float32, 10, Op.SUM)
    others = [
        Descriptor(Kind.REDUCE_SCATTER, torch.float32, 10, Op.SUM),
        Descriptor(Kind.ALLREDUCE, torch.float16, 10, Op.SUM),
        Descriptor(Kind.ALLREDUCE, torch.float32, 11, Op.SUM),
        Descriptor(Kind.ALLREDUCE, torch.float32, 10, Op.MAX),
        Descriptor(Kind.ALLREDUCE, torch.float32, 10, Op.SUM, 0),
    ]
    assert len({a.pack(), *(o.pack() for o in others)}) == 1 + len(others)
    assert DESCRIPTOR_BYTES <= 64  # fits one arena descriptor slot


def test_descriptor_str() -> None:
    assert str(Descriptor(Kind.ALLREDUCE, torch.float32, 10, Op.SUM)) == "allreduce(float32[10], SUM)"
    assert str(Descriptor(Kind.REDUCE_SCATTER, torch.bfloat16, 8, Op.AVG)) == "reduce_scatter(bfloat16[8], AVG)"
    assert str(Descriptor(Kind.BROADCAST, torch.int64, 3, Op.COPY, 2)) == "broadcast(int64[3], root=2)"
    assert str(Descriptor(Kind.ALLGATHER, torch.float16, 12, Op.COPY)) == "allgather(float16[12])"
    assert str(Descriptor(Kind.BARRIER, torch.int32, 0, Op.SUM)) == "barrier(int32[0])"


# -- dtype and op checks ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64, torch.uint8], ids=_name)
def test_check_dtype_rejects_and_lists_supported(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError) as info:
        check_dtype(dtype)
    msg = str(info.value)
    assert _name(dtype) in msg
    assert "supported" in msg
    for ok in REDUCIBLE:
        assert _name(ok) in msg


@pytest.mark.parametrize("dtype", list(REDUCIBLE), ids=_name)
def test_check_dtype_accepts_supported(dtype: torch.dtype) -> None:
    check_dtype(dtype)


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=_name)
def test_check_op_avg_on_int_raises(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="AVG"):
        check_op(Op.AVG, dtype)
    for op in (Op.SUM, Op.MIN, Op.MAX):
        check_op(op, dtype)


def test_acc_dtype_and_chunk_elems() -> None:
    for d in REDUCIBLE:
        assert acc_dtype(d, Op.COPY) == d
        assert acc_dtype(d, Op.SUM) == (torch.float32 if d in LOW_PRECISION else d)
    assert chunk_elems(4096, torch.float16, Op.SUM) == 2048  # one node: the data fills the chunk
    assert chunk_elems(4096, torch.float16, Op.SUM, red_bytes=8192) == 2048  # fp32 partials fit twice the bytes
    assert chunk_elems(4096, torch.float8_e4m3fn, Op.SUM, red_bytes=8192) == 2048  # fp8 is bound by its fp32 partials
    assert chunk_elems(4096, torch.float16, Op.COPY, red_bytes=4096) == 2048
    assert chunk_elems(4096, torch.float64, Op.SUM) == 512
    assert chunk_elems(1, torch.float64, Op.SUM) == 1


# -- Reducer ---------------------------------------------------------------------------


def _run(dtype: torch.dtype, op: Op, inputs: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """Drive the reducer the way the engine does: accumulate in acc_dtype, then finish once."""
    reducer = Reducer()
    n = inputs[0].numel()
    acc = acc_dtype(dtype, op)
    work = reducer.acc_scratch(n) if acc != dtype else torch.empty(n, dtype=dtype)
    assert work.dtype == acc
    reducer.reduce_into(work, inputs, op)
    out = torch.empty(n, dtype=dtype)
    reducer.finish(out, work, op, world_size)
    return out


def _reference_same_order(dtype: torch.dtype, op: Op, inputs: list[torch.Tensor], world_size: int) -> torch.Tensor:
    acc_t = acc_dtype(dtype, op)
    acc = inputs[0].to(acc_t)
    for x in inputs[1:]:
        x = x.to(acc_t)
        if op in (Op.SUM, Op.AVG):
            acc = acc + x
        elif op == Op.MIN:
            acc = torch.minimum(acc, x)
        else:
            acc = torch.maximum(acc, x)
    if op == Op.AVG:
        acc = acc / world_size
    return acc.to(dtype)


def _reference_f64(op: Op, inputs: list[torch.Tensor], world_size: int) -> torch.Tensor:
    stack = torch.stack([x.double() for x in inputs])
    if op == Op.SUM:
        return stack.sum(0)
    if op == Op.AVG:
        return stack.sum(0) / world_size
    return stack.min(0).values if op == Op.MIN else stack.max(0).values


_TOL = {
    torch.float64: 1e-12,
    torch.float32: 1e-4,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
    torch.float8_e4m3fn: 0.13,  # one ulp: rounding the fp32 sum may differ from rounding the exact sum
    torch.float8_e5m2: 0.26,
}


_DTYPE_OPS = [
    pytest.param(d, op, id=f"{_name(d)}-{op.name}")
    for d in REDUCIBLE
    for op in (Op.SUM, Op.AVG, Op.MIN, Op.MAX)
    if d.is_floating_point or op != Op.AVG  # check_op refuses AVG on integers
]


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize(("dtype", "op"), _DTYPE_OPS)
def test_reducer_matches_references(dtype: torch.dtype, op: Op, k: int) -> None:
    inputs = _inputs(dtype, k, 513, seed=k * 31 + int(op))
    before = [x.clone() for x in inputs]
    world_size = k + 1 if op == Op.AVG else k  # AVG divides by world size, not by the number of inputs
    got = _run(dtype, op, inputs, world_size)
    assert got.dtype == dtype
    for x, b in zip(inputs, before):
        assert torch.equal(_bits(x), _bits(b)), "inputs must not be modified"

    ref64 = _reference_f64(op, inputs, world_size)
    if dtype.is_floating_point:
        # Low precision: the fp32 sum in the same order, rounded once, bit for bit.
        # fp32/fp64: the same-dtype sum in the same order, bit for bit.
        same = _reference_same_order(dtype, op, inputs, world_size)
        assert torch.equal(_bits(got), _bits(same))
        if dtype in LOW_PRECISION and op in (Op.SUM, Op.AVG):
            once = sum((x.float() for x in inputs[1:]), inputs[0].float())
            once = (once / world_size if op == Op.AVG else once).to(dtype)
            assert torch.equal(_bits(got), _bits(once))
        # ...and close to the exact answer: within the output dtype's rounding.
        torch.testing.assert_close(got.double(), ref64.to(dtype).double(), rtol=_TOL[dtype], atol=_TOL[dtype])
    else:
        assert torch.equal(got, ref64.to(dtype))
    if op in (Op.MIN, Op.MAX):
        # Min and max pick one of the inputs exactly.
        assert torch.equal(got.double(), ref64)


@pytest.mark.parametrize("dtype", sorted(LOW_PRECISION, key=str), ids=_name)
def test_low_precision_sum_rounds_once_not_per_step(dtype: torch.dtype) -> None:
    # 1 + eps/2 + eps/2: rounding after each step loses both small terms (ties to even),
    # accumulating in fp32 and rounding once keeps them.
    eps = torch.finfo(dtype).eps
    one = torch.ones(4, dtype=dtype)
    half_ulp = torch.full((4,), eps / 2, dtype=dtype)
    assert torch.all(half_ulp.float() == eps / 2)  # exactly representable
    stepwise = ((one.float() + half_ulp.float()).to(dtype).float() + half_ulp.float()).to(dtype)
    assert torch.all(stepwise.float() == 1)
    got = _run(dtype, Op.SUM, [one, half_ulp, half_ulp], 3)
    assert torch.all(got.float() == 1 + eps)


def test_reducer_combine_accumulates_in_place() -> None:
    reducer = Reducer()
    acc = torch.zeros(5, dtype=torch.float32)
    for t in (torch.arange(5, dtype=torch.bfloat16), torch.ones(5, dtype=torch.float8_e5m2)):
        reducer.combine(acc, t, Op.SUM)
    assert acc.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    reducer.combine(acc, torch.full((5,), 3.0, dtype=torch.float16), Op.MIN)
    assert acc.tolist() == [1.0, 2.0, 3.0, 3.0, 3.0]
    reducer.combine(acc, torch.full((5,), 2.0, dtype=torch.float8_e4m3fn), Op.MAX)
    assert acc.tolist() == [2.0, 2.0, 3.0, 3.0, 3.0]


def test_reducer_scratch_grows_and_is_reused() -> None:
    reducer = Reducer()
    a = reducer.acc_scratch(10)
    b = reducer.acc_scratch(100)
    assert a.numel() == 10 and b.numel() == 100 and a.dtype == torch.float32
    assert a.data_ptr() == b.data_ptr()
    c = reducer.acc_scratch(1 << 17)
    assert c.numel() == 1 << 17


@pytest.mark.parametrize("dtype", list(REDUCIBLE), ids=_name)
def test_copy_merges_bits_exactly(dtype: torch.dtype) -> None:
    """COPY: each element has one owner; the others contribute all-zero bits. -0.0 and NaN payloads survive."""
    n, owners = 64, 3
    g = torch.Generator().manual_seed(7)
    itemsize = dtype.itemsize
    int_t = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[itemsize]
    want_bits = torch.randint(0, 256, (n * itemsize,), generator=g, dtype=torch.uint8).view(int_t).clone()
    if dtype.is_floating_point:
        nbits = 8 * itemsize

        def put(i: int, pattern: int) -> None:
            if int_t is not torch.uint8 and pattern >= 1 << (nbits - 1):
                pattern -= 1 << nbits  # the same bits as a signed integer
            want_bits[i] = pattern

        put(0, 1 << (nbits - 1))  # -0.0
        nans = {
            torch.float64: [0x7FF8DEADBEEF0001, 0xFFF0000000000001],
            torch.float32: [0x7FC12345, 0xFFC00001, 0x7F800001],  # payloads, negative NaN, signalling NaN
            torch.float16: [0x7E01, 0xFC01],
            torch.bfloat16: [0x7FC1, 0xFF81],
            torch.float8_e4m3fn: [0x7F, 0xFF],
            torch.float8_e5m2: [0x7E, 0xFD],
        }[dtype]
        for i, pattern in enumerate(nans, start=1):
            put(i, pattern)
        assert torch.isnan(want_bits[1 : 1 + len(nans)].view(dtype).float()).all()
        assert str(want_bits[0:1].view(dtype).item()) == "-0.0"
    bounds = [0, 20, 41, n]
    inputs = []
    for r in range(owners):
        bits = torch.zeros(n, dtype=int_t)
        bits[bounds[r] : bounds[r + 1]] = want_bits[bounds[r] : bounds[r + 1]]
        inputs.append(bits.view(dtype))
    reducer = Reducer()
    out = torch.empty(n, dtype=acc_dtype(dtype, Op.COPY))
    assert out.dtype == dtype
    reducer.reduce_into(out, inputs, Op.COPY)
    assert torch.equal(out.view(int_t), want_bits)
    final = torch.empty(n, dtype=dtype)
    reducer.finish(final, out, Op.COPY, owners)
    assert torch.equal(final.view(int_t), want_bits)


# -- collective plans ------------------------------------------------------------------


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr()


def test_allreduce_plan() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    plan = collectives.allreduce(t, Op.SUM, world_size=4)
    assert plan.desc == Descriptor(Kind.ALLREDUCE, torch.float32, 12, Op.SUM)
    assert plan.dense and plan.owners is None
    assert plan.world_size == 4
    [(off_in, src)] = plan.sources
    [(off_out, dst)] = plan.sinks
    assert off_in == off_out == 0
    assert src.shape == dst.shape == (12,)
    assert _shares(src, t) and _shares(dst, t)
    assert plan.on_done == []


def test_allreduce_scalar_and_errors() -> None:
    plan = collectives.allreduce(torch.tensor(3.0), Op.MAX, world_size=2)
    assert plan.desc.numel == 1
    with pytest.raises(ValueError, match="AVG"):
        collectives.allreduce(torch.ones(3, dtype=torch.int64), Op.AVG, world_size=2)
    with pytest.raises(TypeError, match="bool"):
        collectives.allreduce(torch.ones(3, dtype=torch.bool), Op.SUM, world_size=2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        collectives.allreduce([1.0, 2.0], Op.SUM, world_size=2)  # type: ignore[arg-type]


def test_meta_and_sparse_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="meta"):
        collectives.allreduce(torch.empty(4, device="meta"), Op.SUM, world_size=2)
    with pytest.raises(ValueError, match="sparse"):
        collectives.allreduce(torch.eye(3).to_sparse(), Op.SUM, world_size=2)
    with pytest.raises(ValueError, match="meta"):
        collectives.broadcast(torch.empty(4, device="meta"), root=0, rank=0, world_size=2)
    with pytest.raises(ValueError, match="sparse"):
        collectives.allgather(torch.zeros(6), torch.ones(3).to_sparse(), rank=0, world_size=2)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_csr_tensor_is_refused_with_valueerror() -> None:
    csr = torch.eye(3).to_sparse_csr()
    with pytest.raises(ValueError, match="sparse"):
        collectives.allreduce(csr, Op.SUM, world_size=2)


def test_reduce_scatter_unsupported_dtype_with_avg_raises_typeerror() -> None:
    out, inp = torch.empty(2, dtype=torch.complex64), torch.empty(4, dtype=torch.complex64)
    with pytest.raises(TypeError, match="supported"):
        collectives.reduce_scatter(out, inp, Op.AVG, rank=0, world_size=2)


def test_allreduce_unsupported_dtype_with_avg_raises_typeerror() -> None:
    with pytest.raises(TypeError, match="supported"):
        collectives.allreduce(torch.empty(4, dtype=torch.complex64), Op.AVG, world_size=2)


def test_noncontiguous_allreduce_writes_back_on_done() -> None:
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    t = base.t()  # 4x3, not contiguous
    assert not t.is_contiguous()
    plan = collectives.allreduce(t, Op.SUM, world_size=2)
    [(_, src)] = plan.sources
    [(_, dst)] = plan.sinks
    assert src.is_contiguous() and src.numel() == 12
    assert src.tolist() == t.reshape(-1).tolist()  # staged in t's logical order
    assert not _shares(dst, base)
    assert len(plan.on_done) == 1
    dst.mul_(10)
    assert base[0, 0].item() == 0 and base[0, 1].item() == 1  # untouched until on_done runs
    for fn in plan.on_done:
        fn()
    assert torch.equal(base, torch.arange(12, dtype=torch.float64).reshape(3, 4) * 10)


def test_reduce_scatter_plan() -> None:
    inp = torch.arange(12, dtype=torch.float32)
    out = torch.empty(3, dtype=torch.float32)
    plan = collectives.reduce_scatter(out, inp, Op.AVG, rank=2, world_size=4)
    assert plan.desc == Descriptor(Kind.REDUCE_SCATTER, torch.float32, 12, Op.AVG)
    assert plan.dense
    [(src_off, src)] = plan.sources
    [(off, dst)] = plan.sinks
    assert src_off == 0 and off == 6 and _shares(src, inp) and _shares(dst, out)
    assert plan.on_done == []


def test_reduce_scatter_errors_and_write_back() -> None:
    with pytest.raises(ValueError, match=r"input.numel\(\) == output.numel\(\) \* world_size"):
        collectives.reduce_scatter(torch.empty(3), torch.empty(11), Op.SUM, rank=0, world_size=4)
    with pytest.raises(TypeError, match="one dtype"):
        collectives.reduce_scatter(torch.empty(3), torch.empty(12, dtype=torch.float64), Op.SUM, rank=0, world_size=4)
    with pytest.raises(ValueError, match="AVG"):
        collectives.reduce_scatter(
            torch.empty(3, dtype=torch.int32), torch.empty(12, dtype=torch.int32), Op.AVG, rank=0, world_size=4
        )
    # A non-contiguous input is only read: no write-back. A non-contiguous output is written back.
    inp = torch.arange(8.0).reshape(2, 4).t()
    out_base = torch.zeros(2, 2)
    out = out_base.t()
    plan = collectives.reduce_scatter(out, inp, Op.SUM, rank=1, world_size=2)
    assert plan.sources[0][1].tolist() == inp.reshape(-1).tolist()
    assert len(plan.on_done) == 1
    off, dst = plan.sinks[0]
    assert off == 4
    dst.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    plan.on_done[0]()
    assert out.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_allgather_plan() -> None:
    inp = torch.ones(3, dtype=torch.bfloat16)
    out = torch.empty(12, dtype=torch.bfloat16)
    plan = collectives.allgather(out, inp, rank=1, world_size=4)
    # allgather only moves data, so it runs on the raw bytes of any dtype
    assert plan.desc == Descriptor(Kind.ALLGATHER, torch.uint8, 24, Op.COPY)
    assert not plan.dense
    assert plan.owners == [(0, 6, 0), (6, 12, 1), (12, 18, 2), (18, 24, 3)]
    [(off, src)] = plan.sources
    assert off == 6 and _shares(src, inp)
    [(dst_off, dst)] = plan.sinks
    assert dst_off == 0 and _shares(dst, out)


def test_allgather_errors() -> None:
    with pytest.raises(ValueError, match=r"output.numel\(\) == input.numel\(\) \* world_size"):
        collectives.allgather(torch.empty(10), torch.empty(3), rank=0, world_size=4)
    with pytest.raises(TypeError, match="one dtype"):
        collectives.allgather(torch.empty(12, dtype=torch.int32), torch.empty(3, dtype=torch.int64), rank=0, world_size=4)
    # any dtype gathers as bytes, complex and bool included
    plan = collectives.allgather(torch.empty(4, dtype=torch.complex64), torch.empty(2, dtype=torch.complex64), 0, 2)
    assert plan.desc.numel == 32 and plan.desc.dtype == torch.uint8


def test_broadcast_plans_root_and_receiver() -> None:
    t = torch.arange(5, dtype=torch.int64)
    root = collectives.broadcast(t, root=1, rank=1, world_size=3)
    assert root.desc == Descriptor(Kind.BROADCAST, torch.uint8, 40, Op.COPY, 1)
    assert [off for off, _ in root.sources] == [0] and _shares(root.sources[0][1], t)
    assert root.sinks == []
    assert root.owners == [(0, 40, 1)]
    other = collectives.broadcast(t, root=1, rank=0, world_size=3)
    assert other.sources == []
    assert [off for off, _ in other.sinks] == [0] and _shares(other.sinks[0][1], t)
    assert other.owners == [(0, 40, 1)]
    assert root.desc.pack() == other.desc.pack()  # every rank agrees on the descriptor


@pytest.mark.parametrize("root", [-1, 3, 10])
def test_broadcast_bad_root(root: int) -> None:
    with pytest.raises(ValueError, match=r"root must be in 0..2"):
        collectives.broadcast(torch.ones(2), root=root, rank=0, world_size=3)


def test_broadcast_noncontiguous_writes_back_only_on_receivers() -> None:
    base = torch.zeros(2, 3)
    at_root = collectives.broadcast(base.t(), root=0, rank=0, world_size=2)
    assert at_root.on_done == []
    recv = collectives.broadcast(base.t(), root=0, rank=1, world_size=2)
    assert len(recv.on_done) == 1
    recv.sinks[0][1].view(torch.float32).copy_(torch.arange(6.0))
    recv.on_done[0]()
    assert base.t().reshape(-1).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_barrier_plan() -> None:
    plan = collectives.barrier(world_size=5)
    assert plan.desc.kind == Kind.BARRIER and plan.desc.numel == 0
    assert plan.sources == [] and plan.sinks == [] and plan.world_size == 5
