"""Chunk arithmetic (reduce.py) and collective plans (collectives.py): pure tensor code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fireflyer.hfreduce.plans import collectives
from fireflyer.hfreduce.plans.plan import (
    DESCRIPTOR_BYTES,
    DTYPES,
    INTEGRAL,
    LOW_PRECISION,
    REDUCIBLE,
    USER_OPS,
    Descriptor,
    Kind,
    Op,
    Reducer,
    acc_dtype,
    check_dtype,
    check_op,
    chunk_elems,
)

INT_DTYPES = [d for d in REDUCIBLE if not d.is_floating_point]  # bool included
FLOAT_DTYPES = [d for d in REDUCIBLE if d.is_floating_point]
BITWISE = (Op.BAND, Op.BOR, Op.BXOR)


def _allowed(dtype: torch.dtype, op: Op) -> bool:
    """What check_op lets through: AVG needs floats, the bitwise ops need integers or bool."""
    if op == Op.AVG:
        return dtype.is_floating_point
    return not (op in BITWISE and dtype.is_floating_point)


def _name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.dtype.itemsize])


def _inputs(dtype: torch.dtype, k: int, n: int, seed: int, op: Op = Op.SUM) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return [torch.randint(0, 2, (n,), generator=g).bool() for _ in range(k)]
    if dtype.is_floating_point:
        if op == Op.PRODUCT:
            # factors of magnitude 1/2..2, either sign: a product of 5 stays inside fp8's normal range
            return [_factors(n, g).to(dtype) for _ in range(k)]
        # fp8 e4m3fn tops out at 448; keep every partial sum in range for every dtype.
        return [(torch.randn(n, generator=g, dtype=torch.float64) * 8).to(dtype) for _ in range(k)]
    # the whole range: sums and products wrap, as in torch and gloo
    info = torch.iinfo(dtype)
    return [torch.randint(info.min, info.max, (n,), generator=g, dtype=dtype) for _ in range(k)]


def _factors(n: int, g: torch.Generator) -> torch.Tensor:
    mag = 2.0 ** (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1)
    return mag * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)


# -- Descriptor ------------------------------------------------------------------------


_CASES = [
    (Op.SUM, 0, -1), (Op.MAX, 2**40 + 3, 7), (Op.COPY, 1, 2**31 - 1), (Op.AVG, 12345, 0),
    (Op.PRODUCT, 5, -1), (Op.BAND, 6, 1), (Op.BOR, 7, -1), (Op.BXOR, 2**33, 3),
]


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
    theirs = Descriptor.unpack(bytes(data))
    assert theirs.dtype not in DTYPES
    assert str(theirs) == "allreduce(unknown-dtype[4], SUM)"  # what a mismatch message prints


def test_every_dtype_has_its_own_code() -> None:
    assert len(set(DTYPES.values())) == len(DTYPES)
    # 1-byte dtypes: bool, uint8 and int8 data must not pass for one another...
    one_byte = {Descriptor(Kind.ALLREDUCE, d, 8, Op.MAX).pack() for d in (torch.bool, torch.uint8, torch.int8)}
    assert len(one_byte) == 3
    # ...nor a reduction of uint8 data for the raw bytes allgather and broadcast move.
    assert Descriptor(Kind.ALLREDUCE, torch.uint8, 8, Op.BOR).pack() != Descriptor(Kind.ALLGATHER, torch.uint8, 8, Op.COPY).pack()
    assert Descriptor(Kind.REDUCE, torch.uint8, 8, Op.MAX, 0).pack() != Descriptor(Kind.BROADCAST, torch.uint8, 8, Op.COPY, 0).pack()


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


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16, torch.uint32, torch.float8_e4m3fnuz], ids=_name)
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


def test_reducible_dtypes() -> None:
    assert set(REDUCIBLE) == {
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
        torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
    }
    assert INTEGRAL == INT_DTYPES
    assert set(USER_OPS) == set(Op) - {Op.COPY}


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=_name)
def test_check_op_avg_on_int_raises(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="AVG") as info:
        check_op(Op.AVG, dtype)
    assert _name(dtype) in str(info.value)
    assert ("MAX for any" if dtype == torch.bool else "use SUM and divide") in str(info.value)
    for op in USER_OPS:
        if op != Op.AVG:
            check_op(op, dtype)  # every other op, the bitwise ones included


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=_name)
@pytest.mark.parametrize("op", BITWISE, ids=lambda o: o.name)
def test_check_op_bitwise_on_float_raises_typeerror(op: Op, dtype: torch.dtype) -> None:
    with pytest.raises(TypeError) as info:
        check_op(op, dtype)
    msg = str(info.value)
    assert op.name in msg and _name(dtype) in msg
    for ok in INTEGRAL:  # names every dtype it does take
        assert _name(ok) in msg
    for op_ok in (Op.SUM, Op.AVG, Op.MIN, Op.MAX, Op.PRODUCT):
        check_op(op_ok, dtype)


def test_check_op_refuses_internal_ops() -> None:
    with pytest.raises(ValueError, match="COPY.*supported: SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR"):
        check_op(Op.COPY, torch.float32)


@pytest.mark.parametrize("op", BITWISE, ids=lambda o: o.name)
def test_collective_plans_refuse_bitwise_on_floats(op: Op) -> None:
    with pytest.raises(TypeError, match=op.name):
        collectives.allreduce(torch.ones(3), op, world_size=2)
    with pytest.raises(TypeError, match="bfloat16"):
        collectives.reduce(torch.ones(3, dtype=torch.bfloat16), op, root=0, rank=0, world_size=2)
    with pytest.raises(TypeError, match="float16"):
        collectives.reduce_scatter(torch.ones(2).half(), torch.ones(4).half(), op, rank=0, world_size=2)
    # the integer and bool forms plan fine
    assert collectives.allreduce(torch.ones(3, dtype=torch.uint8), op, world_size=2).desc.op == op
    assert collectives.allreduce(torch.ones(3, dtype=torch.bool), op, world_size=2).desc.dtype == torch.bool


def test_acc_dtype_and_chunk_elems() -> None:
    for d in REDUCIBLE:
        assert acc_dtype(d, Op.COPY) == d
        for op in (Op.SUM, Op.AVG, Op.PRODUCT, Op.MIN, Op.MAX):
            assert acc_dtype(d, op) == (torch.float32 if d in LOW_PRECISION else d)
    for d in INTEGRAL:
        for op in BITWISE:
            assert acc_dtype(d, op) == d  # integers never widen: they wrap in their own dtype
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
    """Floats: the reduction in the accumulation dtype, input after input, rounded once at the end."""
    acc_t = acc_dtype(dtype, op)
    acc = inputs[0].to(acc_t)
    for x in inputs[1:]:
        x = x.to(acc_t)
        if op in (Op.SUM, Op.AVG):
            acc = acc + x
        elif op == Op.PRODUCT:
            acc = acc * x
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
    if op == Op.PRODUCT:
        return stack.prod(0)
    return stack.min(0).values if op == Op.MIN else stack.max(0).values


# numpy, independently of torch: fixed-width integers wrap, as in C, torch and gloo.
_NP_OPS = {
    Op.SUM: np.add, Op.PRODUCT: np.multiply, Op.MIN: np.minimum, Op.MAX: np.maximum,
    Op.BAND: np.bitwise_and, Op.BOR: np.bitwise_or, Op.BXOR: np.bitwise_xor,
}
# bool is a flag: any for SUM/MAX/BOR, all for PRODUCT/MIN/BAND, parity for BXOR.
_NP_BOOL_OPS = {
    Op.SUM: np.logical_or, Op.MAX: np.logical_or, Op.BOR: np.logical_or,
    Op.PRODUCT: np.logical_and, Op.MIN: np.logical_and, Op.BAND: np.logical_and,
    Op.BXOR: np.logical_xor,
}


def _reference_exact(dtype: torch.dtype, op: Op, inputs: list[torch.Tensor]) -> torch.Tensor:
    """Integers and bool: the exact result, computed by numpy in the input dtype."""
    fn = (_NP_BOOL_OPS if dtype == torch.bool else _NP_OPS)[op]
    acc = inputs[0].numpy().copy()
    with np.errstate(over="ignore"):
        for x in inputs[1:]:
            acc = fn(acc, x.numpy())
    assert acc.dtype == inputs[0].numpy().dtype
    return torch.from_numpy(acc)


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
    for op in USER_OPS
    if _allowed(d, op)
]


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize(("dtype", "op"), _DTYPE_OPS)
def test_reducer_matches_references(dtype: torch.dtype, op: Op, k: int) -> None:
    inputs = _inputs(dtype, k, 513, seed=k * 31 + int(op), op=op)
    before = [x.clone() for x in inputs]
    world_size = k + 1 if op == Op.AVG else k  # AVG divides by world size, not by the number of inputs
    got = _run(dtype, op, inputs, world_size)
    assert got.dtype == dtype
    for x, b in zip(inputs, before):
        assert torch.equal(_bits(x), _bits(b)), "inputs must not be modified"

    if dtype.is_floating_point:
        ref64 = _reference_f64(op, inputs, world_size)
        # Low precision: the fp32 reduction in the same order, rounded once, bit for bit.
        # fp32/fp64: the same-dtype reduction in the same order, bit for bit.
        same = _reference_same_order(dtype, op, inputs, world_size)
        assert torch.equal(_bits(got), _bits(same))
        if dtype in LOW_PRECISION and op in (Op.SUM, Op.AVG, Op.PRODUCT):
            wide = [x.float() for x in inputs]
            once = wide[0].clone()
            for x in wide[1:]:
                once = once * x if op == Op.PRODUCT else once + x
            once = (once / world_size if op == Op.AVG else once).to(dtype)
            assert torch.equal(_bits(got), _bits(once))
        # ...and close to the exact answer: within the output dtype's rounding.
        torch.testing.assert_close(got.double(), ref64.to(dtype).double(), rtol=_TOL[dtype], atol=_TOL[dtype])
        if op in (Op.MIN, Op.MAX):
            # Min and max pick one of the inputs exactly.
            assert torch.equal(got.double(), ref64)
    else:
        assert torch.equal(got, _reference_exact(dtype, op, inputs))


_INT_OPS = [op for op in USER_OPS if op != Op.AVG]


@st.composite
def _int_case(draw):
    dtype = draw(st.sampled_from(INT_DTYPES))
    op = draw(st.sampled_from(_INT_OPS))
    k, n = draw(st.integers(1, 6)), draw(st.integers(1, 40))
    if dtype == torch.bool:
        values = st.booleans()
    else:
        info = torch.iinfo(dtype)
        edges = [info.min, info.min + 1, -1, 0, 1, 2, info.max - 1, info.max]
        values = st.one_of(st.sampled_from([e for e in edges if info.min <= e <= info.max]), st.integers(info.min, info.max))
    rows = draw(st.lists(st.lists(values, min_size=n, max_size=n), min_size=k, max_size=k))
    return dtype, op, [torch.tensor(r, dtype=dtype) for r in rows]


@settings(max_examples=300, deadline=None)
@given(case=_int_case())
def test_integer_and_bool_ops_are_exact_and_wrap(case) -> None:
    """Every op on every integer dtype (and bool), edge values included: exactly numpy's answer."""
    dtype, op, inputs = case
    got = _run(dtype, op, inputs, len(inputs))
    assert got.dtype == dtype
    assert torch.equal(got, _reference_exact(dtype, op, inputs))


_FLOAT_EXACT_OPS = [Op.PRODUCT, Op.MIN, Op.MAX]


@st.composite
def _float_case(draw):
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    op = draw(st.sampled_from(_FLOAT_EXACT_OPS))
    k, n = draw(st.integers(1, 6)), draw(st.integers(1, 24))
    big = 2.0 if op == Op.PRODUCT else 400.0
    values = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5]), st.floats(-big, big, allow_nan=False))
    rows = draw(st.lists(st.lists(values, min_size=n, max_size=n), min_size=k, max_size=k))
    return dtype, op, [torch.tensor(r, dtype=torch.float64).to(dtype) for r in rows]


@settings(max_examples=200, deadline=None)
@given(case=_float_case())
def test_float_product_min_max_match_same_order_reference(case) -> None:
    dtype, op, inputs = case
    got = _run(dtype, op, inputs, len(inputs))
    assert torch.equal(_bits(got), _bits(_reference_same_order(dtype, op, inputs, len(inputs))))


@pytest.mark.parametrize("dtype", sorted(LOW_PRECISION, key=str), ids=_name)
def test_low_precision_product_rounds_once_not_per_step(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    inputs = [_factors(4096, g).to(dtype) for _ in range(4)]
    stepwise = inputs[0]
    for x in inputs[1:]:
        stepwise = (stepwise.float() * x.float()).to(dtype)  # what a reduction in the dtype itself gives
    once = (inputs[0].float() * inputs[1].float() * inputs[2].float() * inputs[3].float()).to(dtype)
    got = _run(dtype, Op.PRODUCT, inputs, 4)
    assert torch.equal(_bits(got), _bits(once))
    assert not torch.equal(_bits(got), _bits(stepwise))  # the inputs are ones where rounding per step differs


def test_bool_results_are_real_bools() -> None:
    """Every op on bool gives 0 or 1 bytes, however many ranks say True (gloo's SUM counts them as bytes)."""
    inputs = [torch.ones(8, dtype=torch.bool) for _ in range(300)]
    inputs[0][:4] = False
    for op in _INT_OPS:
        got = _run(torch.bool, op, inputs, len(inputs))
        assert set(got.view(torch.uint8).tolist()) <= {0, 1}, op
    assert _run(torch.bool, Op.SUM, inputs, 300).tolist() == [True] * 8  # any
    assert _run(torch.bool, Op.MAX, inputs, 300).tolist() == [True] * 8
    assert _run(torch.bool, Op.MIN, inputs, 300).tolist() == [False] * 4 + [True] * 4  # all
    assert _run(torch.bool, Op.PRODUCT, inputs, 300).tolist() == [False] * 4 + [True] * 4
    assert _run(torch.bool, Op.BXOR, inputs, 300).tolist() == [True] * 4 + [False] * 4  # parity


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
    reducer.combine(acc, torch.full((5,), 1.5, dtype=torch.bfloat16), Op.PRODUCT)
    reducer.combine(acc, torch.full((5,), -0.5, dtype=torch.float8_e5m2), Op.PRODUCT)
    assert acc.tolist() == [-1.5, -1.5, -2.25, -2.25, -2.25]
    ints = torch.tensor([0b1100, 0b1010, -1], dtype=torch.int16)
    for op, want in ((Op.BAND, [0b1000, 0b1010, 0b0110]), (Op.BOR, [0b1110, 0b1110, -1]), (Op.BXOR, [0b0110, 0b0100, -7])):
        acc = ints.clone()
        reducer.combine(acc, torch.tensor([0b1010, 0b1110, 0b0110], dtype=torch.int16), op)
        assert acc.tolist() == want, op


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
    with pytest.raises(TypeError, match="uint16"):
        collectives.allreduce(torch.ones(3, dtype=torch.uint16), Op.SUM, world_size=2)
    with pytest.raises(ValueError, match="AVG"):
        collectives.allreduce(torch.ones(3, dtype=torch.bool), Op.AVG, world_size=2)
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


def test_one_element_strided_tensor_moves_as_bytes() -> None:
    # shape (1,) with stride 2 counts as contiguous, but viewing it as bytes needs stride 1
    t = torch.arange(4.0).reshape(2, 2)[:1, 1]
    assert t.is_contiguous() and t.stride() == (2,)
    plan = collectives.allgather(torch.zeros(2), t, rank=0, world_size=2)
    [(_, src)] = plan.sources
    assert src.dtype == torch.uint8 and src.numel() == 4 and src.view(torch.float32).item() == 1.0
    plan = collectives.broadcast(t, root=1, rank=0, world_size=2)
    [(_, dst)] = plan.sinks
    dst.view(torch.float32).fill_(9.0)
    assert t.item() == 9.0  # written in place


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
