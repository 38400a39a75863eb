"""A small DeepSeekMoE: the dense GPT of :mod:`fireflyer.train.model` with MoE layers for its MLPs.

Each block is pre-LayerNorm, ``x + attn(ln(x))`` then ``x + moe(ln(x))``, with the dense
model's :class:`~fireflyer.train.model.CausalSelfAttention` and a
:class:`~fireflyer.haiscale.moe.MoE` (routed plus shared SwiGLU experts); the first
``first_dense`` blocks may keep the dense GELU MLP, as DeepSeekMoE keeps its first layer dense.
Embeddings are learned and tied, as in the dense model, which this module leaves untouched.

Under expert parallelism every rank builds the model with the same shape and seed and its EP
group: the dense weights (embeddings, attention, norms, gates, shared experts) come out the same
on every rank, and each MoE layer holds its slice of the routed experts, seeded per global
expert, so any EP size holds the same model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fireflyer.errors import UserError, UserTypeError
from fireflyer.haiscale.moe import MoE, MoEConfig, MoEStats
from fireflyer.train.model import Block, CausalSelfAttention, ModelShape, generate


@dataclass(frozen=True, kw_only=True)
class MoEShape:
    """Everything that fixes a :class:`MoEGPT`'s parameters and routing."""

    vocab_size: int
    context: int
    layers: int
    d_model: int
    heads: int
    n_routed: int
    """Routed experts per MoE layer (over every EP rank)."""
    n_shared: int = 1
    """Shared experts per MoE layer."""
    expert_hidden: int
    """Hidden width of one expert."""
    top_k: int = 2
    first_dense: int = 0
    """How many leading blocks keep the dense MLP (``0 <= first_dense <= layers``)."""
    score: str = "sigmoid"
    bias_update_speed: float = 0.001
    aux_loss_alpha: float = 0.0
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        self.dense_shape()  # checks the attention side
        self.moe_config()  # checks the experts and routing
        if isinstance(self.first_dense, bool) or not isinstance(self.first_dense, int):
            raise UserTypeError(f"MoEShape.first_dense must be an int, got {type(self.first_dense).__name__}")
        if not 0 <= self.first_dense <= self.layers:
            raise UserError(f"MoEShape.first_dense must be in [0, layers={self.layers}], got {self.first_dense}")

    def dense_shape(self) -> ModelShape:
        """The dense model with the same embeddings and attention."""
        return ModelShape(vocab_size=self.vocab_size, context=self.context, layers=self.layers,
                          d_model=self.d_model, heads=self.heads)

    def moe_config(self) -> MoEConfig:
        """The config of each MoE layer."""
        return MoEConfig(d_model=self.d_model, n_routed=self.n_routed, n_shared=self.n_shared,
                         expert_hidden=self.expert_hidden, top_k=self.top_k, score=self.score,
                         bias_update_speed=self.bias_update_speed, aux_loss_alpha=self.aux_loss_alpha,
                         capacity_factor=self.capacity_factor)


class MoEBlock(nn.Module):
    """One pre-LN block: causal attention, then a MoE layer, each on a residual branch."""

    def __init__(self, d_model: int, heads: int, config: MoEConfig, *, ep_group: dist.ProcessGroup | None,
                 seed: int, out_std: float | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.moe = MoE(config, ep_group=ep_group, seed=seed, out_std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoEGPT(nn.Module):
    """Token ids ``(batch, time)`` in, next-token logits out; with targets, the loss plus every
    layer's balance loss (when ``aux_loss_alpha > 0``).

    Args:
        shape: the model's shape.
        ep_group: the expert-parallel group every MoE layer shards its routed experts over.
        seed: fixes every initial weight, independently of ``ep_group`` and of torch's global RNG.
    """

    def __init__(self, shape: MoEShape, *, ep_group: dist.ProcessGroup | None = None, seed: int = 0) -> None:
        super().__init__()
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**40:
            raise UserError(f"MoEGPT seed must be an int in [0, 2**40), got {seed!r}")
        self.shape = shape
        d, config = shape.d_model, shape.moe_config()
        residual_std = 0.02 / math.sqrt(2 * shape.layers)
        self.tok = nn.Embedding(shape.vocab_size, d)
        self.pos = nn.Embedding(shape.context, d)
        self.blocks = nn.ModuleList(
            Block(d, shape.heads) if i < shape.first_dense else
            MoEBlock(d, shape.heads, config, ep_group=ep_group, seed=(seed << 16) + i, out_std=residual_std)
            for i in range(shape.layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, shape.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        self._init_dense(torch.Generator().manual_seed(seed), residual_std)

    def _init_dense(self, generator: torch.Generator, residual_std: float) -> None:
        """GPT-2's scheme for everything outside the MoE layers (which seed themselves)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if ".moe." in name:
                    continue
                if name.endswith("bias"):
                    p.zero_()
                elif p.dim() < 2:
                    p.fill_(1.0)
                else:
                    std = residual_std if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                    p.normal_(0.0, std, generator=generator)

    def moe_layers(self) -> list[MoE]:
        """The MoE layers, first to last."""
        return [b.moe for b in self.blocks if isinstance(b, MoEBlock)]

    def expert_parameters(self) -> list[nn.Parameter]:
        """Every routed expert's weights (sharded over EP)."""
        return [p for m in self.moe_layers() for p in m.expert_parameters()]

    def expert_stats(self) -> list[MoEStats | None]:
        """Each MoE layer's stats of the last forward."""
        return [m.stats for m in self.moe_layers()]

    def update_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """Every MoE layer's balancing step (:meth:`fireflyer.haiscale.moe.MoE.update_bias`): after
        ``optimizer.step()``, on every rank of ``group`` (the whole data-parallel world)."""
        for m in self.moe_layers():
            m.update_bias(group)

    def num_parameters(self) -> int:
        """Distinct parameters on this rank (the tied embedding once; only this rank's experts)."""
        return sum(p.numel() for p in self.parameters())

    def aux_loss(self) -> torch.Tensor | None:
        """The sum of the last forward's balance losses, or None when they are off."""
        losses = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def generate(self, idx: torch.Tensor, new_tokens: int, *, temperature: float = 0.8,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Extend ``idx`` by ``new_tokens`` sampled tokens (:func:`fireflyer.train.model.generate`); without
        EP, since every forward of an EP layer is a collective of its group."""
        return generate(self, self.shape.context, idx, new_tokens, temperature=temperature, generator=generator)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``idx``; with ``targets``, the mean next-token cross-entropy plus the balance losses."""
        t = idx.shape[1]
        if t > self.shape.context:
            raise UserError(f"sequence of {t} tokens is longer than the model's context of {self.shape.context}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        aux = self.aux_loss()
        return loss + aux if aux is not None else loss
