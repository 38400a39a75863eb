"""Rank-side functions for haiscale DDP with an expert group (2 emulated nodes x 2 ranks).

The layout of the MoE tests: EP groups {0, 1} and {2, 3} (inside a node), so ranks 0 and
2 hold the same experts, and so do 1 and 3: the expert (data-parallel) groups are
{0, 2} and {1, 3}; the dense group is all four.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from fireflyer.testing.cases.ddp import ensure_pg

EXPERT_GROUPS = ([0, 2], [1, 3])
WIDTH = 8


class ExpertNet(nn.Module):
    """A dense Linear and two "expert" Linears; ``spare`` is used on rank 1 only.

    The experts are registered before the dense layer but used after it, so the first
    step's gradient order differs from the planned one and the buckets are rebuilt.
    """

    def __init__(self, rank: int) -> None:
        super().__init__()
        from fireflyer.haiscale.expert import mark_expert

        ep_rank = rank % 2
        torch.manual_seed(1000 + rank)  # every rank starts different: wrapping must broadcast per group
        self.expert = nn.Linear(WIDTH, WIDTH)
        self.spare = nn.Linear(WIDTH, WIDTH)
        self.dense = nn.Linear(WIDTH, WIDTH)
        for p in (*self.expert.parameters(), *self.spare.parameters()):
            mark_expert(p, ep_size=2)
        self.ep_rank = ep_rank

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = torch.tanh(self.dense(x))
        out = self.expert(h)
        if rank == 1:
            out = out + self.spare(h)
        return out


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(31 * step + rank))


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    return model(_batch(rank, step), rank).square().mean()


def _groups(backend: str | None):
    """(dense group or None for the default, this rank's expert group); every rank creates every group in order."""
    dense = dist.new_group(backend=backend) if backend else None
    mine = None
    for ranks in EXPERT_GROUPS:
        g = dist.new_group(ranks, backend=backend)
        if dist.get_rank() in ranks:
            mine = g
    return dense, mine


def _start_values(holder: int) -> dict[str, torch.Tensor]:
    """The values a rank holds after wrapping: dense ones from rank 0, experts from its expert group's rank 0."""
    dense = ExpertNet(0).state_dict()
    experts = ExpertNet(holder % 2).state_dict()
    return {k: (experts[k] if not k.startswith("dense.") else dense[k]).clone() for k in dense}


def _local_grads(rank: int, step: int) -> dict[str, torch.Tensor | None]:
    """What backward gives on ``rank`` alone, from the values it holds after wrapping."""
    net = ExpertNet(rank)
    net.load_state_dict(_start_values(rank))
    _loss(net, rank, step).backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()}


def grads_per_group(ctx, backend: str | None = None) -> dict:
    """Two backward passes (the buckets are rebuilt after the first); compare every grad with the hand average.

    Dense grads: the mean over all four ranks. Expert grads: the mean over this rank's
    expert group only. ``spare`` (used on rank 1 only): half of rank 1's grad on ranks 1
    and 3, and None on ranks 0 and 2, where no rank of their group used it.
    """
    from fireflyer.haiscale import DistributedDataParallel

    ensure_pg(ctx)
    dense_group, expert_group = _groups(backend)
    model = ExpertNet(ctx.rank)
    ddp = DistributedDataParallel(model, process_group=dense_group, expert_process_group=expert_group,
                                  bucket_cap_mb=0.0002, first_bucket_mb=0.0001)
    held = {k: v.clone() for k, v in model.state_dict().items()}
    want_start = _start_values(ctx.rank)
    start_ok = all(torch.equal(held[k], want_start[k]) for k in held)
    plans = [[b.params for b in ddp._buckets]]
    out: dict = {"start_ok": start_ok, "steps": []}
    for step in range(2):
        model.zero_grad(set_to_none=True)
        _loss(ddp, ctx.rank, step).backward()
        plans.append([b.params for b in ddp._buckets])
        per_rank = [_local_grads(r, step) for r in range(ctx.world_size)]
        replicas = next(g for g in EXPERT_GROUPS if ctx.rank in g)
        diffs, everyone_diff = {}, {}
        for name, p in model.named_parameters():
            over = range(ctx.world_size) if name.startswith("dense.") else replicas
            parts = [per_rank[r][name] for r in over if per_rank[r][name] is not None]
            want = None if not parts else sum(parts) / len(over)
            if want is None or p.grad is None:
                diffs[name] = "both None" if want is None and p.grad is None else f"got {p.grad}, want {want}"
                continue
            diffs[name] = (p.grad - want).abs().max().item()
            if name.startswith("expert."):
                everyone = sum(per_rank[r][name] for r in range(ctx.world_size)) / ctx.world_size
                everyone_diff[name] = (p.grad - everyone).abs().max().item()
        out["steps"].append({"diffs": diffs, "vs_all_ranks": everyone_diff})
    out["labels"] = sorted({b.group for b in ddp._buckets})
    out["groups_never_mixed"] = all(len({ddp._labels[i] for i in b.params}) == 1 for b in ddp._buckets)
    out["rebuilt"] = plans[0] != plans[1] and plans[1] == plans[2]
    ddp.close()
    return out


def no_expert_group_is_plain_ddp(ctx) -> bool:
    """Experts marked with ep_size=1 (replicated) and no expert group: every grad is the mean over all ranks."""
    from fireflyer.haiscale import DistributedDataParallel
    from fireflyer.haiscale.expert import mark_expert

    ensure_pg(ctx)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
    mark_expert(net[2].weight)
    ddp = DistributedDataParallel(net)
    ddp(_batch(ctx.rank, 0)).square().mean().backward()
    got = [p.grad.clone() for p in net.parameters()]
    ddp.close()
    per_rank = []
    for r in range(ctx.world_size):
        torch.manual_seed(0)
        local = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
        local(_batch(r, 0)).square().mean().backward()
        per_rank.append([p.grad for p in local.parameters()])
    want = [((g0 + g1) + (g2 + g3)) / 4 for g0, g1, g2, g3 in zip(*per_rank)]
    return all(torch.equal(a, b) for a, b in zip(got, want))


def bad_groups(ctx) -> dict[str, str]:
    """Every mistake fails on every rank, before any collective, with a message that says what to pass."""
    from fireflyer.haiscale import DistributedDataParallel

    ensure_pg(ctx)
    rank = ctx.rank
    groups = [dist.new_group(ranks) for ranks in EXPERT_GROUPS]  # every rank creates both
    ep_groups = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]
    mine = groups[rank % 2]
    out: dict[str, str] = {}

    def attempt(key: str, **kw) -> None:
        try:
            DistributedDataParallel(ExpertNet(rank), **kw)
            out[key] = "no error"
        except (ValueError, TypeError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"

    attempt("not_member", expert_process_group=groups[1 - rank % 2])  # the other group: a placeholder here
    attempt("no_group")  # sharded experts (ep_size=2) without an expert group
    attempt("both", expert_process_group=mine, group_of=lambda n, p: None)
    attempt("not_inside", process_group=ep_groups[rank // 2], expert_process_group=mine)
    attempt("group_of_type", group_of=lambda n, p: "dp")
    attempt("group_of_not_callable", group_of=3)

    # A rank that marks different parameters as experts: caught by the model check, on every rank.
    model = ExpertNet(rank)
    if rank == 2:
        del model.spare.weight._fireflyer_expert
    try:
        DistributedDataParallel(model, expert_process_group=mine)
        out["marks_differ"] = "no error"
    except ValueError as exc:
        out["marks_differ"] = str(exc)
    return out
