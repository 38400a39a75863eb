"""Exact sums of squares (``hfreduce.plans.exact``): the correctly rounded total whatever the order, split,
dtype mix or number of ranks; inf and nan as torch's norm has them; refusals."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from fireflyer.errors import UsageError, UserError, UserTypeError
from fireflyer.hfreduce.plans import exact
from fireflyer.hfreduce.plans.exact import BINS, SquareSum, exact_norm
from fireflyer.testing.cluster import LocalCluster


def mixed(n: int, seed: int, dtype: torch.dtype = torch.float32, lo: int = -46, hi: int = 39) -> torch.Tensor:
    """Values from 10**lo to 10**hi (fp32: subnormals and flushes to zero at the bottom), both signs,
    with zeros, -0.0, the smallest normal and subnormal and the largest finite value among them."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.pow(10.0, torch.randint(lo, hi, (n,), generator=g).double())
    x = torch.randn(n, generator=g, dtype=torch.float64) * scale
    big = torch.finfo(dtype).max if dtype != torch.float64 else 1e150  # fp64: squares that stay finite
    x = x.clamp(-big, big).to(dtype)
    specials = torch.tensor([0.0, -0.0, torch.finfo(dtype).smallest_normal, -big, big, 1e-30, -1e30],
                            dtype=torch.float64)
    x[torch.randint(0, n, (len(specials),), generator=g)] = specials.to(dtype)
    x[torch.rand(n, generator=g) < 0.05] = 0
    if dtype in (torch.float32, torch.float64):
        x[:3] = torch.tensor([2.0 ** -149, -(2.0 ** -140), 3 * 2.0 ** -145]).to(dtype)[:n]  # fp32 subnormals
    return x


def fsum_of_squares(*tensors: torch.Tensor) -> float:
    """The correctly rounded sum: a square of a 24-bit significand is exact in a Python float."""
    return math.fsum(v * v for t in tensors for v in t.double().flatten().tolist())


def exact_sum_of_squares(*tensors: torch.Tensor) -> Fraction:
    """Every bit of it, for fp64 too, whose squares are not exact as floats."""
    return sum((Fraction(v) ** 2 for t in tensors for v in t.double().flatten().tolist()), Fraction(0))


def summed(*tensors: torch.Tensor) -> SquareSum:
    s = SquareSum()
    for t in tensors:
        s.add(t)
    return s


def total(*tensors: torch.Tensor) -> float:
    return summed(*tensors).total()


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 1000 elements: every test tensor spans many of them."""
    monkeypatch.setitem(exact.CHUNK, "cpu", 1000)


@pytest.mark.parametrize("seed", range(4))
def test_fp32_is_the_correctly_rounded_sum(seed, small_chunks):
    x = mixed(20_011, seed)
    s = summed(x)
    assert s.exact() == exact_sum_of_squares(x)  # every bit, not only those that survive the rounding
    assert s.total() == fsum_of_squares(x)
    small = mixed(5000, seed, lo=-46, hi=-20)  # a total made of subnormal and tiny squares alone
    assert total(small) == fsum_of_squares(small)


def test_the_one_rounding_beats_the_float_sum():
    """1 + 2**-53 + 2**-120: a float sum rounds the half-ulp away (to even), then loses the rest."""
    x = torch.tensor([1.0, 2.0 ** -27, 2.0 ** -27, 2.0 ** -60])
    assert total(x) == 1 + 2.0 ** -52 == fsum_of_squares(x)
    assert x.double().pow(2).sum().item() == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_narrow_floats(dtype, small_chunks):
    x = mixed(9000, 7, torch.float32, lo=-8, hi=6).clamp(-400, 400).to(dtype)
    assert summed(x).exact() == exact_sum_of_squares(x)
    assert total(x) == fsum_of_squares(x)
    assert total(x) == total(x.float())  # the same numbers, the same bins


def test_fp64_is_exact_too(small_chunks):
    x = mixed(3001, 11, torch.float64, lo=-320, hi=140)
    x[:4] = torch.tensor([5e-324, -5e-324, 2.0 ** -1022, 1 + 2.0 ** -52], dtype=torch.float64)
    s = summed(x)
    assert s.exact() == exact_sum_of_squares(x)
    assert s.total() == float(exact_sum_of_squares(x))
    full = torch.tensor([(2 - 2.0 ** -52) * 2.0 ** e for e in range(-1074, 1000, 37)], dtype=torch.float64)
    assert summed(full).exact() == exact_sum_of_squares(full)  # every limb product at its widest
    # (1 + 2**-52)**2 + 2 * 2**-54 = 1 + 2**-51 + 2**-53 + 2**-104: past the tie by the last product alone
    tie = torch.tensor([1 + 2.0 ** -52, 2.0 ** -27, 2.0 ** -27], dtype=torch.float64)
    assert total(tie) == 1 + 3 * 2.0 ** -52
    assert tie.pow(2).sum().item() == 1 + 2.0 ** -51
    tiny = torch.tensor([5e-324] * 3, dtype=torch.float64)
    assert total(tiny) == 0.0  # 3 * 2**-2148 rounds to zero, as the exact value does
    assert total(torch.tensor([2.0 ** 511, 2.0 ** 511], dtype=torch.float64)) == 2.0 ** 1023
    assert total(torch.tensor([1e200, 1e200], dtype=torch.float64)) == math.inf  # the sum overflows


def test_dtypes_mix_in_one_sum(small_chunks):
    a, b, c = mixed(3000, 1), mixed(3000, 2, torch.float64, lo=-40, hi=30), mixed(3000, 3).clamp(-1e4, 1e4).half()
    assert summed(a, b, c).exact() == exact_sum_of_squares(a, b, c)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10 ** 6), cuts=st.lists(st.integers(0, 6000), max_size=12))
def test_any_split_and_order_gives_the_same_float(seed, cuts):
    x = mixed(6000, seed % 97)
    want = total(x)
    g = torch.Generator().manual_seed(seed)
    bounds = sorted({0, 6000, *cuts})
    pieces = [x[a:b] for a, b in zip(bounds, bounds[1:])]
    order = torch.randperm(len(pieces), generator=g).tolist()
    assert total(*(pieces[i] for i in order)) == want
    shuffled = x[torch.randperm(6000, generator=g)]
    assert total(shuffled) == want
    # split between two sums whose bins are added (what an all-reduce does)
    s, t = SquareSum(), SquareSum()
    for i in order:
        (s if i % 2 else t).add(pieces[i])
    s.bins.add_(t.bins)
    assert s.total() == want


def test_bins_are_normalised_and_stay_exact_through_a_forced_normalisation(small_chunks):
    x = torch.full((5000,), 3.4e38)  # every piece large: the bins fill fastest
    s = SquareSum()
    s.add(x[:2500])
    s._load = (1 << 63) - 10  # the next chunk cannot fit: it normalises first
    s.add(x[2500:])
    bins = s.bins
    assert bins.shape == (BINS,) and bins.dtype == torch.int64
    assert int(bins.max()) <= 1 << 24 and int(bins.min()) >= 0
    assert s.exact() == exact_sum_of_squares(x)


def test_normalising_keeps_the_value_and_bounds_every_bin():
    """Bins up to 2**62 (what a long run of adds can leave) carry down to at most 2**24 each."""
    s = SquareSum()
    g = torch.Generator().manual_seed(3)
    s._bins[777:2100] = torch.randint(0, 1 << 62, (2100 - 777,), generator=g)  # fp32 squares start at 777
    s._bins[exact.FP32_BINS:exact.FP32_BINS + 2150] = torch.randint(0, 1 << 62, (2150,), generator=g)
    raw = s._bins.tolist()
    want = (sum(Fraction(v) * Fraction(2) ** (k - 1075) for k, v in enumerate(raw[:exact.FP32_BINS]))
            + sum(Fraction(v) * Fraction(4) ** (j - 1074) for j, v in enumerate(raw[exact.FP32_BINS:exact.NAN_SLOT])))
    bins = s.bins
    assert int(bins.max()) <= 1 << 24 and int(bins.min()) >= 0
    assert s.exact() == want


@pytest.mark.parametrize("values, want", [
    ([1.0, math.inf], math.inf), ([-math.inf, 2.0], math.inf), ([math.nan, 1.0], math.nan),
    ([math.inf, math.nan], math.nan), ([-math.nan, math.inf, 0.0], math.nan), ([0.0, -0.0], 0.0),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_inf_and_nan_as_torch_norm(values, want, dtype):
    x = torch.tensor(values, dtype=dtype)
    got = total(x)
    ref = torch.linalg.vector_norm(x.double()).item() ** 2
    for value in (got, ref):
        assert (math.isnan(value) and math.isnan(want)) or value == want


def test_a_nan_or_inf_on_one_rank_reaches_every_total():
    clean, inf, nan = SquareSum(), SquareSum(), SquareSum()
    clean.add(torch.ones(4))
    inf.add(torch.tensor([1.0, -math.inf]))
    nan.add(torch.tensor([math.nan], dtype=torch.float64))
    clean.bins.add_(inf.bins)
    assert clean.total() == math.inf
    clean.bins.add_(nan.bins)
    assert math.isnan(clean.total())


def test_shapes_views_and_autograd():
    x = mixed(600, 5).reshape(20, 30).requires_grad_()
    s = SquareSum()
    s.add(x.t())  # not contiguous
    s.add(torch.tensor(3.0))  # 0-dim
    s.add(torch.empty(0, 4))
    assert s.count == 601
    assert s.total() == fsum_of_squares(x.detach(), torch.tensor(3.0))
    assert s.norm() == math.sqrt(s.total())
    assert SquareSum().total() == 0.0


def test_exact_norm_skips_missing_gradients():
    grads = [mixed(100, 1), None, mixed(50, 2).bfloat16()]
    assert exact_norm(grads) == math.sqrt(fsum_of_squares(grads[0], grads[2]))
    assert exact_norm([]) == 0.0


def test_refusals():
    s = SquareSum()
    with pytest.raises(UserTypeError, match="got torch.int64"):
        s.add(torch.arange(3))
    with pytest.raises(UserTypeError, match="got torch.complex64"):
        s.add(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(UserTypeError, match="adds tensors, got list"):
        s.add([1.0, 2.0])
    with pytest.raises(UserTypeError, match="dense tensors"):
        s.add(torch.eye(3).to_sparse())
    with pytest.raises(UserError, match="on meta but this SquareSum's bins are on cpu"):
        s.add(torch.ones(2, device="meta"))
    s.add(torch.ones(2))
    assert s.total() == 2.0
    with pytest.raises(UsageError, match="start a new SquareSum"):
        s.add(torch.ones(2))
    sealed = SquareSum()
    sealed.bins  # handed out for an all-reduce: closed
    with pytest.raises(UsageError):
        sealed.add(torch.ones(1))


def test_a_replicated_dtensor_is_refused_by_name(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        d = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1,)), [Replicate()])
        with pytest.raises(UserTypeError, match="to_local"):
            SquareSum().add(d)
        assert total(d.to_local()) == 4.0
    finally:
        dist.destroy_process_group()


# -- two ranks ------------------------------------------------------------------------------------

def pieces(seed: int) -> list[torch.Tensor]:
    """A 'model's' gradients of several dtypes and sizes, some spanning many chunks."""
    sizes = [1, 7, 1000, 70_001, 3, 250_000, 64]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.float64, torch.float32, torch.float16]
    out = []
    for i, (n, dtype) in enumerate(zip(sizes, dtypes)):
        x = mixed(n, seed * 100 + i, torch.float64 if dtype == torch.float64 else torch.float32, lo=-20, hi=20)
        out.append(x.clamp(-6e4, 6e4).to(dtype) if dtype in (torch.bfloat16, torch.float16) else x)
    return out


def _rank_norms(ctx, seed: int) -> tuple[float, float, list[int]]:
    """This rank's share of the pieces (every other one, from its rank on): the all-reduced norm, by
    exact_norm and by hand."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", ctx.store), rank=ctx.rank,
                                world_size=ctx.world_size)
    mine = pieces(seed)[ctx.rank::ctx.world_size]
    by_function = exact_norm(mine, group=dist.group.WORLD)
    s = SquareSum()
    for t in reversed(mine):
        s.add(t)
    dist.all_reduce(s.bins)
    return by_function, s.norm(), s.bins.tolist()


@pytest.mark.multiproc
def test_two_ranks_holding_half_each_get_the_one_process_norm():
    alone = {seed: exact_norm(pieces(seed)) for seed in (1, 2)}
    with LocalCluster([2], env={"FIREFLYER_TEST_COMM": "0"}) as cluster:
        for seed, want in alone.items():
            results = cluster.run(_rank_norms, seed, timeout=120)
            for by_function, by_hand, _ in results:
                assert by_function == by_hand == want
            assert results[0][2] == results[1][2]  # the same bins on both ranks
    split = pieces(1)
    assert math.sqrt(total(*split[1::2], *split[::2])) == alone[1]
