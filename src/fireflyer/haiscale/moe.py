"""A DeepSeekMoE layer with expert parallelism: fine-grained routed experts plus shared experts.

Each token goes to the ``top_k`` of ``n_routed`` small routed experts its gate picks, and
always through the ``n_shared`` shared experts; the layer's output is the shared experts'
output plus the routed experts' outputs weighted by the gate (DeepSeekMoE, arXiv 2401.06066).
Experts are SwiGLU MLPs, ``w2(silu(w1 x) * w3 x)``, without biases, as in DeepSeek's models.

**Routing** (DeepSeek-V3, arXiv 2412.19437): the gate's affinities ``s`` are the sigmoid (or
softmax) of ``x @ gate.T``; the experts are chosen by the top-k of ``s + expert_bias`` and
weighted by their plain ``s``, normalised to sum to 1 over the chosen k. The bias is how the
load is balanced without an auxiliary loss: after each step, :meth:`MoE.update_bias` moves each
expert's bias by ``bias_update_speed`` towards the mean load (up if the expert was under-used,
down if over-used), which changes which experts are *chosen* but never the weights, so the
gradient is that of the plain model. An optional sequence-wise balance loss
(``aux_loss_alpha > 0``) is kept in :attr:`MoE.aux_loss` for the caller to add.

**Expert parallel**: with ``ep_group`` of size ``ep``, rank ``r`` of that group holds global
experts ``[r*E/ep, (r+1)*E/ep)``. Every rank routes its own tokens, sorts the (token, expert)
assignments by expert, sends each rank the rows for its experts with one uneven
``all_to_all_single`` (:mod:`fireflyer.haiscale.moe_dispatch`), runs each local expert once on
one contiguous block, and sends the results back the same way. The gate, the bias and the
shared experts are replicated. Each expert's weights come from a generator seeded by
``(seed, global expert index)``, so a sharded layer holds exactly its slice of the unsharded one.

**Gradients under EP**: a rank's expert gradients are summed over the tokens of every rank of
its EP group, while its dense gradients come from its own tokens only. The layer scales the
expert gradients by ``1/ep`` so both are gradients of a mean over ranks; then averaging dense
gradients over the dense group (dp x ep) and expert gradients over the expert group (the ranks
that hold the same experts, dp) gives exactly the gradient of one process on the whole batch.
:func:`is_expert_param` tells the two kinds apart.

**Canonical order**: :meth:`MoE.set_order` ``("canonical")`` (or
:class:`~fireflyer.haiscale.moe_steps.CanonicalMoE`, which runs whole steps) makes the outputs
and every gradient independent of the layout, bit for bit: one process holding every expert
and running the global batch's micro-batches in turn equals EP, and EP x DP. Each expert runs
per source micro-batch, a token's expert outputs meet by ascending expert index, and the
expert weights' gradients are summed in the canonical tree over global micro-batch indices
(:mod:`fireflyer.haiscale.moe_canonical`).

**Drops**: dropless by default. With ``capacity_factor`` set, each rank lets at most
``ceil(capacity_factor * tokens * top_k / n_routed)`` of its own assignments reach each expert
(the highest-affinity ones); the rest are dropped (their output from that expert is zero,
the residual carries the token) and counted in :attr:`MoE.stats`.
"""

from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fireflyer.errors import UsageError, UserError, UserTypeError
from fireflyer.haiscale import moe_canonical as canonical
from fireflyer.haiscale.expert import is_expert_param, mark_expert
from fireflyer.haiscale.moe_dispatch import ExchangeTally, exchange_counts, exchange_rows

SCORES = ("sigmoid", "softmax")
ORDERS = ("fast", "canonical")
_STREAM_GATE, _STREAM_SHARED, _STREAM_EXPERT = 0, 1, 2


def _int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserTypeError(f"MoEConfig.{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise UserError(f"MoEConfig.{name} must be >= {low}, got {value}")


def _real(name: str, value, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserTypeError(f"MoEConfig.{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise UserError(f"MoEConfig.{name} must be a finite number {'>' if positive else '>='} 0, got {value}")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """The shape and the routing rules of one MoE layer."""

    d_model: int
    """Width of the tokens in and out."""
    n_routed: int
    """Fine-grained routed experts (all of them, over every EP rank)."""
    n_shared: int = 1
    """Shared experts every token goes through (0 for none)."""
    expert_hidden: int
    """Hidden width of one expert (routed or shared)."""
    top_k: int = 2
    """Routed experts per token, ``1 <= top_k <= n_routed``."""
    score: str = "sigmoid"
    """Gate affinity: ``"sigmoid"`` (DeepSeek-V3) or ``"softmax"`` (DeepSeekMoE)."""
    norm_topk: bool = True
    """Normalise the chosen k affinities to sum to 1 (DeepSeek-V3 does, for sigmoid scores)."""
    bias_update_speed: float = 0.001
    """Step of the auxiliary-loss-free balancing bias (``gamma`` in DeepSeek-V3); 0 turns it off."""
    aux_loss_alpha: float = 0.0
    """Weight of the sequence-wise balance loss; 0 turns it off."""
    capacity_factor: float | None = None
    """None: dropless. Else each expert takes at most ``ceil(cf * tokens * top_k / n_routed)`` of a rank's
    assignments per forward."""
    init_std: float = 0.02
    """Standard deviation of the gate's initial weights and of the experts' output projections ``w2``."""
    in_std: float | None = None
    """Standard deviation of the experts' input projections ``w1`` and ``w3``; None: ``d_model ** -0.5``
    (the fan-in scale). A SwiGLU's output is the product of two projections, so at GPT's 0.02 it starts
    near zero and the experts learn slowly: the preset MoE's validation loss after 150 steps (one
    process) was 2.59 at 0.02 against 2.07 at the fan-in scale."""

    def __post_init__(self) -> None:
        for name, low in (("d_model", 1), ("n_routed", 1), ("n_shared", 0), ("expert_hidden", 1), ("top_k", 1)):
            _int(name, getattr(self, name), low)
        if self.top_k > self.n_routed:
            raise UserError(f"MoEConfig.top_k ({self.top_k}) must be at most n_routed ({self.n_routed})")
        if self.score not in SCORES:
            raise UserError(f"MoEConfig.score must be one of {', '.join(SCORES)}, got {self.score!r}")
        if not isinstance(self.norm_topk, bool):
            raise UserTypeError(f"MoEConfig.norm_topk must be a bool, got {type(self.norm_topk).__name__}")
        _real("bias_update_speed", self.bias_update_speed, positive=False)
        _real("aux_loss_alpha", self.aux_loss_alpha, positive=False)
        if self.capacity_factor is not None:
            _real("capacity_factor", self.capacity_factor, positive=True)
        _real("init_std", self.init_std, positive=True)
        if self.in_std is not None:
            _real("in_std", self.in_std, positive=True)


@dataclass
class MoEStats:
    """What one forward of a layer did (its backward adds its exchanges to :attr:`all_to_all`)."""

    tokens: list[int]
    """Assignments each global expert processed, summed over the EP group (after drops)."""
    dropped: int
    """Assignments dropped for capacity, summed over the EP group."""
    all_to_all: ExchangeTally = field(default_factory=ExchangeTally)
    """Bytes and seconds of this rank's all-to-alls (all zero without EP)."""

    @property
    def imbalance(self) -> float:
        """Busiest expert's tokens over the mean (1.0 is perfect balance)."""
        total = sum(self.tokens)
        return max(self.tokens) * len(self.tokens) / total if total else 1.0

    def as_dict(self) -> dict:
        """Plain numbers for a progress line or ``run.json``: tokens, imbalance, dropped, all_to_all."""
        a = self.all_to_all
        return {"tokens": list(self.tokens), "imbalance": self.imbalance, "dropped": self.dropped,
                "all_to_all": {"bytes_sent": a.bytes_sent, "bytes_received": a.bytes_received,
                               "seconds": a.seconds, "calls": a.calls}}


def _generator(seed: int, stream: int) -> torch.Generator:
    """A generator for one ``(seed, stream)`` pair, independent of every other pair."""
    digest = hashlib.blake2b(f"fireflyer.moe/{seed}/{stream}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` (the expert weights' ``1/ep``)."""

    @staticmethod
    def forward(ctx, x, scale):  # noqa: D102
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return grad * ctx.scale, None


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: the shared experts, as one MLP of their summed hidden width."""

    def __init__(self, d_model: int, hidden: int, generator: torch.Generator, std: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        with torch.no_grad():
            for lin in (self.w1, self.w3, self.w2):
                lin.weight.normal_(0.0, std, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RoutedExperts(nn.Module):
    """This rank's routed experts, ``count`` SwiGLU MLPs stacked: ``w1``/``w3`` ``(count, hidden, d)``,
    ``w2`` ``(count, d, hidden)``; local expert ``e`` is global expert ``first + e``."""

    def __init__(self, d_model: int, hidden: int, count: int, first: int, seed: int, std: float,
                 ep_size: int = 1) -> None:
        super().__init__()
        self.first = first
        self.w1 = nn.Parameter(torch.empty(count, hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(count, hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(count, d_model, hidden))
        with torch.no_grad():
            for e in range(count):
                g = _generator(seed, _STREAM_EXPERT + first + e)
                for w in (self.w1, self.w3, self.w2):
                    w[e].normal_(0.0, std, generator=g)
        for p in (self.w1, self.w3, self.w2):
            mark_expert(p, ep_size=ep_size)

    def forward(self, x: torch.Tensor, rows: list[int], grad_scale: float = 1.0) -> torch.Tensor:
        """``x`` holds ``rows[e]`` rows for local expert ``e``, in expert order; each expert runs once."""
        w1, w3, w2 = self.w1, self.w3, self.w2
        if grad_scale != 1.0:
            w1, w3, w2 = (_ScaleGrad.apply(w, grad_scale) for w in (w1, w3, w2))
        outs = [F.linear(F.silu(F.linear(xb, w1[e])) * F.linear(xb, w3[e]), w2[e])
                for e, xb in enumerate(x.split(rows))]
        return torch.cat(outs) if outs else x[:0]


@contextmanager
def uncounted(module: nn.Module) -> Iterator[None]:
    """Forwards and backwards inside this block leave every MoE layer of ``module``'s load, all-to-all tallies
    and canonical expert gradients alone: for the extra forward and backward a pipeline stage runs on its
    first step, on uninitialised tensors, to learn its tensors' shapes, which must not move the balancing
    bias nor reach a gradient."""
    layers = [m for m in module.modules() if isinstance(m, MoE)]
    before = [m._counting for m in layers]
    grads = [m.expert_grads for m in layers if m.expert_grads is not None]
    for m in layers:
        m._counting = False
    for g in grads:
        g.muted = True
    try:
        yield
    finally:
        for m, was in zip(layers, before):
            m._counting = was
        for g in grads:
            g.muted = False


class MoE(nn.Module):
    """A DeepSeekMoE layer, ``(batch, time, d_model)`` in and out; see the module docstring.

    Args:
        config: the layer's shape and routing.
        ep_group: the expert-parallel process group, or None for every expert on this rank.
            Every rank of the group must build the layer with the same config and seed.
        seed: fixes every initial weight: the gate and shared experts (the same on every rank)
            and each routed expert by its global index.
        out_std: standard deviation of the experts' output projections ``w2`` (default
            ``config.init_std``; GPT-style models scale it down with depth).
    """

    def __init__(self, config: MoEConfig, *, ep_group: dist.ProcessGroup | None = None, seed: int = 0,
                 out_std: float | None = None) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise UserTypeError(f"MoE needs a MoEConfig, got {type(config).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise UserError(f"MoE seed must be an int in [0, 2**63), got {seed!r}")
        self.config = config
        self.ep_group = ep_group
        self.ep_size, self.ep_rank = 1, 0
        if ep_group is not None:
            if not dist.is_initialized():
                raise UserError("MoE(ep_group=...) needs torch.distributed initialised first")
            self.ep_size, self.ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
            if self.ep_rank < 0:
                raise UserError("this rank is not a member of ep_group; pass the EP group this rank belongs to")
        E = config.n_routed
        if E % self.ep_size:
            raise UserError(f"EP ({self.ep_size}) does not divide the expert count ({E}); use an EP size that "
                            f"divides n_routed")
        self.local_experts = E // self.ep_size
        d, h, std = config.d_model, config.expert_hidden, config.init_std
        self.gate = nn.Linear(d, E, bias=False)
        with torch.no_grad():
            self.gate.weight.normal_(0.0, std, generator=_generator(seed, _STREAM_GATE))
        self.register_buffer("expert_bias", torch.zeros(E))
        self.shared = SwiGLU(d, config.n_shared * h, _generator(seed, _STREAM_SHARED), std) if config.n_shared else None
        self.experts = RoutedExperts(d, h, self.local_experts, self.ep_rank * self.local_experts, seed, std,
                                     ep_size=self.ep_size)
        in_std = config.in_std if config.in_std is not None else d ** -0.5
        with torch.no_grad():  # rescaled, not redrawn, so the generators' streams stay as they are
            for w in (self.experts.w1, self.experts.w3) + ((self.shared.w1.weight, self.shared.w3.weight)
                                                         if self.shared is not None else ()):
                w.mul_(in_std / std)
        if out_std is not None:
            _real("out_std", out_std, positive=True)
            with torch.no_grad():  # rescaled, not redrawn, so the generators' streams stay as they are
                self.experts.w2.mul_(out_std / std)
                if self.shared is not None:
                    self.shared.w2.weight.mul_(out_std / std)
        self._step_load = torch.zeros(E, dtype=torch.int64)
        self.aux_loss: torch.Tensor | None = None
        """The last forward's sequence-wise balance loss (already times ``aux_loss_alpha``), or None when off."""
        self.stats: MoEStats | None = None
        """What the last forward did."""
        self._tallies: list[ExchangeTally] = []  # every training forward's since take_exchange_totals()
        self._counting = True  # False inside uncounted(): forwards that are not training (shape inference)
        self.order = "fast"
        """``"fast"`` or ``"canonical"`` (:meth:`set_order`)."""
        self.expert_grads: canonical.ExpertGrads | None = None
        """In the canonical order: the step's expert-weight gradients, per source stream."""

    @property
    def global_experts(self) -> range:
        """The global indices of the routed experts this rank holds."""
        return range(self.experts.first, self.experts.first + self.local_experts)

    def expert_parameters(self) -> Iterator[nn.Parameter]:
        """The routed experts' weights (sharded over EP): what :func:`is_expert_param` marks."""
        return (p for p in self.parameters() if is_expert_param(p))

    # -- order ------------------------------------------------------------------------------
    def set_order(self, order: str) -> None:
        """``"fast"`` (the default) or ``"canonical"``: outputs and gradients whose bits do not depend on the
        expert-parallel layout (:mod:`fireflyer.haiscale.moe_canonical`). In the canonical order the expert
        weights get their gradients from :meth:`finish_expert_grads`, not from backward: run the steps with
        :class:`~fireflyer.haiscale.moe_steps.CanonicalMoE`, or call :meth:`begin_step`, then
        :meth:`end_micro_batch` after each micro-batch's backward, then :meth:`finish_expert_grads`."""
        if order not in ORDERS:
            raise UserError(f"MoE order must be one of {list(ORDERS)}, got {order!r}")
        self.order = order
        self.expert_grads = (canonical.ExpertGrads([self.experts.w1, self.experts.w3, self.experts.w2], self.ep_size)
                             if order == "canonical" else None)

    def _canonical_grads(self) -> canonical.ExpertGrads:
        if self.expert_grads is None:
            raise UsageError("this MoE layer is in the fast order; call set_order('canonical') first")
        return self.expert_grads

    def begin_step(self) -> None:
        """Canonical order: start a step (empty expert-gradient streams)."""
        self._canonical_grads().begin_step()

    def end_micro_batch(self) -> None:
        """Canonical order: after a micro-batch's backward, fold its expert gradients (one term per source)."""
        self._canonical_grads().end_micro_batch()

    def finish_expert_grads(self, count: int, group: dist.ProcessGroup | None = None) -> None:
        """Canonical order: end the step; each expert weight's ``.grad`` becomes the sum of its gradients over
        the ``count`` global micro-batches, in the canonical tree, divided by ``count``.

        This rank sums its source streams, ``group`` (the ranks holding the same experts, an hfreduce group
        made with ``HFReduceConfig(order="canonical")``; None when there is one copy) sums the copies. A
        collective on ``group``: every rank calls it for its layers in the same order."""
        grads = self._canonical_grads()
        total = grads.total()
        canonical.reduce_expert_sum(total, group)
        grads.publish(total, count)

    # -- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if x.dim() != 3 or x.shape[-1] != c.d_model:
            raise UserError(f"MoE takes (batch, time, {c.d_model}) tokens, got shape {tuple(x.shape)}")
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        scores, chosen, weights = self._route(flat)
        self.aux_loss = self._aux_loss(scores, chosen, b, t) if c.aux_loss_alpha > 0 else None
        out = self._routed(flat, scores, chosen, weights)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(b, t, d)

    def _route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Affinities ``(N, E)``, the chosen experts ``(N, k)`` (biased top-k) and their weights ``(N, k)``."""
        c = self.config
        logits = self.gate(flat).float()
        scores = torch.sigmoid(logits) if c.score == "sigmoid" else torch.softmax(logits, dim=-1)
        chosen = torch.topk(scores.detach() + self.expert_bias.to(scores.device), c.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if c.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return scores, chosen, weights

    def _aux_loss(self, scores: torch.Tensor, chosen: torch.Tensor, b: int, t: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss ``alpha * sum_i f_i P_i``, averaged over sequences."""
        c, E = self.config, self.config.n_routed
        s = scores.view(b, t, E)
        p = (s / s.sum(dim=-1, keepdim=True)).mean(dim=1)  # (b, E)
        hits = torch.zeros(b, E, device=scores.device).scatter_add_(
            1, chosen.view(b, t * c.top_k), torch.ones(b, t * c.top_k, device=scores.device))
        f = hits * (E / (c.top_k * t))
        return c.aux_loss_alpha * (f * p).sum(dim=-1).mean()

    def _keep(self, expert: torch.Tensor, affinity: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """Which assignments fit their expert's capacity: per expert, the highest-affinity ones first."""
        E = self.config.n_routed
        cap = math.ceil(self.config.capacity_factor * n_tokens * self.config.top_k / E)
        by_score = torch.argsort(affinity, descending=True, stable=True)
        order = by_score[torch.argsort(expert[by_score], stable=True)]
        counts = torch.bincount(expert, minlength=E)
        start = torch.cumsum(counts, 0) - counts
        pos = torch.empty_like(expert)
        pos[order] = torch.arange(expert.numel(), device=expert.device) - start[expert[order]]
        return pos < cap

    def _routed(self, flat: torch.Tensor, scores: torch.Tensor, chosen: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        if self.order == "canonical":
            return canonical.routed(self, flat, scores, chosen, weights)
        expert, assignments, counts, dropped = self.assign(scores, chosen)
        token = assignments // self.config.top_k
        done = self.dispatch(flat[token], counts, dropped)
        combined = torch.zeros_like(flat)
        w = weights.reshape(-1)[assignments].to(flat.dtype)
        return combined.index_add(0, token, done * w.unsqueeze(1))

    def assign(self, scores: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The routing's assignments (``a`` is token ``a // top_k``'s slot ``a % top_k``): the expert of each, the
        kept ones grouped by expert (stable: by token within an expert), the kept count per expert, and how many
        the capacity dropped. Counts the step's load (training, outside :func:`uncounted`)."""
        c, E = self.config, self.config.n_routed
        expert = chosen.reshape(-1)
        if self.training and self._counting:
            self._step_load = self._step_load.to(expert.device) + torch.bincount(expert, minlength=E)
        assignments = torch.arange(expert.numel(), device=chosen.device)
        dropped = 0
        if c.capacity_factor is not None:
            keep = self._keep(expert, scores.detach().gather(1, chosen).reshape(-1), chosen.shape[0])
            dropped = int((~keep).sum())
            assignments = assignments[keep]
        assignments = assignments[torch.argsort(expert[assignments], stable=True)]
        return expert, assignments, torch.bincount(expert[assignments], minlength=E), dropped

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor, dropped: int, run=None) -> torch.Tensor:
        """``rows`` (grouped by global expert, ``counts`` each) through their experts, wherever those sit; the
        outputs in the same order. ``run(rows, blocks)`` runs the experts instead of one block per expert (see
        :meth:`_expert_parallel`)."""
        tally = ExchangeTally()
        if self.training and self._counting:
            self._tallies.append(tally)
        if self.ep_size > 1:
            return self._expert_parallel(rows, counts, dropped, tally, run=run)
        self.stats = MoEStats(tokens=counts.tolist(), dropped=dropped, all_to_all=tally)
        return self.experts(rows, counts.tolist()) if run is None else run(rows, [counts.tolist()])

    def _expert_parallel(self, rows: torch.Tensor, counts: torch.Tensor, dropped: int,
                         tally: ExchangeTally, run=None) -> torch.Tensor:
        """Rows (grouped by global expert) to their experts' ranks, through the experts, and back. ``run(got,
        blocks)``, when given, runs the experts on the rows as they arrive (source-major, expert-minor, ``blocks[s][e]``
        rows from source ``s`` for local expert ``e``) instead of one block per expert."""
        ep, El, E = self.ep_size, self.local_experts, self.config.n_routed
        mine = torch.cat([counts, counts.new_tensor([dropped])]).to(torch.int64).cpu()
        table = exchange_counts(mine, self.ep_group, tally)  # (ep, E + 1): every rank's counts and drops
        self.stats = MoEStats(tokens=table[:, :E].sum(0).tolist(), dropped=int(table[:, E].sum()), all_to_all=tally)
        send = counts.cpu().view(ep, El).sum(1).tolist()
        blocks = table[:, self.ep_rank * El:(self.ep_rank + 1) * El]  # (src, local expert) row counts
        recv = blocks.sum(1).tolist()
        got = exchange_rows(rows, send, recv, self.ep_group, tally)  # source-major, expert-minor
        if run is not None:
            return exchange_rows(run(got, blocks.tolist()), recv, send, self.ep_group, tally)
        # to expert-major (each local expert's rows from every source in one block), and back after
        start = (torch.cumsum(blocks.reshape(-1), 0) - blocks.reshape(-1)).view(ep, El)
        perm = torch.cat([torch.arange(int(start[s, e]), int(start[s, e] + blocks[s, e]))
                          for e in range(El) for s in range(ep)]).to(rows.device)
        done = self.experts(got[perm], blocks.sum(0).tolist(), grad_scale=1.0 / ep)
        back = done[torch.argsort(perm)]
        return exchange_rows(back, recv, send, self.ep_group, tally)

    def take_exchange_totals(self) -> ExchangeTally:
        """The all-to-alls of every training forward (and the backward of each) since the last call, summed;
        a pipeline step runs the layer once per micro-batch, so this is the step's whole exchange."""
        total = ExchangeTally()
        for t in self._tallies:
            total.absorb(t)
        self._tallies = []
        return total

    # -- balancing ----------------------------------------------------------------------------
    @torch.no_grad()
    def update_bias(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Apply DeepSeek-V3's bias update for the step and return the step's per-expert load.

        The load is every training-mode forward's expert choices since the last call (before
        drops, so a gradient-accumulation step counts all its micro-batches), summed over
        ``group`` with one all-reduce: pass the whole data-parallel world (dp x ep), so every
        replica applies the same update and the biases stay identical. Then
        ``bias += bias_update_speed * sign(mean load - load)``.

        Call it once per step, after ``optimizer.step()``, on every rank of ``group`` (it is a
        collective there), so the next step's routing sees it; the bias is a buffer (in
        ``state_dict``), never a parameter, and the optimizer never touches it. A forward run
        again by activation checkpointing counts twice.
        """
        load = self.take_step_load()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(load, group=group)
        return self.apply_load(load)

    def take_step_load(self) -> torch.Tensor:
        """This rank's expert choices since the last call (float64 per global expert), and a fresh count: the
        first half of :meth:`update_bias`, for a caller that sums the loads its own way (over replicas that
        come and go, say) before :meth:`apply_load`."""
        load = self._step_load.to(self.expert_bias.device, torch.float64)
        self._step_load = torch.zeros_like(self._step_load)
        return load

    @torch.no_grad()
    def apply_load(self, load: torch.Tensor) -> torch.Tensor:
        """The bias update for a step's ``load`` summed over every replica (the second half of
        :meth:`update_bias`); returns the load as integers."""
        load = load.to(self.expert_bias.device, torch.float64)
        self.expert_bias += self.config.bias_update_speed * torch.sign(load.mean() - load).to(self.expert_bias.dtype)
        return load.to(torch.int64)

    def extra_repr(self) -> str:
        c = self.config
        return (f"routed={c.n_routed} (local {self.local_experts}, ep {self.ep_size}), shared={c.n_shared}, "
                f"hidden={c.expert_hidden}, top_k={c.top_k}, score={c.score}")
