"""The canonical summation order: one pairwise tree over global indices, whatever the layout.

Floating-point addition is commutative but not associative, so a sum's bits depend on the
order in which its terms meet. This module fixes that order as a function of the terms'
*global indices* alone (micro-batch indices, or global ranks), never of where they sit:

* The tree over ``n`` terms is **left-balanced**: the first ``m`` terms, where ``m`` is the
  largest power of two below ``n``, form a balanced subtree, and the rest form the tree over
  ``n - m`` terms, built the same way; the two are added left + right. With ``n`` a power of
  two this is the balanced pairwise tree.
* **Aligned blocks are subtrees.** If the ``n`` terms are ``R`` blocks of ``b`` consecutive
  terms each, with ``b`` a power of two, the tree over the ``n`` terms is the tree over the
  ``R`` block sums, each block summed by its own balanced tree (any ``R``, not only powers of
  two). So a rank that owns an aligned block of micro-batches can sum it locally, and a
  collective that sums the ranks' partials in the tree over ranks gives the bits of one
  process summing every term: this is what makes the result independent of the layout.
  Blocks of unequal or non-power-of-two sizes do not have this property.
* :class:`PairwiseAccumulator` builds the same tree while the terms arrive one at a time,
  holding at most ``log2(n) + 1`` partial sums (a binary counter).
* Half-precision and fp8 terms are accumulated in fp32 and rounded once, at the end.

Everything here is pure and runs on any device; it is the reference the canonical collective
is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fireflyer.errors import UserError, UserTypeError

_WIDEN = {torch.float16: torch.float32, torch.bfloat16: torch.float32,
          torch.float8_e4m3fn: torch.float32, torch.float8_e5m2: torch.float32}


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial sums are kept in: fp32 for fp16, bf16 and fp8, the dtype itself otherwise
    (what the engine keeps its partials in)."""
    return _WIDEN.get(dtype, dtype)


def split_point(n: int) -> int:
    """How many of ``n >= 2`` terms form the left subtree: the largest power of two below ``n``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise UserError(f"a tree split needs at least 2 terms, got {n!r}")
    return 1 << ((n - 1).bit_length() - 1)


def canonical_sum(terms: Sequence[torch.Tensor], *, keep_accumulator: bool = False) -> torch.Tensor:
    """The sum of ``terms`` (same shape and dtype) in the left-balanced pairwise tree over their indices.

    Partial sums are kept in :func:`accumulation_dtype`; the result is rounded once to the
    terms' dtype, unless ``keep_accumulator`` (for a caller that adds more before rounding).
    """
    terms = _checked(terms)
    acc = accumulation_dtype(terms[0].dtype)
    total = _tree([t.to(acc) for t in terms])
    return total if keep_accumulator else total.to(terms[0].dtype)


def _tree(terms: list[torch.Tensor]) -> torch.Tensor:
    if len(terms) == 1:
        return terms[0].clone()
    m = split_point(len(terms))
    return _tree(terms[:m]) + _tree(terms[m:])


def _checked(terms: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    terms = list(terms)
    if not terms:
        raise UserError("a sum needs at least one term")
    if not all(isinstance(t, torch.Tensor) for t in terms):
        raise UserTypeError("every term must be a tensor")
    first = terms[0]
    for i, t in enumerate(terms[1:], 1):
        if t.shape != first.shape or t.dtype != first.dtype:
            raise UserError(f"term {i} is {t.dtype} {tuple(t.shape)} but term 0 is {first.dtype} "
                            f"{tuple(first.shape)}; a canonical sum adds terms of one shape and dtype")
    return terms


def layout_problem(nodes: Sequence[Sequence[int]]) -> str | None:
    """Why a collective over these nodes (each a list of group ranks) cannot sum in the canonical
    order, or None where it can.

    The node stage sums a node's ranks in their own pairwise tree, and the trees across nodes
    add whole node partials, so each node's ranks must be a subtree of the tree over all ranks:
    consecutive ranks, and every node of the same power-of-two size. One node may hold any
    number of ranks.
    """
    if len(nodes) <= 1:
        return None
    sizes = [len(n) for n in nodes]
    flat = [r for n in nodes for r in n]
    if flat != list(range(len(flat))):
        return ("its nodes do not hold consecutive ranks "
                f"(node 0 holds ranks {list(nodes[0])[:8]}); start the ranks node by node")
    if len(set(sizes)) > 1 or sizes[0] & (sizes[0] - 1):
        shape = "+".join(map(str, sizes)) if len(set(sizes)) > 1 else f"{len(sizes)}x{sizes[0]}"
        return (f"its nodes hold {shape} ranks; across nodes the canonical order needs every node to hold "
                "the same power-of-two number of ranks (1, 2, 4, 8, ...)")
    return None


class PairwiseAccumulator:
    """The canonical sum of terms given one at a time, in index order, holding O(log n) partials.

    A binary counter: each new term is a block of size 1; while the two newest blocks have the
    same size they merge (older + newer). :meth:`result` folds what is left from the newest
    (smallest) block back: ``B_big + (... + (B_2 + B_1))``, which is the left-balanced tree.
    """

    def __init__(self) -> None:
        self._blocks: list[tuple[int, torch.Tensor]] = []
        self._dtype: torch.dtype | None = None
        self._shape: torch.Size | None = None
        self.count = 0
        """Terms added so far."""

    def add(self, term: torch.Tensor) -> None:
        """Add the next term (index ``self.count``)."""
        if not isinstance(term, torch.Tensor):
            raise UserTypeError(f"a term must be a tensor, got {type(term).__name__}")
        if self._dtype is None:
            self._dtype, self._shape = term.dtype, term.shape
        elif term.dtype != self._dtype or term.shape != self._shape:
            raise UserError(f"term {self.count} is {term.dtype} {tuple(term.shape)} but the first was "
                            f"{self._dtype} {tuple(self._shape)}")
        size, block = 1, term.to(accumulation_dtype(term.dtype), copy=True)
        while self._blocks and self._blocks[-1][0] == size:
            older = self._blocks.pop()[1]
            block = older.add_(block)
            size *= 2
        self._blocks.append((size, block))
        self.count += 1

    @property
    def partials(self) -> int:
        """Partial sums held now (at most ``log2(count) + 1``)."""
        return len(self._blocks)

    def result(self, *, keep_accumulator: bool = False) -> torch.Tensor:
        """The canonical sum of every term added, rounded once to their dtype (unless ``keep_accumulator``)."""
        if not self._blocks:
            raise UserError("no term was added")
        total = self._blocks[-1][1].clone()
        for _, block in reversed(self._blocks[:-1]):
            total = block + total
        assert self._dtype is not None
        return total if keep_accumulator else total.to(self._dtype)
