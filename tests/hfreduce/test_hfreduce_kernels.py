"""The compiled reduce kernels against the torch reference, bit for bit, on every ISA this CPU has.

Elements whose result is NaN are compared as NaN, and zeros from MIN/MAX as zero (either
sign); every other element must have the reference's exact bits (kernels.py says why).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fireflyer.hfreduce.engine import kernels
from fireflyer.hfreduce.plans.plan import DTYPES, LOW_PRECISION, Op, acc_dtype

ISAS = kernels.supported_isas()
needs_core = pytest.mark.skipif(not ISAS, reason="hfreduce's compiled core is not built here")

FLOATS = [d for d in DTYPES if d.is_floating_point]
INTS = [d for d in DTYPES if not d.is_floating_point and d != torch.bool]
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
SIZES = [0, 1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 97, 127, 128, 129, 251, 257, 1021,
         1024, 1025, 2053, 4099]


def _ops(dtype: torch.dtype) -> list[Op]:
    ops = [Op.SUM, Op.MIN, Op.MAX, Op.PRODUCT, Op.COPY]
    return ops + ([Op.AVG] if dtype.is_floating_point else [Op.BAND, Op.BOR, Op.BXOR])


@pytest.fixture(autouse=True)
def _restore_isa():
    before = kernels.isa()
    yield
    kernels.set_isa(before)


# -- values ----------------------------------------------------------------------------


def _specials(dtype: torch.dtype) -> torch.Tensor:
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.tensor(sorted({info.min, info.max, 0, 1, info.max // 2, info.min + 1, -1 if info.min else 2}),
                            dtype=dtype)
    fi = torch.finfo(dtype)
    vals = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), fi.max, -fi.max, fi.tiny, -fi.tiny,
            fi.tiny / 2, fi.smallest_normal * fi.eps, fi.eps, 1.0, -1.0, 1.0 + fi.eps / 2]
    if dtype in FP8:  # saturation and rounding edges
        vals += [448.0, 464.0, 480.0, -464.0, 57344.0, 61439.0, 61440.0, 2.0**-9, 2.0**-16, 2.0**-17]
    return torch.tensor(vals, dtype=torch.float64).to(dtype)


def _random_bits(dtype: torch.dtype, n: int, g: torch.Generator) -> torch.Tensor:
    size = dtype.itemsize
    lo, hi = (0, 256) if size == 1 else (-(2 ** (8 * size - 1)), 2 ** (8 * size - 1) - 1)
    return torch.randint(lo, hi, (n,), generator=g, dtype=_BITS[size]).view(dtype)


def _values(dtype: torch.dtype, n: int, g: torch.Generator, special: float, scale: int) -> torch.Tensor:
    """Mostly ordinary values of the dtype, with a fraction of special values and raw bit patterns."""
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if not dtype.is_floating_point:
        x = _random_bits(dtype, n, g)
    else:
        x = (torch.randn(n, generator=g, dtype=torch.float64) * 2.0**scale).to(dtype)
    if not special or not n:
        return x
    bits, sp = _bits(x), _bits(_specials(dtype))  # torch.where has no fp8 kernels: pick among bit patterns
    bits = torch.where(torch.rand(n, generator=g) < special, sp[torch.randint(0, len(sp), (n,), generator=g)], bits)
    if dtype.is_floating_point:
        bits = torch.where(torch.rand(n, generator=g) < special / 2, _bits(_random_bits(dtype, n, g)), bits)
    return bits.view(dtype)


def _at_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
    """The same values in a fresh buffer, ``offset`` elements into it (a misaligned view)."""
    base = torch.zeros(t.numel() + offset, dtype=t.dtype)
    view = base[offset:]
    view.copy_(t) if t.dtype != torch.bool else view.view(torch.uint8).copy_(t.view(torch.uint8))
    return view


# -- comparison ------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.dtype.itemsize])


def assert_same(got: torch.Tensor, want: torch.Tensor, op: Op, what: str = "") -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if not got.dtype.is_floating_point or op == Op.COPY:
        if not torch.equal(_bits(got), _bits(want)):
            bad = (_bits(got) != _bits(want)).nonzero().flatten()[:5].tolist()
            raise AssertionError(f"{what}: differ at {bad}: got {got[bad].tolist()} want {want[bad].tolist()}")
        return
    g, w = got.double(), want.double()
    nan = w.isnan()
    assert torch.equal(g.isnan(), nan), f"{what}: NaN at {(g.isnan() != nan).nonzero().flatten()[:5].tolist()}"
    loose = nan
    if op in (Op.MIN, Op.MAX):
        zero = w == 0
        assert torch.equal(g == 0, zero), f"{what}: zeros differ"
        loose = loose | zero
    bad = ((_bits(got) != _bits(want)) & ~loose).nonzero().flatten()[:5].tolist()
    if bad:
        hexes = [(hex(int(_bits(got)[i]) & 0xFFFFFFFFFFFFFFFF), hex(int(_bits(want)[i]) & 0xFFFFFFFFFFFFFFFF))
                 for i in bad]
        raise AssertionError(f"{what}: differ at {bad}: got {g[bad].tolist()} want {w[bad].tolist()} bits {hexes}")


def check_all_isas(inputs: list[torch.Tensor], op: Op, out_dtype: torch.dtype, divisor: int = 0,
                   out_offset: int = 0, alias: int | None = None) -> None:
    """The reference once, then the core on every ISA (aliased into inputs[alias] when given)."""
    n = inputs[0].numel()
    want = torch.empty(n, dtype=out_dtype)
    kernels.reference_reduce(want, [t.clone() for t in inputs], op, divisor=divisor)
    for name in ISAS:
        kernels.set_isa(name)
        ins = [_at_offset(t, out_offset) if alias is not None else t for t in inputs]
        out = ins[alias] if alias is not None else _at_offset(torch.empty(n, dtype=out_dtype), out_offset)
        kernels.reduce(out, ins, op, divisor=divisor)
        what = f"{name} {op.name} {inputs[0].dtype}->{out_dtype} nin={len(inputs)} n={n} div={divisor} alias={alias}"
        assert_same(out, want, op, what)


# -- differential tests ----------------------------------------------------------------


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(list(DTYPES)))
    op = draw(st.sampled_from(_ops(dtype)))
    acc = acc_dtype(dtype, op)
    out_dtype = draw(st.sampled_from([dtype, acc])) if acc != dtype else dtype
    nin = draw(st.integers(1, 8))
    n = draw(st.one_of(st.sampled_from(SIZES), st.integers(0, 300)))
    offsets = draw(st.lists(st.integers(0, 3), min_size=nin + 1, max_size=nin + 1))
    divisor = draw(st.sampled_from([0, 1, 2, 3, 7, 12])) if op == Op.AVG else 0
    alias = draw(st.one_of(st.none(), st.integers(0, nin - 1))) if out_dtype == dtype else None
    special = draw(st.sampled_from([0.0, 0.03, 0.3]))
    scale = draw(st.sampled_from([0, -6, 6])) if dtype not in FP8 else draw(st.sampled_from([0, -4, 3]))
    seed = draw(st.integers(0, 2**31 - 1))
    return dtype, op, out_dtype, nin, n, offsets, divisor, alias, special, scale, seed


@needs_core
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_core_matches_reference(case) -> None:
    dtype, op, out_dtype, nin, n, offsets, divisor, alias, special, scale, seed = case
    g = torch.Generator().manual_seed(seed)
    if op == Op.COPY:  # one contributor per element: the others hold zero bytes there
        owner = torch.randint(0, nin, (n,), generator=g)
        inputs = []
        for k in range(nin):
            x = _values(dtype, n, g, special, scale)
            inputs.append(torch.where(owner == k, _bits(x), 0).view(dtype) if dtype != torch.bool else x & (owner == k))
    else:
        inputs = [_values(dtype, n, g, special, scale) for _ in range(nin)]
    inputs = [_at_offset(t, o) for t, o in zip(inputs, offsets)]
    check_all_isas(inputs, op, out_dtype, divisor, out_offset=offsets[-1], alias=alias)


@needs_core
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, *FP8], ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("op", [Op.SUM, Op.AVG, Op.MIN, Op.MAX, Op.PRODUCT], ids=lambda o: o.name)
def test_every_low_precision_pair_rounds_like_torch(dtype: torch.dtype, op: Op) -> None:
    """Every bit pattern of the dtype meets a shuffled one (fp8: every pair of patterns):
    widening, and the rounding of fp32 results, ties, subnormals, overflow and saturation."""
    size = dtype.itemsize
    every = torch.arange(256 ** size, dtype=torch.int64).to(_BITS[size])
    if size == 1:
        a, b = every.repeat_interleave(256).view(dtype), every.repeat(256).view(dtype)
    else:
        a = every.view(dtype)
        b = a[torch.randperm(a.numel(), generator=torch.Generator().manual_seed(size))]
    for divisor in ([3, 7] if op == Op.AVG else [0]):  # x/3, x/7: full fp32 mantissas to round
        check_all_isas([a, b], op, dtype, divisor)
    if op == Op.SUM:
        check_all_isas([a, b, a], op, torch.float32)  # the partial: widened exactly, not rounded


@needs_core
@pytest.mark.parametrize("dtype, op", [
    (torch.float32, Op.SUM), (torch.float32, Op.AVG), (torch.float32, Op.MIN), (torch.float32, Op.MAX),
    (torch.bfloat16, Op.SUM), (torch.bfloat16, Op.AVG), (torch.bfloat16, Op.MAX), (torch.float16, Op.AVG),
    (torch.float64, Op.SUM), (torch.float64, Op.MIN), (torch.int32, Op.SUM), (torch.int64, Op.MAX),
], ids=lambda v: v.name if isinstance(v, Op) else str(v).replace("torch.", ""))
def test_large_buffers(dtype: torch.dtype, op: Op) -> None:
    g = torch.Generator().manual_seed(1)
    n = (4 << 20) // dtype.itemsize + 5  # ~4 MiB each, not a whole number of vectors
    reps = -(-n // 4093)  # tiles of a prime length, so no two inputs line up alike
    inputs = [_at_offset(_values(dtype, 4093 + k, g, 0.01, 0).repeat(reps)[:n], k % 3) for k in range(4)]
    out_dtype = acc_dtype(dtype, op) if dtype in LOW_PRECISION and op == Op.SUM else dtype
    check_all_isas(inputs, op, out_dtype, divisor=4 if op == Op.AVG else 0, out_offset=1)


@needs_core
def test_isa_kernels_agree_bit_for_bit_on_min_max() -> None:
    """The MIN/MAX rule where torch is loose is one rule: every ISA gives the same bits.

    (A sum's or product's NaN payload is whichever operand the compiled code puts first,
    which may differ between ISAs; those are compared as NaN.)"""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, *FP8):
        for op in (Op.MIN, Op.MAX, Op.SUM):
            inputs = [_values(dtype, 1000, g, 0.5, 0) for _ in range(3)]
            results = []
            for name in ISAS:
                kernels.set_isa(name)
                out = torch.empty(1000, dtype=dtype)
                kernels.reduce(out, inputs, op)
                results.append(out)
            for r in results[1:]:
                if op == Op.SUM:
                    assert_same(r, results[0], op, f"{dtype} {op.name}")
                else:
                    assert torch.equal(_bits(r), _bits(results[0])), (dtype, op)


@needs_core
def test_min_max_rule_for_nan_and_signed_zero() -> None:
    nan, z = float("nan"), 0.0
    a = torch.tensor([nan, 1.0, -z, z, -z, z])
    b = torch.tensor([1.0, nan, z, -z, -z, z])
    for name in ISAS:
        kernels.set_isa(name)
        lo, hi = torch.empty(6), torch.empty(6)
        kernels.reduce(lo, [a, b], Op.MIN)
        kernels.reduce(hi, [a, b], Op.MAX)
        assert _bits(lo)[:2].tolist() == [-1, -1] and _bits(hi)[:2].tolist() == [-1, -1]  # NaN: all bits set
        assert [str(v) for v in lo[2:].tolist()] == ["-0.0", "-0.0", "-0.0", "0.0"]
        assert [str(v) for v in hi[2:].tolist()] == ["0.0", "0.0", "-0.0", "0.0"]


@needs_core
def test_many_inputs_beyond_the_stack_array() -> None:
    inputs = [torch.randn(100, generator=torch.Generator().manual_seed(k)) for k in range(20)]
    check_all_isas(inputs, Op.SUM, torch.float32)


# -- the Python door -------------------------------------------------------------------


def test_reference_is_what_the_engine_computes() -> None:
    """AVG of bf16: fp32 sum in list order, true division, one rounding."""
    x = [torch.tensor([1.0, 3.0, 1e-3]).bfloat16() for _ in range(3)]
    out = torch.empty(3, dtype=torch.bfloat16)
    kernels.reference_reduce(out, x, Op.AVG, divisor=3)
    acc = x[0].float() + x[1].float() + x[2].float()
    assert torch.equal(out, (acc / 3).bfloat16())


@pytest.mark.parametrize("bad, error", [
    (dict(op=Op.AVG, dtype=torch.int32), ValueError),
    (dict(op=Op.BAND, dtype=torch.float32), TypeError),
    (dict(out_dtype=torch.float64), ValueError),
    (dict(op=Op.SUM, divisor=2), ValueError),
    (dict(op=Op.AVG, divisor=-1), ValueError),
    (dict(sizes=(4, 5)), ValueError),
    (dict(strided=True), ValueError),
    (dict(dtype=torch.complex64), TypeError),
])
def test_bad_arguments_say_what_to_do(bad: dict, error: type) -> None:
    dtype = bad.get("dtype", torch.float32)
    n0, n1 = bad.get("sizes", (4, 4))
    inputs = [torch.zeros(n0, dtype=dtype), torch.zeros(n1, dtype=dtype)]
    if bad.get("strided"):
        inputs[1] = torch.zeros(8, dtype=dtype)[::2]
    out = torch.zeros(n0, dtype=bad.get("out_dtype", dtype))
    for fn in (kernels.reduce, kernels.reference_reduce):
        with pytest.raises(error):
            fn(out, inputs, bad.get("op", Op.SUM), divisor=bad.get("divisor", 0))


@needs_core
def test_core_refuses_misaligned_and_unknown() -> None:
    from fireflyer.hfreduce import _core

    x = torch.zeros(8)
    with pytest.raises(ValueError, match="aligned"):
        _core.reduce(x.data_ptr() + 1, 1, [x.data_ptr()], 1, 4, 0)
    with pytest.raises(TypeError, match="dtype"):
        _core.reduce(x.data_ptr(), 99, [x.data_ptr()], 99, 4, 0)
    with pytest.raises(ValueError, match="op"):
        _core.reduce(x.data_ptr(), 7, [x.data_ptr()], 7, 4, int(Op.AVG))
    with pytest.raises(ValueError, match="inputs"):
        _core.reduce(x.data_ptr(), 1, [], 1, 4, 0)
    _core.reduce(0, 1, [0], 1, 0, 0)  # nothing to do: no pointer is touched


def test_fallback_warns_once_in_one_line(monkeypatch, caplog) -> None:
    monkeypatch.setattr(kernels, "_core", None)
    monkeypatch.setattr(kernels, "_core_missing", "it was not built (test)")
    monkeypatch.setattr(kernels, "_warned", False)
    assert not kernels.available() and kernels.isa() == "reference"
    x = [torch.arange(5.0), torch.ones(5)]
    out = torch.empty(5)
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        kernels.reduce(out, x, Op.SUM)
        kernels.reduce(out, x, Op.SUM)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage() and "not built" in warnings[0].getMessage()
    assert torch.equal(out, torch.arange(5.0) + 1)


def test_environment_picks_the_kernels(monkeypatch) -> None:
    monkeypatch.setenv("FIREFLYER_HFREDUCE_CORE", "0")
    kernels.set_isa(None)
    assert kernels.isa() == "reference" and not kernels.available()
    monkeypatch.delenv("FIREFLYER_HFREDUCE_CORE")
    for name in ISAS:
        monkeypatch.setenv("FIREFLYER_HFREDUCE_ISA", name)
        kernels.set_isa(None)
        assert kernels.isa() == name and kernels.available()
    with pytest.raises(ValueError, match="choose one of"):
        kernels.set_isa("sse9")


@needs_core
def test_extension_reads_the_isa_request_at_import() -> None:
    """Loads the module file alone (no torch) in fresh interpreters, as a C caller's process would."""
    from fireflyer.hfreduce import _core

    script = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("fireflyer.hfreduce._core", {_core.__file__!r})
        m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
        print(m.isa(), m.isa_note)
    """)
    for want, isa, note in [("portable", "portable", "None"), (ISAS[-1], ISAS[-1], "None"),
                            ("sse9", ISAS[0], "is not avx512, avx2 or portable")]:
        env = dict(os.environ, FIREFLYER_HFREDUCE_ISA=want)
        res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        got_isa, got_note = res.stdout.strip().split(" ", 1)
        assert got_isa == isa and note in got_note


# -- the tree root's finish of an fp32 partial -------------------------------------------


@needs_core
@pytest.mark.parametrize("dtype", sorted(LOW_PRECISION, key=str))
@pytest.mark.parametrize("divisor", [0, 3, 4])
def test_round_into_a_low_precision_matches_the_reference(dtype: torch.dtype, divisor: int) -> None:
    """An fp32 partial (ordinary values, specials of fp32 and of the dtype, raw bit patterns), divided
    and rounded once: the bits of ``div_`` then ``.to()``, NaN compared as NaN."""
    g = torch.Generator().manual_seed(DTYPES[dtype] * 10 + divisor)
    edges = _specials(dtype).to(torch.float32)
    for n in SIZES + [65537]:
        acc = torch.cat([_values(torch.float32, n, g, special=0.1, scale=s) for s in (0, 8, -20)] + [edges])
        got, want = torch.empty(acc.numel(), dtype=dtype), torch.empty(acc.numel(), dtype=dtype)
        kernels.round_into(got, acc, divisor=divisor)
        kernels.reference_round(want, acc, divisor=divisor)
        assert_same(got, want, Op.AVG if divisor else Op.SUM, f"{dtype} n={n} divisor={divisor}")


def test_round_into_refuses_what_it_does_not_take() -> None:
    with pytest.raises(ValueError, match="contiguous CPU fp32"):
        kernels.round_into(torch.empty(4, dtype=torch.float32), torch.zeros(4))
    with pytest.raises(ValueError, match="contiguous CPU fp32"):
        kernels.round_into(torch.empty(3, dtype=torch.bfloat16), torch.zeros(4))
    with pytest.raises(ValueError, match="divisor"):
        kernels.round_into(torch.empty(4, dtype=torch.bfloat16), torch.zeros(4), divisor=-1)
