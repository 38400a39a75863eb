"""A sharded state (expert parallel): who writes each tensor, and the one state all ranks' parts make up.

With ``kind="sharded"`` every rank hands in the tensors it holds under *global* names
(an expert's weights named by its global expert index, e.g.
``model/blocks.0.moe.experts.5.w1``). Some names are held by one rank (an expert shard
with no data-parallel replica), some by several (the dense weights, replicated
everywhere, and the replicas of an expert). Each name is written once, by one of its
holders, chosen so that every rank writes about as many bytes; and the non-tensor
rest of each rank's state (the skeleton) is merged into one. Both are pure functions of
what every rank holds, so all ranks compute the same answer from the same exchange.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from fireflyer.checkpoint.codec import TensorRef
from fireflyer.checkpoint.shard import st_itemsize
from fireflyer.errors import UserError

Holding = dict[str, tuple[str, tuple[int, ...]]]
"""What one rank holds: tensor name -> (safetensors dtype name, shape)."""


def plan_owners(holdings: Sequence[Holding]) -> dict[str, int]:
    """The rank that writes each name (``holdings[r]`` is rank r's): one of its holders, balanced by bytes.

    Largest tensors first, each to the holder that has been given the fewest bytes so
    far (ties: the lowest rank). A name held with different dtypes or shapes is an
    error: it would mean two different tensors share a name.
    """
    holders: dict[str, list[int]] = {}
    for rank, held in enumerate(holdings):
        for name in held:
            holders.setdefault(name, []).append(rank)
    nbytes = {}
    for name, ranks in holders.items():
        first = holdings[ranks[0]][name]
        for r in ranks[1:]:
            if tuple(holdings[r][name][1]) != tuple(first[1]) or holdings[r][name][0] != first[0]:
                raise UserError(
                    f"tensor {name!r} is held with different shapes or dtypes: rank {ranks[0]} has {first[0]} "
                    f"{tuple(first[1])}, rank {r} has {holdings[r][name][0]} {tuple(holdings[r][name][1])}; in a "
                    "sharded checkpoint a name means one tensor on every rank that holds it (name each expert's "
                    "tensors by its global expert index, and each rank's own tensors by something unique)")
        nbytes[name] = math.prod(first[1]) * st_itemsize(first[0])
    loads = [0] * len(holdings)
    owner: dict[str, int] = {}
    for name in sorted(holders, key=lambda n: (-nbytes[n], n)):
        r = min(holders[name], key=lambda q: (loads[q], q))
        owner[name] = r
        loads[r] += nbytes[name]
    return owner


def merge_skeletons(skeletons: Sequence[Any]) -> Any:
    """One skeleton from every rank's (``skeletons[r]`` is rank r's): dicts are united, the rest must agree.

    Dicts take every rank's keys (in the order they are first seen, rank 0's first) and
    merge the values of shared keys; lists and tuples of the same length merge item by
    item; tensor placeholders must name the same tensor; any other value must be the
    same on every rank that has it. Anything else is an error naming the key path.
    """
    if not skeletons:
        raise UserError("there is no skeleton to merge")
    merged = skeletons[0]
    for rank in range(1, len(skeletons)):
        merged = _merge(merged, skeletons[rank], "", rank)
    return merged


def _merge(a: Any, b: Any, path: str, rank: int) -> Any:
    if type(a) is dict and type(b) is dict:
        out = dict(a)
        for k, v in b.items():
            out[k] = _merge(a[k], v, f"{path}/{k}" if path else str(k), rank) if k in a else v
        return out
    if type(a) in (list, tuple) and type(b) is type(a) and len(a) == len(b):
        items = [_merge(x, y, f"{path}/{i}" if path else str(i), rank) for i, (x, y) in enumerate(zip(a, b))]
        return items if type(a) is list else tuple(items)
    if _same(a, b):
        return a
    raise UserError(
        f"the sharded state differs between ranks at {path or 'the top level'!r}: ranks before {rank} have "
        f"{_short(a)}, rank {rank} has {_short(b)}; in a sharded checkpoint everything but the tensors must be "
        "the same on every rank that has it (dicts may differ in their keys: put a per-rank value under a key "
        "of its own, e.g. f'rank{rank}')")


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, TensorRef):
        return a == b
    if isinstance(a, float):
        return repr(a) == repr(b)  # nan equals nan, 0.0 differs from -0.0
    if isinstance(a, (np.ndarray, np.generic)):
        return a.dtype == b.dtype and np.shape(a) == np.shape(b) and a.tobytes() == b.tobytes()
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an allowlisted object whose == fails or is not a bool
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
