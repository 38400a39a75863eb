"""Which parameters are experts: the mark an MoE layer puts on its expert weights.

Expert parameters are sharded over the expert-parallel (EP) group and replicated over
data parallel, so their gradients must be averaged over a different group than the
dense ones (:class:`~fireflyer.haiscale.DistributedDataParallel`'s
``expert_process_group``). The layer that creates them says so with :func:`mark_expert`;
DDP, checkpoints and benchmarks ask :func:`is_expert_param`. The mark is a plain int
attribute on the tensor: it survives ``module.to(...)`` (which keeps the parameter
objects) and ``torch.save``, but not ``copy.deepcopy`` of a parameter (torch copies only
the data), so a layer that is deep-copied must mark its copy again.
"""

from __future__ import annotations

import torch

from fireflyer.errors import UserError, UserTypeError

ATTRIBUTE = "_fireflyer_expert"
"""The attribute that marks an expert tensor; its value is the EP degree it is sharded over (1: replicated)."""


def mark_expert(p: torch.Tensor, *, ep_size: int = 1) -> torch.Tensor:
    """Mark ``p`` as an expert weight sharded over ``ep_size`` ranks (1 when every rank holds every expert).

    Returns ``p``, so ``self.w1 = mark_expert(nn.Parameter(...), ep_size=ep)`` reads as one line.
    """
    if not isinstance(p, torch.Tensor):
        raise UserTypeError(f"mark_expert marks a tensor or nn.Parameter, got {type(p).__name__}")
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise UserError(f"ep_size must be a positive int (the EP degree the expert is sharded over), got {ep_size!r}")
    setattr(p, ATTRIBUTE, ep_size)
    return p


def is_expert_param(p: torch.Tensor) -> bool:
    """Whether ``p`` was marked with :func:`mark_expert`."""
    return ep_size_of(p) > 0


def ep_size_of(p: torch.Tensor) -> int:
    """The EP degree ``p`` is sharded over; 0 if it is not an expert weight."""
    value = getattr(p, ATTRIBUTE, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
