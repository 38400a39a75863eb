"""What a collective is, and the arithmetic on chunks: dtypes, ops, accumulation and rounding.

Pure tensor code, no I/O. Sums and products of fp16, bf16 and fp8 accumulate in fp32
and are rounded once, at the very end; the order of every reduction is fixed by the
topology, so results are bitwise reproducible.

Integers reduce in their own dtype and wrap on overflow, as torch and gloo do. The
bitwise ops take integers and bool only. bool is a flag: SUM and MAX are "any" (or),
PRODUCT and MIN are "all" (and), so every result is a real 0/1 bool, as torch's
``a + b`` and NCCL give (gloo sums bools as bytes and can return 2 or wrap to 0).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Callable
from enum import IntEnum

import torch
from fireflyer.errors import UserError, UserTypeError


class Op(IntEnum):
    SUM = 0
    AVG = 1
    MIN = 2
    MAX = 3
    COPY = 4  # internal: every element has exactly one contributor (allgather, broadcast)
    PRODUCT = 5
    BAND = 6  # bitwise and/or/xor: integer and bool dtypes only
    BOR = 7
    BXOR = 8


class Kind(IntEnum):
    ALLREDUCE = 0
    REDUCE_SCATTER = 1
    ALLGATHER = 2
    BROADCAST = 3
    BARRIER = 4
    REDUCE = 5
    ALL_TO_ALL = 6  # one node, through the arena (node_all_to_all.py)


# The wire code of each dtype (Descriptor.pack); codes are fixed, the order is how errors list them.
DTYPES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
    torch.float8_e4m3fn: 5,
    torch.float8_e5m2: 6,
    torch.int8: 10,
    torch.int16: 11,
    torch.int32: 7,
    torch.int64: 8,
    # uint8 is also the dtype of allgather and broadcast, which move any dtype as raw bytes
    # (with Op.COPY); their Kind tells those apart from a reduction of real uint8 data.
    torch.uint8: 9,
    torch.bool: 12,
}
REDUCIBLE = list(DTYPES)
INTEGRAL = [d for d in REDUCIBLE if not d.is_floating_point]  # what the bitwise ops take (bool included)
_DTYPE_BY_CODE = {v: k for k, v in DTYPES.items()}
# Stands in for a dtype code this version does not know (a peer running another version),
# so a mismatch message can still be printed; it is no dtype hfreduce reduces.
UNKNOWN_DTYPE = torch.bits8
LOW_PRECISION = {torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}
FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}
USER_OPS = (Op.SUM, Op.AVG, Op.MIN, Op.MAX, Op.PRODUCT, Op.BAND, Op.BOR, Op.BXOR)
BITWISE = (Op.BAND, Op.BOR, Op.BXOR)
# bool is a flag, not a number: each op on it is the logical op that keeps it 0 or 1.
_BOOL_OP = {Op.SUM: Op.BOR, Op.MAX: Op.BOR, Op.PRODUCT: Op.BAND, Op.MIN: Op.BAND}


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def supported_dtypes() -> str:
    return _names(REDUCIBLE)


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in REDUCIBLE:
        raise UserTypeError(f"hfreduce does not support dtype {dtype}; supported: {supported_dtypes()}")


def check_op(op: Op, dtype: torch.dtype) -> None:
    """Refuse an op the dtype cannot take, saying what to use instead. ``dtype`` is already checked."""
    if op not in USER_OPS:
        names = ", ".join(o.name for o in USER_OPS)
        raise UserError(f"hfreduce cannot reduce with op {op.name}; supported: {names}")
    if op == Op.AVG and not dtype.is_floating_point:
        fix = "use MAX for any or MIN for all" if dtype == torch.bool else "use SUM and divide yourself"
        raise UserError(f"hfreduce AVG needs a floating-point dtype, got {dtype}; {fix}")
    if op in BITWISE and dtype.is_floating_point:
        raise UserTypeError(
            f"hfreduce {op.name} is a bitwise op and takes integer and bool dtypes only ({_names(INTEGRAL)}), "
            f"got {dtype}; to combine a float tensor's bits, reduce a view of it as the integer dtype of the same "
            f"size, such as t.view(torch.int32) for float32"
        )


def acc_dtype(dtype: torch.dtype, op: Op) -> torch.dtype:
    """The dtype partial results are kept in on their way through the node and the trees."""
    if op == Op.COPY:
        return dtype
    return torch.float32 if dtype in LOW_PRECISION else dtype


@dataclass(frozen=True)
class Descriptor:
    """What a rank believes the current collective is. Every rank must agree, or the collective fails."""

    kind: Kind
    dtype: torch.dtype
    numel: int
    op: Op
    root: int = -1

    _PACK = struct.Struct("<BBBxqi")

    def pack(self) -> bytes:
        return self._PACK.pack(int(self.kind), DTYPES[self.dtype], int(self.op), self.numel, self.root)

    @classmethod
    def unpack(cls, data: bytes) -> "Descriptor":
        kind, dtype, op, numel, root = cls._PACK.unpack(data)
        return cls(Kind(kind), _DTYPE_BY_CODE.get(dtype, UNKNOWN_DTYPE), numel, Op(op), root)

    def __str__(self) -> str:
        name = self.kind.name.lower()
        dtype = str(self.dtype).replace("torch.", "") if self.dtype in DTYPES else "unknown-dtype"
        extra = f", root={self.root}" if self.kind in (Kind.BROADCAST, Kind.REDUCE) else ""
        op = f", {self.op.name}" if self.kind in (Kind.ALLREDUCE, Kind.REDUCE_SCATTER, Kind.REDUCE) else ""
        return f"{name}({dtype}[{self.numel}]{op}{extra})"


DESCRIPTOR_BYTES = Descriptor._PACK.size


@dataclass
class Plan:
    """One rank's part in one collective over a flat buffer of ``desc.numel`` elements.

    ``sources`` are (offset, flat tensor) pieces this rank contributes; ``sinks`` are the
    pieces of the result it wants back. ``owners`` lists (lo, hi, rank) for collectives
    where every element has exactly one contributor.
    """

    desc: Descriptor
    sources: list[tuple[int, torch.Tensor]]
    sinks: list[tuple[int, torch.Tensor]]
    owners: list[tuple[int, int, int]] | None = None
    world_size: int = 1
    on_done: list = field(default_factory=list)
    result: object = None
    timeout: float | None = None  # seconds this collective may take; None: the communicator's timeout
    trace: tuple | None = None  # (input sizes, input dtypes, output sizes, output dtypes) as the caller passed them
    seq: int = -1  # set by the communicator at submission: the collective's number in its group
    run: Callable[[Any], None] | None = None  # runs the job itself instead of the stages (node_all_to_all.py)

    @property
    def dense(self) -> bool:
        return self.owners is None


def chunk_elems(chunk_bytes: int, dtype: torch.dtype, op: Op, *, red_bytes: int | None = None) -> int:
    """Elements per chunk: a chunk of data fills ``chunk_bytes``; when partial sums live
    in the arena (several nodes), they must also fit a ``red_bytes`` buffer."""
    n = chunk_bytes // dtype.itemsize
    if red_bytes is not None:
        n = min(n, red_bytes // acc_dtype(dtype, op).itemsize)
    return max(1, n)


class Reducer:
    """Combines chunk slices. Holds the fp32 scratch that low-precision dtypes need."""

    def __init__(self) -> None:
        self._acc: torch.Tensor | None = None
        self._conv: torch.Tensor | None = None

    def acc_scratch(self, n: int) -> torch.Tensor:
        """fp32 working space for one slice; owned by this reducer (one per thread)."""
        self._acc = _grown(self._acc, n)
        return self._acc[:n]

    def _tmp(self, n: int) -> torch.Tensor:
        """fp32 space to convert one input into, apart from the accumulator."""
        self._conv = _grown(self._conv, n)
        return self._conv[:n]

    def combine(self, acc: torch.Tensor, other: torch.Tensor, op: Op) -> None:
        """acc = acc (op) other, in place. ``acc`` is in the accumulation dtype."""
        if other.dtype != acc.dtype and (other.dtype in FP8 or op not in _MIXED_OK):
            tmp = self._tmp(other.numel())
            tmp.copy_(other)  # exact: every low-precision value is an fp32 value
            other = tmp
        if op == Op.COPY:
            _bits(acc).bitwise_or_(_bits(other))
        else:
            _binary(op, acc.dtype)(acc, other, out=acc)

    def reduce_into(self, out: torch.Tensor, inputs: list[torch.Tensor], op: Op, *, tree: bool = False) -> None:
        """out = inputs[0] (op) inputs[1] (op) ..., in this order, each input read once.

        ``tree``: a float SUM, AVG or PRODUCT of four or more inputs combines them in the
        left-balanced pairwise tree over their indices instead (``plans/canonical.py``; up to three
        inputs the list order is that tree, and the other ops are associative)."""
        if tree and len(inputs) > 3 and op in _MIXED_OK and inputs[0].dtype.is_floating_point:
            out.copy_(_tree(op, [t if t.dtype == out.dtype else t.to(out.dtype) for t in inputs]))
            return
        first = inputs[0]
        if out.dtype == first.dtype and len(inputs) >= 2 and op != Op.COPY:
            _binary(op, out.dtype)(first, inputs[1], out=out)
            rest = inputs[2:]
        elif op == Op.COPY:
            _bits(out).copy_(_bits(first))  # bit for bit, whatever the bytes (a bool copy would make them 0/1)
            rest = inputs[1:]
        else:
            out.copy_(first)
            rest = inputs[1:]
        for x in rest:
            self.combine(out, x, op)

    def finish(self, out: torch.Tensor, acc: torch.Tensor, op: Op, world_size: int) -> None:
        """Turn a complete accumulation into the result: divide for AVG, round once into ``out``.

        Every other op is complete once combined; a low-precision one (fp32 accumulator)
        is rounded here, once."""
        if op == Op.AVG:
            acc.div_(world_size)
        if op == Op.COPY:
            if out.data_ptr() != acc.data_ptr():
                _bits(out).copy_(_bits(acc))
        elif out.data_ptr() != acc.data_ptr() or out.dtype != acc.dtype:
            out.copy_(acc)


# Ops torch computes exactly in the wider dtype when acc is fp32 and the other side is
# fp16/bf16 (fp8 has no mixed-dtype kernels, so it is converted first).
_MIXED_OK = (Op.SUM, Op.AVG, Op.PRODUCT)
_BINARY = {
    Op.SUM: torch.add,
    Op.AVG: torch.add,
    Op.PRODUCT: torch.mul,
    Op.MIN: torch.minimum,
    Op.MAX: torch.maximum,
    Op.BAND: torch.bitwise_and,
    Op.BOR: torch.bitwise_or,
    Op.BXOR: torch.bitwise_xor,
}


def _tree(op: Op, terms: list[torch.Tensor]) -> torch.Tensor:
    """The left-balanced pairwise tree over ``terms`` (already in the accumulation dtype)."""
    if len(terms) == 1:
        return terms[0]
    m = 1 << ((len(terms) - 1).bit_length() - 1)
    return _binary(op, terms[0].dtype)(_tree(op, terms[:m]), _tree(op, terms[m:]))


def _binary(op: Op, dtype: torch.dtype):
    """The elementwise torch function for ``op`` on ``dtype``, called as ``fn(a, b, out=...)``."""
    if dtype == torch.bool:
        op = _BOOL_OP.get(op, op)
    try:
        return _BINARY[op]
    except KeyError:  # pragma: no cover - guarded by check_op
        raise AssertionError(op) from None


def _grown(buf: torch.Tensor | None, n: int) -> torch.Tensor:
    return buf if buf is not None and buf.numel() >= n else torch.empty(max(n, 1 << 16), dtype=torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as an integer tensor, for exact bitwise merging."""
    if t.dtype.itemsize == 8:
        return t.view(torch.int64)
    if t.dtype.itemsize == 4:
        return t.view(torch.int32)
    if t.dtype.itemsize == 2:
        return t.view(torch.int16)
    return t.view(torch.uint8)
