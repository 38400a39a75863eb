"""Gradient buckets: which parameters share one flat buffer and one allreduce.

Pure planning, no torch.distributed: parameters are given in the order their
gradients are expected to be ready (reverse registration order at first, the
observed order after the first step). Consecutive parameters of the same
(device, dtype) fill a bucket up to ``cap_bytes``; the first bucket is capped
smaller so communication starts early in backward, when little is ready.
Parameters averaged over different process groups (dense and expert weights of an
MoE model) never share a bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence
from fireflyer.errors import UserError


@dataclass(frozen=True)
class BucketPlan:
    """``buckets[b]`` lists parameter indices in ready order; ``offsets[b]`` their element offsets in the flat buffer."""

    buckets: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    numels: tuple[int, ...]

    def bucket_of(self) -> dict[int, tuple[int, int]]:
        """Parameter index -> (bucket, position in bucket)."""
        return {p: (b, i) for b, params in enumerate(self.buckets) for i, p in enumerate(params)}


def plan_buckets(
    order: Sequence[int],
    numels: Sequence[int],
    itemsizes: Sequence[int],
    keys: Sequence[Hashable],
    *,
    cap_bytes: int,
    first_cap_bytes: int,
    groups: Sequence[Hashable] | None = None,
) -> BucketPlan:
    """Split ``order`` (parameter indices, ready order) into buckets.

    A bucket never mixes keys (device and dtype), never exceeds its cap unless a
    single parameter does (that parameter gets a bucket of its own), and keeps the
    ready order, so buckets fill front to back as backward runs.

    ``groups`` (one label per parameter: the process group its gradient is averaged
    over) keeps groups apart: each group's parameters, in ready order, are split as
    above (each group with its own small first bucket), and the buckets of all groups
    are then listed by when they are expected to be full, i.e. by the position of
    their last parameter in ``order``. The list is the launch order, which is the same
    on every rank that plans from the same ``order``, so each group sees its
    collectives in the same sequence on all of its ranks. Without ``groups`` this is
    exactly the one-group plan.
    """
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        raise UserError(f"bucket caps must be positive, got cap {cap_bytes} and first cap {first_cap_bytes}")
    if sorted(order) != list(range(len(numels))):
        raise UserError("order must be a permutation of the parameter indices")
    if groups is not None and len(groups) != len(numels):
        raise UserError(f"groups must give one label per parameter: {len(groups)} labels for {len(numels)} parameters")
    if groups is None:
        buckets = _split(order, numels, itemsizes, keys, cap_bytes, first_cap_bytes)
    else:
        by_group: dict[Hashable, list[int]] = {}
        for p in order:
            by_group.setdefault(groups[p], []).append(p)
        position = {p: i for i, p in enumerate(order)}
        buckets = sorted((b for members in by_group.values()
                          for b in _split(members, numels, itemsizes, keys, cap_bytes, first_cap_bytes)),
                         key=lambda b: position[b[-1]])
    offsets = []
    sizes = []
    for params in buckets:
        offs, total = [], 0
        for p in params:
            offs.append(total)
            total += numels[p]
        offsets.append(tuple(offs))
        sizes.append(total)
    return BucketPlan(tuple(map(tuple, buckets)), tuple(offsets), tuple(sizes))


def _split(order: Sequence[int], numels: Sequence[int], itemsizes: Sequence[int], keys: Sequence[Hashable],
           cap_bytes: int, first_cap_bytes: int) -> list[list[int]]:
    """Consecutive runs of ``order`` with one key each, filled up to the cap (the first bucket: its own cap)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    current_key: Hashable = None
    for p in order:
        nbytes = numels[p] * itemsizes[p]
        cap = first_cap_bytes if not buckets else cap_bytes
        if current and (keys[p] != current_key or current_bytes + nbytes > cap):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(p)
        current_bytes += nbytes
        current_key = keys[p]
    if current:
        buckets.append(current)
    return buckets
