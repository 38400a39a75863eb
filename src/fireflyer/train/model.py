"""A small decoder-only transformer (GPT): the model the main job trains.

Each of ``layers`` blocks is pre-LayerNorm: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``.
Attention is causal multi-head self-attention through
``F.scaled_dot_product_attention`` (so a fused kernel runs where one exists); the MLP
widens by 4 with GELU. Positions are learned embeddings. The output projection shares
its weight with the token embedding ("tied embeddings"), which saves ``vocab × d_model``
parameters and helps a small model learn. There is no dropout, so a step is a pure
function of the weights and the batch, which keeps runs bitwise reproducible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Everything that fixes the model's parameter shapes. Two runs can share weights iff these match."""

    vocab_size: int
    context: int
    layers: int
    d_model: int
    heads: int


class CausalSelfAttention(nn.Module):
    """Multi-head attention where position t attends to positions 0..t only."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (b, t, d) -> (b, heads, t, d / heads)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """One pre-LN transformer block: attention then MLP, each on a residual branch."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids ``(batch, time)`` in, next-token logits ``(batch, time, vocab)`` out."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        self.tok = nn.Embedding(shape.vocab_size, shape.d_model)
        self.pos = nn.Embedding(shape.context, shape.d_model)
        self.blocks = nn.ModuleList(Block(shape.d_model, shape.heads) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.d_model)
        self.head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2's scheme: N(0, 0.02) everywhere, and the projections that write into the
        # residual stream scaled down by sqrt(2 * layers) so its variance stays put with depth.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() < 2:  # LayerNorm gains
                nn.init.ones_(p)
            else:
                residual = name.endswith(("proj.weight", "mlp.2.weight"))
                std = 0.02 / math.sqrt(2 * self.shape.layers) if residual else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def num_parameters(self) -> int:
        """Distinct parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.shape.context:
            raise ValueError(f"sequence of {t} tokens is longer than the model's context of {self.shape.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, *, temperature: float = 0.8,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Extend ``idx`` (1-D or ``(batch, time)``) by ``new_tokens`` sampled tokens.

        ``temperature`` 0 means greedy decoding; otherwise tokens are drawn from the
        softmax of ``logits / temperature`` with ``generator``, so a seeded generator
        gives the same text every time.
        """
        squeeze = idx.dim() == 1
        idx = idx.view(1, -1) if squeeze else idx
        for _ in range(new_tokens):
            logits = self(idx[:, -self.shape.context:])[:, -1, :]
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx.view(-1) if squeeze else idx
