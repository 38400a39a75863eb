"""A small GPT for the haiscale benchmarks and tests: pre-norm blocks, causal attention, tied embeddings.

Parameters: ``vocab*dim + seq*dim + layers*(12*dim^2 + 13*dim) + 2*dim`` (the head
shares the token embedding). :meth:`GPTConfig.for_params` picks the width that comes
closest to a target count, so ``--params 25M`` and ``--params 1M`` give similar shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

HEAD_DIM = 64


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab: int = 8192
    dim: int = 512
    layers: int = 6
    heads: int = 8
    seq: int = 128
    """Context length (positions)."""

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "layers", "heads", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(f"GPTConfig.dim ({self.dim}) must be a multiple of heads ({self.heads})")

    @property
    def num_params(self) -> int:
        d = self.dim
        return self.vocab * d + self.seq * d + self.layers * (12 * d * d + 13 * d) + 2 * d

    @classmethod
    def for_params(cls, target: int, *, layers: int, vocab: int = 8192, seq: int = 128) -> GPTConfig:
        """The config whose width comes closest to ``target``: 16, 32, 48, then multiples of 64 (heads of 64)."""
        if target < 1 or layers < 1:
            raise ValueError(f"need a positive parameter target and layer count, got {target} and {layers}")
        best = None
        for dim in [16, 32, 48, *range(HEAD_DIM, 16385, HEAD_DIM)]:
            cfg = cls(vocab=vocab, dim=dim, layers=layers, heads=max(1, dim // HEAD_DIM), seq=seq)
            if best is None or abs(cfg.num_params - target) < abs(best.num_params - target):
                best = cfg
            if cfg.num_params > target:
                break
        assert best is not None
        return best


class Block(nn.Module):
    """One transformer block: the FSDP unit."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / (2 * cfg.layers) ** 0.5 if name.endswith(("proj.weight", "out.weight"))
                                else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``idx`` (batch, time) against ``targets``."""
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(cfg: GPTConfig, seed: int = 0) -> GPT:
    """The same model on every rank: seeded construction."""
    torch.manual_seed(seed)
    return GPT(cfg)


def batch(cfg: GPTConfig, *, rank: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens for ``step``: seeded by (rank, step), so any layout can rebuild them."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    tokens = torch.randint(0, cfg.vocab, (size, cfg.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]
