"""Exact sums of squares: a gradient norm with the same bits on every layout.

The canonical order (:mod:`fireflyer.hfreduce.plans.canonical`) fixes the order of a sum by the terms'
global indices. A gradient norm cannot use it when the parameters are sharded (FSDP, tensor or
expert parallel): each rank holds different pieces, so the order of a float sum of squares moves
with the layout. This module does not fix the order; it makes the order irrelevant. The sum is
*exact*, and its result is the true sum of squares rounded once, so any order and any split into
tensors, chunks or ranks gives the same float.

How. A square is an integer significand times a power of two. :class:`SquareSum` cuts each
significand into integer pieces and adds each piece into the int64 *bin* of its power of two.
Integer addition is associative, so the bins do not depend on the order; at the end Python's
integers join them into one exact number, and one correctly rounded division makes it a float.

* **fp32, bf16, fp16, fp8** widen to fp64, where their square is exact (a significand of at most
  24 bits squares to at most 48 of fp64's 53). The square's 53-bit significand ``2**52 + frac``
  weighs ``2**(F - 1075)``, ``F`` its exponent field; its low 29 bits go to bin ``F`` and its top 24
  to bin ``F + 29`` of the *fp32 region*.
* **fp64** squares are not exact in fp64, so they stay integers throughout: the significand ``m``
  (53 bits) is cut into three 18-bit limbs ``A, B, C`` and ``m*m`` is the five products ``A*A,
  2*A*B, B*B + 2*A*C, 2*B*C, C*C``, each below ``2**37``, 18 bits apart, added into the *fp64 region*
  (bins two bits apart: fp64 squares only have even exponents).

Every step is a vectorised op on a chunk (a float conversion and multiply, shifts, masks,
``scatter_add_``); no float ever rounds. The regions cover every square of their dtypes, so the
bins have one layout whatever a rank added, and ranks can sum them.

**Bounds.** A piece is below ``2**29`` (fp32 region) or ``2**37`` (fp64 region), and each element
puts at most one piece in any bin, so a bin grows by at most that per element. Before a bin could
pass ``2**63`` the sum *normalises*: it carries each bin's bits above the 24th into the bin 24 bits
up, which keeps the value and leaves every bin at most ``2**24``. So one process may add any number
of elements. :attr:`SquareSum.bins` is always normalised, and an int64 SUM of it over ``R`` ranks
stays below ``R * 2**24``: exact for any ``R`` below ``2**39``.

**inf and nan.** As with ``torch.linalg.vector_norm``: any nan makes the total nan, else any inf
makes it inf. Each rank records "saw a nan" and "saw an inf" in two slots of its bins, which the
same SUM carries. An fp64 sum past the largest double is inf.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from fractions import Fraction

import torch

from fireflyer.errors import UsageError, UserError, UserTypeError

FP32_BINS = 2176
"""fp32 region: bin ``k`` weighs ``2 ** (k - 1075)``; it holds exponent fields 0..2047 (fp32 squares use
777..1330), their high pieces 29 bins up, and the carries of a normalisation."""
FP64_BINS = 2200
"""fp64 region: bin ``j`` weighs ``4 ** (j - 1074)``; the last weighs ``4 ** 1125``, above any sum of
``2**64`` fp64 squares (below ``4 ** 1056``) with the carries of a normalisation."""
NAN_SLOT = FP32_BINS + FP64_BINS
"""After an all-reduce: how many ranks saw a nan."""
INF_SLOT = NAN_SLOT + 1
"""After an all-reduce: how many ranks saw an inf."""
BINS = INF_SLOT + 1
"""The length of :attr:`SquareSum.bins`, whatever was added."""
CHUNK = {"cpu": 1 << 17, "cuda": 1 << 21}
"""Elements per vectorised step: cache-sized on a CPU, launch-amortising on a GPU (4 words of buffers each)."""

_INT64_MAX = (1 << 63) - 1
_CARRY = 24  # a normalised bin holds at most 2**24; a carry moves 24 bits up
_MASK24 = (1 << _CARRY) - 1
_FP32_LO = 29  # the low piece of an fp32 square's significand: 29 bits, below 2**29
_FP32_TRASH = _FP32_LO  # where a zero's high piece (exponent field 0) lands: cleared, as no square and
# no carry lands there (fp32 squares have fields from 777 up; bins below hold nothing else)
_FP64_LIMB = 18
_SCALE = 2 * 1074  # both regions as integers over 2**2148
_VIA_FP64 = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


def supported(dtype: torch.dtype) -> bool:
    """Whether :meth:`SquareSum.add` takes tensors of ``dtype``."""
    return dtype == torch.float64 or dtype in _VIA_FP64


class SquareSum:
    """The exact sum of squares of every element of every tensor added, on one device.

    ``s.add(t)`` for each local tensor (any shape; fp32, bf16, fp16, fp8 or fp64); then, across ranks,
    ``dist.all_reduce(s.bins, group=...)`` (int64 SUM: exact, so any reduction order gives the same
    bins); then :meth:`total` or :meth:`norm`. Every element of the global set must be added on exactly
    one rank: a replicated tensor is added by one of its holders only.

    Reading :attr:`bins` (or the total) closes the sum to further adds, so bins that have been
    all-reduced are never added to again: start a new ``SquareSum`` for the next step.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = _resolved(torch.device(device))
        self._bins = torch.zeros(BINS, dtype=torch.int64, device=self.device)
        self._fp32 = self._bins[:FP32_BINS]
        self._fp32_hi = self._fp32[_FP32_LO:]
        self._fp64 = self._bins[FP32_BINS:NAN_SLOT]
        self._max = torch.zeros((), dtype=torch.float64, device=self.device)  # of x*x or |x|: nan if any nan
        self._chunk = CHUNK.get(self.device.type, CHUNK["cuda"])
        self._work: dict[str, torch.Tensor] = {}
        self._load = 0  # a bound on every bin
        self._sealed = False
        self.count = 0
        """Elements added here (this rank's, not the group's)."""

    def add(self, tensor: torch.Tensor) -> None:
        """Add the squares of every element of ``tensor`` (on this sum's device; no gradient is tracked)."""
        if self._sealed:
            raise UsageError("this SquareSum's bins were already read (for an all-reduce or a total); "
                             "start a new SquareSum for the next sum")
        flat = _checked(tensor, self.device).detach().reshape(-1)
        kernel = self._add_fp64 if flat.dtype == torch.float64 else self._add_via_fp64
        for start in range(0, flat.numel(), self._chunk):
            kernel(flat[start:start + self._chunk])
        self.count += flat.numel()

    @property
    def bins(self) -> torch.Tensor:
        """The int64 tensor of :data:`BINS` elements to all-reduce with SUM (in place: the sum reads it back).

        Normalised: every bin is at most ``2**24``; the last two slots say whether this rank saw a nan
        and an inf. Reading it closes the sum to :meth:`add`.
        """
        if not self._sealed:
            self._bins[NAN_SLOT:].copy_(torch.stack([self._max.isnan(), self._max.isinf()]))
            self._sealed = True
        self._normalise()
        return self._bins

    def exact(self) -> Fraction | float:
        """The sum of squares as an exact fraction (a power of two below), or ``math.nan`` / ``math.inf``."""
        values = self.bins.tolist()
        if values[NAN_SLOT]:
            return math.nan
        if values[INF_SLOT]:
            return math.inf
        scaled = sum(v << (k + _SCALE - 1075) for k, v in enumerate(values[:FP32_BINS]) if v)
        scaled += sum(v << (2 * j) for j, v in enumerate(values[FP32_BINS:NAN_SLOT]) if v)
        return Fraction(scaled, 1 << _SCALE)

    def total(self) -> float:
        """The sum of squares, correctly rounded to a float (nan or inf as the module says)."""
        value = self.exact()
        try:
            return float(value)  # a Fraction divides its integers: correctly rounded, to subnormals too
        except OverflowError:
            return math.inf

    def norm(self) -> float:
        """``math.sqrt`` of :meth:`total`: the 2-norm, a function of the exact sum alone."""
        return math.sqrt(self.total())

    # -- the kernels -------------------------------------------------------------------------------

    def _add_via_fp64(self, chunk: torch.Tensor) -> None:
        n = chunk.numel()
        self._reserve(n, 1 << _FP32_LO)
        square = self._buffer("square", n, torch.float64).copy_(chunk)
        square.mul_(square)  # exact
        torch.maximum(self._max, square.max(), out=self._max)
        bits = square.view(torch.int64)
        field = torch.bitwise_right_shift(bits, 52, out=self._buffer("field", n, torch.int64))
        field.bitwise_and_(0x7FF)  # a nan's sign bit, if it has one
        lo = torch.bitwise_and(bits, (1 << _FP32_LO) - 1, out=self._buffer("lo", n, torch.int64))
        hi = torch.bitwise_and(bits, (1 << 52) - 1, out=self._buffer("hi", n, torch.int64))
        hi.bitwise_or_(1 << 52).bitwise_right_shift_(_FP32_LO)  # the implicit bit; a zero's lands in the trash
        self._fp32.scatter_add_(0, field, lo)
        self._fp32_hi.scatter_add_(0, field, hi)

    def _add_fp64(self, chunk: torch.Tensor) -> None:
        self._reserve(chunk.numel(), 1 << (2 * _FP64_LIMB + 1))
        a = chunk.view(torch.int64) & 0x7FFF_FFFF_FFFF_FFFF
        torch.maximum(self._max, a.view(torch.float64).max(), out=self._max)
        field = a >> 52
        where = field.clamp_min(1) - 1  # x*x = m*m * 4**(max(field, 1) - 1075): bin max(field, 1) - 1
        m = a - (where << 52)  # the significand: the field, less the implicit bit of a normal number
        c = m & ((1 << _FP64_LIMB) - 1)
        b = (m >> _FP64_LIMB) & ((1 << _FP64_LIMB) - 1)
        a = m >> (2 * _FP64_LIMB)
        # m*m = AA 2**72 + 2AB 2**54 + (BB + 2AC) 2**36 + 2BC 2**18 + CC; 18 bits apart = 9 bins
        for offset, piece in ((0, c * c), (9, 2 * b * c), (18, b * b + 2 * a * c), (27, 2 * a * b), (36, a * a)):
            self._fp64.scatter_add_(0, where + offset, piece)

    def _reserve(self, n: int, piece: int) -> None:
        """Make room for ``n`` more pieces below ``piece`` in any one bin."""
        if self._load + n * piece > _INT64_MAX:
            self._normalise()
        self._load += n * piece

    def _normalise(self) -> None:
        """Carry each bin's bits above the 24th 24 bits up: the same value, every bin at most 2**24.

        From bins below 2**63: after one round a bin is below 2**24 + 2**39, after two below
        2**24 + 2**15 + 1, after three at most 2**24 (a carry of at most one onto 2**24 - 1)."""
        self._fp32[_FP32_TRASH] = 0
        for region, step in ((self._fp32, _CARRY), (self._fp64, _CARRY // 2)):
            for _ in range(3):
                carry = region >> _CARRY
                region.bitwise_and_(_MASK24)
                region[step:] += carry[:-step]
        self._load = 1 << _CARRY

    def _buffer(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._work.get(name)
        if buf is None or buf.numel() < n:
            buf = self._work[name] = torch.empty(n, dtype=dtype, device=self.device)
        return buf[:n]


def exact_norm(tensors: Iterable[torch.Tensor | None], group=None, *,
               device: torch.device | str | None = None) -> float:
    """The 2-norm of every element of ``tensors``, exact before its one rounding: the same on every layout.

    ``None`` entries (parameters without a gradient) are skipped. With ``group`` (a process group;
    ``dist.group.WORLD`` for every rank) the bins are all-reduced over it: every rank of it calls
    this, each with the tensors it alone holds. ``device`` is where the bins live when a rank has no
    tensor (for NCCL, its GPU); by default the first tensor's.
    """
    tensors = [t for t in tensors if t is not None]
    if device is None:
        device = tensors[0].device if tensors else "cpu"
    s = SquareSum(device)
    for t in tensors:
        s.add(t)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(s.bins, op=dist.ReduceOp.SUM, group=group)
    return s.norm()


def _resolved(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _checked(tensor: object, device: torch.device) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise UserTypeError(f"SquareSum adds tensors, got {type(tensor).__name__}")
    if _is_dtensor(tensor):
        raise UserTypeError("SquareSum adds local tensors: pass a DTensor's .to_local() on each rank that owns "
                            "a shard of it (a replicated DTensor on one of its ranks only)")
    if tensor.layout != torch.strided:
        raise UserTypeError(f"SquareSum adds dense tensors, got a {tensor.layout} one; add its values instead")
    if not supported(tensor.dtype):
        raise UserTypeError(f"SquareSum adds float32, float64, bfloat16, float16 and fp8 tensors, got {tensor.dtype}")
    if _resolved(tensor.device) != device:
        raise UserError(f"the tensor is on {tensor.device} but this SquareSum's bins are on {device}; "
                        "use one SquareSum per device, or move the tensor")
    return tensor


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(t, DTensor)
