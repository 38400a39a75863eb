"""The canonical summation order (pure): the tree, the streaming accumulator, and why layouts agree."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fireflyer.hfreduce.plans.canonical import PairwiseAccumulator, canonical_sum, split_point

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def terms(n: int, seed: int, dtype: torch.dtype, width: int = 33) -> list[torch.Tensor]:
    """Terms of wide magnitudes, so that the order of additions shows in the bits."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.pow(2.0, torch.randint(-12, 12, (n, width), generator=g).double())
    values = torch.randn(n, width, generator=g, dtype=torch.float64) * scale
    if dtype is torch.float16:
        values = values.clamp(-6e4, 6e4)
    return list(values.to(dtype))


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_the_tree_is_left_balanced():
    assert [split_point(n) for n in range(2, 10)] == [1, 2, 2, 4, 4, 4, 4, 8]
    a, b, c, d, e = (torch.tensor([x]) for x in (1e8, 1.0, -1e8, 1.0, 3.0))
    assert torch.equal(canonical_sum([a, b, c]), (a + b) + c)
    assert torch.equal(canonical_sum([a, b, c, d, e]), ((a + b) + (c + d)) + e)
    with pytest.raises(ValueError, match="at least one term"):
        canonical_sum([])
    with pytest.raises(ValueError, match="term 1 is torch.float64"):
        canonical_sum([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), seed=st.integers(0, 2**31), dtype=st.sampled_from(DTYPES))
def test_the_streaming_accumulator_builds_the_same_tree_in_log_space(n, seed, dtype):
    xs = terms(n, seed, dtype)
    acc = PairwiseAccumulator()
    most = 0
    for x in xs:
        acc.add(x)
        most = max(most, acc.partials)
    assert most <= n.bit_length()
    got = acc.result()
    assert got.dtype == dtype and bits(got) == bits(canonical_sum(xs))


@settings(max_examples=60, deadline=None)
@given(ranks=st.integers(1, 12), log_block=st.integers(0, 3), seed=st.integers(0, 2**31),
       dtype=st.sampled_from(DTYPES))
def test_aligned_power_of_two_blocks_sum_to_the_same_bits_as_one_process(ranks, log_block, seed, dtype):
    """R ranks of b = 2^k consecutive terms each: every rank sums its block, the ranks' partials are
    summed in the tree over ranks, and the bits equal one process summing all R*b terms."""
    b = 1 << log_block
    xs = terms(ranks * b, seed, dtype)
    partials = [canonical_sum(xs[r * b:(r + 1) * b], keep_accumulator=True) for r in range(ranks)]
    two_level = canonical_sum(partials).to(dtype)
    assert bits(two_level) == bits(canonical_sum(xs))
    # the same with the blocks grouped again by node (pairs of ranks) when the ranks pair up evenly
    if ranks % 2 == 0:
        nodes = [canonical_sum(partials[i:i + 2], keep_accumulator=True) for i in range(0, ranks, 2)]
        assert bits(canonical_sum(nodes).to(dtype)) == bits(canonical_sum(xs))


def test_half_precision_accumulates_in_fp32_and_rounds_once():
    xs = [torch.tensor([1.0], dtype=torch.bfloat16)] + [torch.tensor([2.0 ** -9], dtype=torch.bfloat16)] * 3
    # in bf16 each 2^-9 added to 1.0 is lost to rounding; in fp32 the three add up first
    assert canonical_sum(xs).item() == torch.tensor(1.0 + 3 * 2.0 ** -9).to(torch.bfloat16).item()
    assert canonical_sum(xs, keep_accumulator=True).dtype == torch.float32


def test_an_uneven_block_breaks_the_invariance_so_it_is_not_claimed():
    """Three terms on one rank and one on another: (a+b+c) + d is not ((a+b) + (c+d))."""
    a, b, c, d = (torch.tensor([x], dtype=torch.float32) for x in (1.0, 1e8, -1e8, 1.0))
    uneven = canonical_sum([canonical_sum([a, b, c]), d])
    assert not torch.equal(uneven, canonical_sum([a, b, c, d]))
