"""The pairwise-tree reduce of the compiled core against its torch reference and the canonical sum,
bit for bit, on every instruction set; and the binomial trees that carry the tree across nodes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fireflyer.hfreduce.engine import kernels
from fireflyer.hfreduce.plans.canonical import canonical_sum, layout_problem, split_point
from fireflyer.hfreduce.config import HFReduceConfig
from fireflyer.hfreduce.plans.plan import Op, acc_dtype
from fireflyer.hfreduce.plans.topology import binomial_links
from fireflyer.errors import UserError

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
needs_core = pytest.mark.skipif(not kernels.available(), reason="the compiled core is not built")


@pytest.fixture(params=kernels.supported_isas() if kernels.available() else ["portable"])
def isa(request):
    before = kernels.isa()
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa(before)


def _terms(seed: int, nin: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    limit = 400.0 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else 6e4
    return [(torch.randn(n, generator=g) * torch.pow(10.0, torch.randint(-3, 4, (n,), generator=g).float()))
            .clamp(-limit, limit).to(dtype) for _ in range(nin)]


def _want(terms: list[torch.Tensor], op: Op, divisor: int, out_dtype: torch.dtype) -> torch.Tensor:
    if op == Op.PRODUCT:
        acc = [t.to(acc_dtype(t.dtype, op)) for t in terms]

        def tree(xs):
            if len(xs) == 1:
                return xs[0]
            m = split_point(len(xs))
            return tree(xs[:m]) * tree(xs[m:])
        total = tree(acc)
    else:
        total = canonical_sum(terms, keep_accumulator=True)
    if divisor:
        total = total / divisor
    return total.to(out_dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@needs_core
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), nin=st.integers(1, 17), n=st.integers(0, 1600),
       dtype=st.sampled_from(FLOATS), op=st.sampled_from([Op.SUM, Op.AVG, Op.PRODUCT]), partial=st.booleans())
def test_the_tree_kernel_is_the_canonical_sum_bit_for_bit(isa, seed, nin, n, dtype, op, partial):
    terms = _terms(seed, nin, n, dtype)
    if op == Op.PRODUCT:
        terms = [(t.float() * 0 + 1 + t.float() / 1e5).to(dtype) for t in terms]  # near 1: no overflow
    out_dtype = acc_dtype(dtype, op) if partial else dtype
    divisor = nin if op == Op.AVG and not partial else 0
    compiled, reference = torch.empty(n, dtype=out_dtype), torch.empty(n, dtype=out_dtype)
    kernels.reduce(compiled, terms, op, divisor=divisor, tree=True)
    kernels.reference_reduce(reference, terms, op, divisor=divisor, tree=True)
    want = _want(terms, op, divisor, out_dtype)
    assert _same_bits(compiled, want)
    assert _same_bits(reference, want)


@needs_core
@pytest.mark.parametrize("op", [Op.MIN, Op.MAX])
def test_associative_ops_and_integers_keep_the_list_order(isa, op):
    terms = _terms(5, 9, 777, torch.float32)
    a, b = torch.empty(777), torch.empty(777)
    kernels.reduce(a, terms, op, tree=True)
    kernels.reduce(b, terms, op)
    assert _same_bits(a, b)
    ints = [torch.randint(-2**31, 2**31 - 1, (333,), dtype=torch.int32) for _ in range(6)]
    x, y = torch.empty(333, dtype=torch.int32), torch.empty(333, dtype=torch.int32)
    kernels.reduce(x, ints, Op.SUM, tree=True)
    kernels.reduce(y, ints, Op.SUM)
    assert torch.equal(x, y)


@needs_core
def test_the_tree_differs_from_the_list_order_from_four_inputs_on():
    terms = _terms(11, 4, 4096, torch.float32)
    tree, listed = torch.empty(4096), torch.empty(4096)
    kernels.reduce(tree, terms, Op.SUM, tree=True)
    kernels.reduce(listed, terms, Op.SUM)
    assert not torch.equal(tree, listed)
    three = terms[:3]
    kernels.reduce(tree[:0], [t[:0] for t in three], Op.SUM, tree=True)  # empty is fine
    kernels.reduce(tree, three, Op.SUM, tree=True)
    kernels.reduce(listed, three, Op.SUM)
    assert torch.equal(tree, listed)  # (a + b) + c is the tree over three


@needs_core
def test_out_may_be_the_first_input(isa):
    terms = _terms(3, 6, 2000, torch.float32)
    want = _want(terms, Op.SUM, 0, torch.float32)
    kernels.reduce(terms[0], terms, Op.SUM, tree=True)
    assert _same_bits(terms[0], want)


def _expr(links, n: int, tree: int) -> str:
    """The reduce-up over ``links`` as an expression: each node folds its children in, in order."""
    def up(v: int) -> str:
        e = f"r{v}"
        for c in links(n, v, tree).children:
            e = _add(e, up(c))
        return e
    root = next(v for v in range(n) if links(n, v, tree).parent < 0)
    return up(root)


def _add(a: str, b: str) -> str:
    """A two-term sum, written the same whichever side it is computed on (IEEE addition commutes)."""
    return f"({min(a, b)}+{max(a, b)})"


def _canonical_expr(lo: int, hi: int) -> str:
    if hi - lo == 1:
        return f"r{lo}"
    m = lo + split_point(hi - lo)
    return _add(_canonical_expr(lo, m), _canonical_expr(m, hi))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 70), tree=st.sampled_from([0, 1]))
def test_the_binomial_trees_fold_nodes_in_the_canonical_tree(n, tree):
    assert _expr(binomial_links, n, tree) == _canonical_expr(0, n)
    for v in range(n):
        links = binomial_links(n, v, tree)
        for c in links.children:
            assert binomial_links(n, c, tree).parent == v
    assert sum(binomial_links(n, v, tree).parent < 0 for v in range(n)) == 1


def test_the_double_binary_tree_is_not_the_canonical_tree():
    from fireflyer.hfreduce.plans.topology import tree_links
    assert _expr(tree_links, 4, 0) != _canonical_expr(0, 4)


def test_binomial_links_refuse_a_node_outside_the_tree():
    with pytest.raises(UserError, match="outside 0..3"):
        binomial_links(4, 4, 0)
    with pytest.raises(UserError, match="tree must be 0 or 1"):
        binomial_links(4, 0, 2)


@pytest.mark.parametrize("nodes, problem", [
    ([[0, 1, 2, 3]], None), ([[0, 1, 2]], None), ([[0, 1], [2, 3]], None), ([[0], [1], [2]], None),
    ([[0, 1], [2, 3], [4, 5]], None),
    ([[0, 1, 2], [3]], "3+1"), ([[0, 1, 2], [3, 4, 5]], "2x3"), ([[0, 2], [1, 3]], "consecutive"),
])
def test_layout_problem_names_what_breaks_the_tree(nodes, problem):
    got = layout_problem(nodes)
    assert (got is None) if problem is None else (problem in got)


def test_an_unknown_order_is_refused():
    with pytest.raises(UserError, match="order must be one of fast, canonical, got 'sorted'"):
        HFReduceConfig(order="sorted")


@needs_core
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("op", [Op.SUM, Op.AVG])
def test_the_tree_kernels_last_rounding_keeps_its_rules_on_special_values(isa, dtype, op):
    """The SIMD finish (two fp32 partials added, divided, rounded once) against the portable kernel and torch's
    reference, bit for bit, on infinities, NaN, signed zeros, subnormals and halfway cases, with ragged tails.
    NaN stays NaN, but not its sign and payload: which of two NaNs an addition keeps depends on its operand
    order, which the compiler may swap (x86's invalid-operation NaN is negative, torch's NaN positive)."""
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 1e-7, -1e-7, 6e-8, 1.0 + 2**-8,
                             1.0 + 3 * 2**-9, 65504.0, -65504.0, 3.0e38, 240.0, 448.0, 57344.0])
    g = torch.Generator().manual_seed(3)
    for n in (5, 16, 37, 1030):
        terms = [specials[torch.randint(0, len(specials), (n,), generator=g)].to(dtype) for _ in range(5)]
        divisor = 5 if op == Op.AVG else 0
        compiled, reference = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
        portable = torch.empty(n, dtype=dtype)
        kernels.reduce(compiled, terms, op, divisor=divisor, tree=True)
        kernels.set_isa("portable")
        kernels.reduce(portable, terms, op, divisor=divisor, tree=True)
        kernels.set_isa(isa)
        kernels.reference_reduce(reference, terms, op, divisor=divisor, tree=True)
        for want in (portable.float(), reference.float(), _want(terms, op, divisor, dtype).float()):
            got = compiled.float()
            assert torch.equal(got.isnan(), want.isnan())
            assert _same_bits(got[~got.isnan()], want[~want.isnan()])


@needs_core
@pytest.mark.parametrize("nin", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("partial", [False, True])
def test_the_register_trees_of_four_and_eight_inputs(isa, nin, dtype, partial):
    """4 and 8 inputs (a node's ranks) have the tree written out in registers: the same bits, with tails."""
    for n, op in ((7, Op.SUM), (8, Op.AVG), (9, Op.SUM), (1029, Op.AVG), (4096, Op.SUM)):
        terms = _terms(n + nin, nin, n, dtype)
        out_dtype = acc_dtype(dtype, op) if partial else dtype
        divisor = nin if op == Op.AVG and not partial else 0
        compiled = torch.empty(n, dtype=out_dtype)
        kernels.reduce(compiled, terms, op if divisor else Op.SUM, divisor=divisor, tree=True)
        assert _same_bits(compiled, _want(terms, op if divisor else Op.SUM, divisor, out_dtype)), (n, op)
