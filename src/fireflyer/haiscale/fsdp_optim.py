"""The optimizer step inside backward (paper §V-B: "the optimizer step is split up and run during backward").

With ZeRO-3 a unit's sharded gradients arrive together, from the unit's one
reduce-scatter, while backward is still working on the units before it. Nothing has to
wait for the whole backward before updating them: as soon as a unit's gradients have
landed the optimizer steps those parameters and frees their gradients. The step then
overlaps the rest of backward (and the next reduce-scatter on the wire), and the
gradients of only about one unit are alive at any time instead of the whole model's.

How it is wired, in torch 2.13:

* FSDP2 calls the post-accumulate-grad hooks of each *sharded* parameter right after
  assigning its reduced ``.grad`` (autograd itself never would: the sharded parameters
  are not in the graph). The hook only records that gradients are waiting.
* The model's :class:`~fireflyer.haiscale.fsdp_comm.ReduceScatterBacklog` calls back
  each time every assigned gradient is complete: when the next unit's reduce-scatter is
  issued, and at the end of backward. The callback runs ``optimizer.step()`` and
  ``optimizer.zero_grad(set_to_none=True)``. Parameters whose gradient has not arrived
  yet have ``.grad is None``, and torch optimizers skip those, so each call steps exactly
  the units that just landed: one ordinary optimizer, stepped piecewise.

Because it is one ordinary optimizer, LR schedulers, ``state_dict()`` and
``param_groups`` work as usual. What changes for the training loop: do not call
``optimizer.step()`` or ``zero_grad()`` (harmless no-ops if you do), and there is no
moment when all gradients exist at once, so gradient clipping by global norm and
GradScaler's inf checks cannot be used. Every backward steps: for gradient
accumulation, use FSDP2's ``set_requires_gradient_sync(False)`` on the
micro-batches before the last. After a backward that raised, some units may have
stepped and others not; call ``optimizer.zero_grad(set_to_none=True)`` and FSDP2's
``reset_iter_state()`` on the model before going on (or restore a checkpoint).
"""

from __future__ import annotations

from typing import Callable, Union

import torch
import torch.nn as nn

from fireflyer.haiscale.fsdp_comm import ReduceScatterBacklog
from fireflyer.errors import UserError, UserTypeError

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
"""Builds the optimizer from the model's sharded parameters, e.g. ``functools.partial(torch.optim.AdamW, lr=3e-4)``."""

OptimizerSpec = Union[OptimizerFactory, torch.optim.Optimizer]


class InBackwardStepper:
    """Steps ``optimizer`` whenever a backlog reports that assigned gradients have landed."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.waiting = False
        """Some gradient arrived since the last step."""
        self.calls = 0
        """``optimizer.step()`` calls so far (about one per unit per backward)."""

    def grad_assigned(self, param: torch.Tensor) -> None:
        self.waiting = True

    def __call__(self) -> None:
        if not self.waiting:
            return
        self.waiting = False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.calls += 1


def build_optimizer(spec: OptimizerSpec, module: nn.Module) -> torch.optim.Optimizer:
    """The optimizer for ``module``'s sharded parameters, checked to cover every trainable one."""
    params = list(module.parameters())
    if isinstance(spec, torch.optim.Optimizer):
        optimizer = spec
    elif callable(spec):
        optimizer = spec(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UserTypeError(f"the optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer; "
                            "pass e.g. functools.partial(torch.optim.AdamW, lr=3e-4)")
    else:
        raise UserTypeError(f"optimizer must be a torch.optim.Optimizer or a callable that builds one from a list of "
                        f"parameters, got {type(spec).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise UserTypeError("LBFGS needs a closure that re-runs the model, which cannot run inside backward")
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    own = {id(p) for p in params}
    if in_optimizer - own:
        raise UserError("the optimizer holds parameters that are not the sharded model's; build it after "
                         "fully_shard (or pass a factory, which is called with the sharded parameters)")
    names = {id(p): n for n, p in module.named_parameters()}
    missing = [names[id(p)] for p in params if p.requires_grad and id(p) not in in_optimizer]
    if missing:
        raise UserError(f"the optimizer leaves out trainable parameters {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}; their gradients would never be used or freed. "
                         "Set requires_grad=False on them or give them to the optimizer")
    return optimizer


def attach(optimizer: torch.optim.Optimizer, module: nn.Module, backlog: ReduceScatterBacklog) -> InBackwardStepper:
    """Hook ``optimizer`` into backward: every sharded parameter reports its gradient, the backlog steps."""
    stepper = InBackwardStepper(optimizer)

    def on_grad(param: torch.Tensor) -> None:
        stepper.grad_assigned(param)
        backlog.grad_assigned()

    for p in module.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(on_grad)
    backlog.on_landed = stepper
    return stepper
