"""The door to hfreduce's compiled reduce kernels, and the torch reference they must match.

:func:`reduce` computes ``out = finish(((inputs[0] op inputs[1]) op inputs[2]) op ...)`` on
contiguous CPU tensors in one pass over memory: each input is read once, out is written
once, and the work runs in C with the GIL released (``fireflyer.hfreduce._core``, SIMD
kernels chosen at import by CPU feature). :func:`reference_reduce` is the same arithmetic
as torch ops, built on :class:`~fireflyer.hfreduce.plans.plan.Reducer` exactly as the engine
calls it; it is the fallback where the extension did not build, and the oracle of the
differential tests.

The arithmetic (``plans/plan.py``'s rules): inputs share one dtype; fp16, bf16 and fp8
accumulate in fp32 and everything else in its own dtype. ``out`` is either the input
dtype (the accumulation is rounded once at the end, to nearest even, as ``Tensor.to``
rounds) or the accumulation dtype (a partial on its way to other nodes, not rounded).
``divisor > 0`` is AVG's finish: the complete accumulation is divided by it (a true
division, as ``acc.div_(world_size)`` is) before rounding. Integers wrap; bool is a flag
(SUM/MAX: or, PRODUCT/MIN: and). COPY ORs the inputs' bytes (one contributor per element).

Where torch itself is not consistent, the core follows one rule, the same bits on every
ISA, and the differential tests compare those elements by value class only:

* NaN: any element whose result is NaN may carry any NaN payload and sign (torch's
  vectorized body and scalar tail choose different ones). MIN and MAX give all bits set
  for a NaN from any input, on every ISA. A sum or product of NaNs carries one operand's
  payload, which one depends on the operand order the compiled code picked (so it may
  differ between ISAs). Rounding keeps a NaN's sign and top payload bits and makes it
  quiet (fp8: torch's codes, 0x7F with the sign).
* Zero: MIN and MAX merge equal values' bits, so ``min(-0, +0) = -0`` and
  ``max(-0, +0) = +0`` whatever the order (torch's result depends on the order and on
  the code path); a zero from MIN or MAX is compared as zero, either sign.

Every other element is bitwise equal to the reference: sums, products, division and
every rounding (including subnormals, ties, overflow to inf and fp8 saturation).

``FIREFLYER_HFREDUCE_CORE=0`` forces the reference; ``FIREFLYER_HFREDUCE_ISA=avx512|avx2|
portable`` asks for a lower instruction set; :func:`set_isa` does both at run time (tests).
"""

from __future__ import annotations

import logging
import threading

import torch

from fireflyer.hfreduce import env
from fireflyer.hfreduce.config import read
from fireflyer.hfreduce.compiled import CORE as _core
from fireflyer.hfreduce.compiled import MISSING as _core_missing
from fireflyer.hfreduce.plans.plan import DTYPES, LOW_PRECISION, Op, Reducer, acc_dtype, check_dtype, check_op
from fireflyer.errors import UserError

log = logging.getLogger(__name__)

ISAS = ("avx512", "avx2", "portable")  # best first
REFERENCE = "reference"


if _core is not None and _core.isa_note:
    log.warning("hfreduce core: %s", _core.isa_note)

_state = threading.local()
_lock = threading.Lock()
# FIREFLYER_HFREDUCE_CORE=0 switches the compiled kernels off from the start, as it does the
# engine's compiled node stage (HFReduceConfig.core); the ISA choice is the C module's own.
_use_reference = read(env.CORE, "1") == "0"
_warned = False


def available() -> bool:
    """Whether :func:`reduce` runs the compiled core (built, and not switched off)."""
    return _core is not None and not _use_reference


def isa() -> str:
    """The kernels :func:`reduce` runs now: 'avx512', 'avx2', 'portable' or 'reference'."""
    return _core.isa() if available() else REFERENCE


def supported_isas() -> list[str]:
    """Every compiled instruction set this machine can run, best first; empty without the core."""
    if _core is None:
        return []
    return list(ISAS[ISAS.index(_core.best_isa()):])


def set_isa(name: str | None) -> str:
    """Run ``name``'s kernels from now on ('reference' for the torch path); returns the previous one.

    ``None`` goes back to the default: the environment's choice, else the best. For tests
    and benchmarks; not thread-safe against concurrent :func:`reduce` callers' expectations.
    """
    global _use_reference
    previous = isa()
    if name is None:
        name = _default_isa()
    if name == REFERENCE:
        _use_reference = True
        return previous
    if name not in ISAS:
        raise UserError(f"unknown kernel set {name!r}; choose one of {', '.join(ISAS + (REFERENCE,))}")
    if _core is None:
        raise UserError(f"hfreduce's compiled core is not available: {_core_missing}; only 'reference' runs")
    _core.set_isa(name)  # ValueError names the best this CPU has
    _use_reference = False
    return previous


def _default_isa() -> str:
    if read(env.CORE, "1") == "0" or _core is None:
        return REFERENCE
    want = read(env.ISA, "")
    return want if want in supported_isas() else _core.best_isa()


def reduce(out: torch.Tensor, inputs: list[torch.Tensor], op: Op, *, divisor: int = 0, tree: bool = False) -> None:
    """``out = finish(inputs[0] op inputs[1] op ...)``, in list order, in one pass.

    ``tree``: a float SUM, AVG or PRODUCT combines the inputs in the left-balanced pairwise tree
    over their indices (the canonical order, ``plans/canonical.py``), in blocks that keep every partial
    in the CPU's first-level cache, so memory still sees each input read once.

    ``out`` may be one of the inputs (the same tensor) but must not overlap them otherwise.
    Falls back to :func:`reference_reduce`, with a one-line warning, where the core is missing.
    """
    op = Op(op)
    n = _check(out, inputs, op, divisor)
    if not available():
        _warn_fallback()
        reference_reduce(out, inputs, op, divisor=divisor, tree=tree)
        return
    _core.reduce(out.data_ptr(), DTYPES[out.dtype], [t.data_ptr() for t in inputs], DTYPES[inputs[0].dtype],
                 n, int(op), divisor, tree)


def reference_reduce(out: torch.Tensor, inputs: list[torch.Tensor], op: Op, *, divisor: int = 0,
                     reducer: Reducer | None = None, tree: bool = False) -> None:
    """What :func:`reduce` computes, as the engine's torch ops (``Reducer``) compute it.

    ``out`` must not be ``inputs[k]`` for k >= 2 when it is in the accumulation dtype
    (torch writes it before reading that input).
    """
    op = Op(op)
    n = _check(out, inputs, op, divisor)
    out, inputs = out.view(-1), [t.view(-1) for t in inputs]  # flat, so no two shapes broadcast
    reducer = reducer if reducer is not None else _reducer()
    finish_op = Op.SUM if op == Op.AVG and not divisor else op
    if out.dtype == acc_dtype(inputs[0].dtype, op):
        reducer.reduce_into(out, inputs, op, tree=tree)
        if divisor:
            reducer.finish(out, out, Op.AVG, divisor)
    else:  # low precision rounded into its own dtype: accumulate in fp32, round once
        work = reducer.acc_scratch(n)
        reducer.reduce_into(work, inputs, op, tree=tree)
        reducer.finish(out, work, finish_op, divisor)


def round_into(out: torch.Tensor, acc: torch.Tensor, *, divisor: int = 0) -> None:
    """``out = (acc / divisor).to(out.dtype)`` for a contiguous fp32 ``acc`` and a low-precision ``out``
    (fp16, bf16, fp8): the tree root's finish of a partial sum, rounded once to nearest even."""
    if acc.dtype != torch.float32 or out.dtype not in LOW_PRECISION or out.numel() != acc.numel() or \
            not out.is_contiguous() or not acc.is_contiguous() or out.is_cuda or acc.is_cuda:
        raise UserError(f"round_into takes a contiguous CPU fp32 accumulation and a low-precision output of its "
                         f"size, got {acc.dtype} {tuple(acc.shape)} into {out.dtype} {tuple(out.shape)}")
    if divisor < 0:
        raise UserError(f"divisor must be 0 (none) or positive, got {divisor}")
    if not available():
        _warn_fallback()
        reference_round(out, acc, divisor=divisor)
        return
    _core.round(out.data_ptr(), DTYPES[out.dtype], acc.data_ptr(), acc.numel(), divisor)


def reference_round(out: torch.Tensor, acc: torch.Tensor, *, divisor: int = 0) -> None:
    """What :func:`round_into` computes, as the engine's torch ops do it (``Reducer.finish``); ``acc`` is kept."""
    _reducer().finish(out, acc.clone(), Op.AVG if divisor else Op.SUM, divisor)


def _reducer() -> Reducer:
    r = getattr(_state, "reducer", None)
    if r is None:
        r = _state.reducer = Reducer()
    return r


def _warn_fallback() -> None:
    global _warned
    with _lock:
        if _warned:
            return
        _warned = True
    if _core is None:
        log.warning("hfreduce core: the compiled kernels are unavailable (%s); reducing with torch ops", _core_missing)


def _check(out: torch.Tensor, inputs: list[torch.Tensor], op: Op, divisor: int) -> int:
    """Refuse what the kernels cannot take, saying what to pass instead; returns the element count."""
    if not inputs:
        raise UserError("hfreduce reduce needs at least one input tensor")
    dtype, n = inputs[0].dtype, inputs[0].numel()
    check_dtype(dtype)
    if op != Op.COPY:
        check_op(op, dtype)
    for t in (out, *inputs):
        if t.device.type != "cpu":
            raise UserError(f"hfreduce reduce runs on CPU tensors, got one on {t.device}; stage it to host memory")
        if not t.is_contiguous():
            raise UserError("hfreduce reduce needs contiguous tensors; pass t.contiguous()")
    for t in inputs:
        if t.dtype != dtype or t.numel() != n:
            raise UserError(
                f"hfreduce reduce inputs must share one dtype and size: {dtype}[{n}] vs {t.dtype}[{t.numel()}]"
            )
    acc = acc_dtype(dtype, op)
    if out.dtype not in (dtype, acc) or out.numel() != n:
        want = dtype if acc == dtype else f"{dtype} or {acc}"
        raise UserError(f"hfreduce reduce out must be {want} with {n} elements, got {out.dtype}[{out.numel()}]")
    if not isinstance(divisor, int) or divisor < 0:
        raise UserError(f"divisor must be an int >= 0, got {divisor!r}")
    if divisor and op != Op.AVG:
        raise UserError(f"divisor is AVG's finish; {op.name} takes none (pass divisor=0)")
    return n
