"""Rank-side functions for the sharded-expert checkpoint tests (2 emulated nodes x 2 ranks).

The layout is the MoE tests' one: EP groups {0, 1} and {2, 3}, so rank r holds the
experts of EP rank ``r % 2`` and ranks {0, 2} and {1, 3} are replicas of each other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from fireflyer.checkpoint import CheckpointManager
from fireflyer.testing.cases.ckpt import _pg

N_EXPERTS = 8
EXPERT_GROUPS = ([0, 2], [1, 3])


def expert_tensor(g: int) -> torch.Tensor:
    """Global expert ``g``'s weight: a function of its global index only, so replicas agree."""
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + g))


def held_state(rank: int, ep: int = 2) -> dict:
    """What rank ``rank`` of an EP=``ep`` layout holds, under global names."""
    g = torch.Generator().manual_seed(0)
    model = {"dense.weight": torch.randn(64, 64, generator=g), "dense.bias": torch.randn(64, generator=g)}
    per = N_EXPERTS // ep
    first = (rank % ep) * per
    model.update({f"experts.{e}.w1": expert_tensor(e) for e in range(first, first + per)})
    return {"model": model, "own": {f"rank{rank}": torch.full((3,), float(rank))}, "step": 7,
            "layout": {"ep": ep, "experts": N_EXPERTS}}


def save_held(ctx, root: str) -> bool:
    """Every rank saves what it holds (kind="sharded") and loads the whole global state back."""
    _pg(ctx)
    mgr = CheckpointManager(root, kind="sharded", commit_timeout=60)
    mgr.save(3, held_state(ctx.rank), blocking=True)
    dist.barrier()  # rank 0 has committed
    state = mgr.load()
    mine = held_state(ctx.rank)["model"]
    return all(torch.equal(state["model"][k], v) for k, v in mine.items())


def conflicting(ctx, root: str, what: str) -> str:
    """A name held with two shapes, or a non-tensor value that differs: the save fails on every rank."""
    _pg(ctx)
    state = held_state(ctx.rank)
    if what == "shape" and ctx.rank == 3:
        state["model"]["experts.5.w1"] = torch.zeros(8, 16)
    if what == "value" and ctx.rank == 2:
        state["step"] = 8
    try:
        CheckpointManager(root, kind="sharded", commit_timeout=60).save(1, state, blocking=True)
        return "no error"
    except ValueError as exc:
        return str(exc)


# -- a resumed MoE-style training --------------------------------------------------------------------


class Tiny(nn.Module):
    """A dense layer and this EP rank's slice of ``n_experts`` experts, each seeded by its global index."""

    def __init__(self, ep_rank: int, ep: int, n_experts: int = 4, seed: int = 0) -> None:
        super().__init__()
        from fireflyer.haiscale.expert import mark_expert

        torch.manual_seed(seed)
        self.dense = nn.Linear(8, 8)
        per = n_experts // ep
        self.first = ep_rank * per
        self.experts = nn.ModuleList()
        for j in range(per):
            torch.manual_seed(seed + 100 + self.first + j)
            expert = nn.Linear(8, 8)
            for p in expert.parameters():
                mark_expert(p, ep_size=ep)
            self.experts.append(expert)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.dense(x))
        return sum(e(h) for e in self.experts)

    def global_name(self, local: str) -> str:
        """``experts.1.weight`` on EP rank 1 of EP=2 (4 experts) is global ``experts.3.weight``."""
        if local.startswith("experts."):
            _, j, rest = local.split(".", 2)
            return f"experts.{self.first + int(j)}.{rest}"
        return local


def _state(model: Tiny, opt: torch.optim.Optimizer, step: int) -> dict:
    named = list(model.named_parameters())
    return {"model": {model.global_name(n): p for n, p in named},
            "momentum": {model.global_name(n): opt.state[p]["momentum_buffer"] for n, p in named},
            "step": step}


def _restore(model: Tiny, opt: torch.optim.Optimizer, saved: dict) -> None:
    """Take this rank's slice of the global state."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved["model"][model.global_name(n)])
            opt.state[p]["momentum_buffer"] = saved["momentum"][model.global_name(n)].clone()


def _train(ddp, opt, rank: int, steps: range) -> None:
    for i in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(17 * i + rank))
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()


def resume_matches(ctx, root: str) -> dict:
    """Train 6 steps saving at 2 and 4; a fresh model resumed from step 4 ends bitwise where the first did."""
    from fireflyer.haiscale import DistributedDataParallel

    _pg(ctx)
    expert_group = None
    for ranks in EXPERT_GROUPS:
        g = dist.new_group(ranks)
        if ctx.rank in ranks:
            expert_group = g
    ep_rank = ctx.rank % 2

    def wrap(model):
        ddp = DistributedDataParallel(model, expert_process_group=expert_group)
        return ddp, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    mgr = CheckpointManager(root, kind="sharded", keep_last=2, commit_timeout=60)
    model = Tiny(ep_rank, 2)
    ddp, opt = wrap(model)
    _train(ddp, opt, ctx.rank, range(0, 2))
    mgr.save(2, _state(model, opt, 2), blocking=True)
    _train(ddp, opt, ctx.rank, range(2, 4))
    mgr.save(4, _state(model, opt, 4), blocking=True)
    at_save = {k: v.detach().clone() for k, v in _state(model, opt, 4)["model"].items()}
    _train(ddp, opt, ctx.rank, range(4, 6))
    straight = {k: v.detach().clone() for k, v in _state(model, opt, 6)["model"].items()}
    ddp.close()
    dist.barrier()  # rank 0 has committed step 4

    fresh = Tiny(ep_rank, 2, seed=5)  # other values everywhere: all of them must come from the checkpoint
    ddp2, opt2 = wrap(fresh)
    saved = mgr.load()
    _restore(fresh, opt2, saved)
    _train(ddp2, opt2, ctx.rank, range(saved["step"], 6))
    resumed = {k: v.detach().clone() for k, v in _state(fresh, opt2, 6)["model"].items()}
    ddp2.close()
    return {"step": saved["step"], "global_names": sorted(saved["model"]), "at_save": at_save,
            "bitwise": all(torch.equal(straight[k], resumed[k]) for k in straight),
            "moved": any(not torch.equal(at_save[k], straight[k]) for k in straight)}


def skip_and_fail_together(ctx, root: str) -> dict:
    """A save still persisting on one rank makes every rank skip (policy="skip"); one rank's failed save makes
    every rank's next save raise, so no rank is left waiting in the exchange."""
    import time

    from fireflyer.checkpoint import CheckpointError, shard

    _pg(ctx)
    out: dict = {}
    real_write = shard.write
    mgr = CheckpointManager(root, kind="sharded", policy="skip", commit_timeout=3)
    if ctx.rank == 1:  # rank 1's disk is slow
        shard.write = lambda *a, **kw: (time.sleep(1.5), real_write(*a, **kw))[1]
    out["first"] = mgr.save(1, held_state(ctx.rank))
    out["while_busy"] = mgr.save(2, held_state(ctx.rank))  # rank 1 is still writing step 1
    mgr.wait()
    shard.write = real_write
    dist.barrier()
    out["after"] = mgr.save(3, held_state(ctx.rank), blocking=True)
    dist.barrier()

    def broken(*a, **kw):
        raise OSError("no space left on device")

    if ctx.rank == 2:
        shard.write = broken
    mgr.save(4, held_state(ctx.rank))  # fails on rank 2, so rank 0 cannot commit it either
    try:
        mgr._thread.join(10)
    finally:
        shard.write = real_write
    try:
        mgr.save(5, held_state(ctx.rank), blocking=True)
        out["next"] = "no error"
    except CheckpointError as exc:
        out["next"] = str(exc)
    out["latest"] = mgr.latest()
    return out
