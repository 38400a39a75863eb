"""A small decoder-only transformer (GPT): the model the main job trains.

Each of ``layers`` blocks is pre-LayerNorm: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``.
Attention is causal multi-head self-attention through
``F.scaled_dot_product_attention`` (so a fused kernel runs where one exists); the MLP
widens by 4 with GELU. Positions are learned embeddings. The output projection shares
its weight with the token embedding ("tied embeddings"), which saves ``vocab × d_model``
parameters and helps a small model learn. There is no dropout, so a step is a pure
function of the weights and the batch, which keeps runs bitwise reproducible.

The benchmarks and tests use this same model at the size they need:
:meth:`ModelShape.for_params` picks the width closest to a parameter count,
:meth:`GPT.seeded` builds the same weights on every rank, ``model(idx, targets)`` gives the
loss, and :func:`synthetic_batch` the seeded tokens any layout can rebuild.
:func:`parallelize_gpt` shards the blocks for tensor parallel (haiscale's styles, this model's names).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from fireflyer.errors import UserError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

HEAD_DIM = 64
"""The head width :meth:`ModelShape.for_params` keeps."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Everything that fixes the model's parameter shapes. Two runs can share weights iff these match."""

    vocab_size: int
    context: int
    layers: int
    d_model: int
    heads: int

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "layers", "d_model", "heads"):
            if getattr(self, name) < 1:
                raise UserError(f"ModelShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.heads:
            raise UserError(f"ModelShape.d_model ({self.d_model}) must be a multiple of heads ({self.heads})")

    @property
    def num_params(self) -> int:
        """``vocab*d + context*d + layers*(12*d^2 + 13*d) + 2*d``: the head shares the token embedding."""
        d = self.d_model
        return self.vocab_size * d + self.context * d + self.layers * (12 * d * d + 13 * d) + 2 * d

    @classmethod
    def for_params(cls, target: int, *, layers: int, vocab_size: int = 8192, context: int = 128) -> ModelShape:
        """The shape whose width comes closest to ``target`` parameters: ``d_model`` 16, 32, 48, then
        multiples of 64 (heads of 64), so ``25M`` and ``1M`` give shapes alike."""
        if target < 1 or layers < 1:
            raise UserError(f"need a positive parameter target and layer count, got {target} and {layers}")
        best = None
        for d in [16, 32, 48, *range(HEAD_DIM, 16385, HEAD_DIM)]:
            shape = cls(vocab_size=vocab_size, context=context, layers=layers, d_model=d, heads=max(1, d // HEAD_DIM))
            if best is None or abs(shape.num_params - target) < abs(best.num_params - target):
                best = shape
            if shape.num_params > target:
                break
        assert best is not None
        return best


class CausalSelfAttention(nn.Module):
    """Multi-head attention where position t attends to positions 0..t only."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Widths come from qkv's output, not from x: under tensor parallel a rank's qkv gives only
        # its ``heads`` heads of q, k and v (see parallelize_gpt).
        q, k, v = self.qkv(x).chunk(3, dim=2)
        # (b, t, heads * head_dim) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


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

    @classmethod
    def seeded(cls, shape: ModelShape, seed: int = 0) -> GPT:
        """The same model on every rank: construction seeded with ``seed``."""
        torch.manual_seed(seed)
        return cls(shape)

    @classmethod
    def for_params(cls, target: int, *, layers: int, vocab_size: int = 8192, context: int = 128,
                   seed: int = 0) -> GPT:
        """The seeded model of :meth:`ModelShape.for_params`: what the benchmarks train."""
        return cls.seeded(ModelShape.for_params(target, layers=layers, vocab_size=vocab_size, context=context), seed)

    def num_parameters(self) -> int:
        """Distinct parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``idx``; with ``targets``, their mean next-token cross-entropy instead."""
        t = idx.shape[1]
        if t > self.shape.context:
            raise UserError(f"sequence of {t} tokens is longer than the model's context of {self.shape.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def generate(self, idx: torch.Tensor, new_tokens: int, *, temperature: float = 0.8,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Extend ``idx`` by ``new_tokens`` sampled tokens (see :func:`generate`)."""
        return generate(self, self.shape.context, idx, new_tokens, temperature=temperature, generator=generator)


@torch.no_grad()
def generate(model: nn.Module, context: int, idx: torch.Tensor, new_tokens: int, *, temperature: float = 0.8,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Extend ``idx`` (1-D or ``(batch, time)``) by ``new_tokens`` tokens that ``model`` (ids in,
    logits out, at most ``context`` tokens at once) samples.

    ``temperature`` 0 means greedy decoding; otherwise tokens are drawn from the
    softmax of ``logits / temperature`` with ``generator``, so a seeded generator
    gives the same text every time.
    """
    squeeze = idx.dim() == 1
    idx = idx.view(1, -1) if squeeze else idx
    for _ in range(new_tokens):
        logits = model(idx[:, -context:])[:, -1, :]
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = F.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx.view(-1) if squeeze else idx


# -- tensor parallel ------------------------------------------------------------------

QKV_CHUNKS = 3
"""qkv's fused projections; :func:`~fireflyer.haiscale.tensor_parallel.restore_fused` takes it."""


def parallelize_gpt(model: GPT, tp: DeviceMesh | ProcessGroup, *, sequence_parallel: bool = False) -> GPT:
    """Shard ``model``'s blocks over the TP mesh or group ``tp`` (``layout.mesh["tp"]``), in place.

    Each block's fused ``qkv`` is column-parallel per head (haiscale's ``FusedColwiseParallel``:
    a rank's shard is its heads' q, k and v), ``proj`` row-parallel, the MLP column- then
    row-parallel, and each attention keeps ``heads / tp`` heads. The embeddings stay
    replicated: the head shares the token embedding's weight, and a vocab-sharded head would
    need a vocab-parallel cross-entropy this small model does not earn. With
    ``sequence_parallel`` the LayerNorms and the residual stream between blocks run on
    sequence shards. The qkv parameters' full tensors are in haiscale's fused row order:
    ``restore_fused(t, QKV_CHUNKS, tp)`` gives the unsharded model's.

    Every TP rank must build the same model (``GPT.seeded``) and feed it the same batch. Raises
    :class:`UserError` when ``tp`` does not divide the heads, ``d_model`` or the MLP width; with
    ``sequence_parallel``, a forward whose sequence length ``tp`` does not divide fails the same way.
    """
    from fireflyer.haiscale.tensor_parallel import (block_plan, check_divides, sequence_parallel_ends,
                                                    tensor_parallel, tp_mesh)

    if not isinstance(model, GPT):
        raise UserError(f"parallelize_gpt takes a fireflyer.train.model.GPT, got {type(model).__name__}")
    mesh = tp_mesh(tp)
    size = mesh.size()
    shape = model.shape
    check_divides("attention heads", shape.heads, size)
    check_divides("model width d_model", shape.d_model, size)
    check_divides("MLP width (4 × d_model)", 4 * shape.d_model, size)
    plan = {}
    for i in range(shape.layers):
        plan.update(block_plan(f"blocks.{i}", heads=shape.heads, sequence_parallel=sequence_parallel))
    if sequence_parallel:
        plan.update(sequence_parallel_ends(first_block="blocks.0", final_norm="ln_f", head="head"))
        model.register_forward_pre_hook(_sequence_divides(size))
    tensor_parallel(model, mesh, plan)
    for block in model.blocks:
        block.attn.heads = shape.heads // size  # this rank's heads
    return model


def _sequence_divides(tp: int):
    def check(module: GPT, args: tuple) -> None:
        idx = args[0]
        if isinstance(idx, torch.Tensor) and idx.dim() >= 2 and idx.shape[1] % tp:
            raise UserError(f"sequence parallel over tp={tp} ranks needs a sequence length that tp divides, got "
                            f"{idx.shape[1]} tokens: pad or cut the batch, or turn sequence_parallel off")
    return check


def lm_loss(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A micro-batch's mean next-token cross-entropy under ``model`` (a GPT or a whole pipeline stage of one, or a
    DDP wrapping it): the ``loss_fn`` of ``DistributedDataParallel.accumulate``."""
    x, y = batch
    return model(x, y)


def synthetic_batch(shape: ModelShape, *, rank: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens for ``rank`` at ``step`` (inputs, next-token targets), seeded by (rank, step),
    so any layout can rebuild any rank's batch: what the benchmarks and tests feed the model."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    tokens = torch.randint(0, shape.vocab_size, (size, shape.context + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def split_linears(model: nn.Module, *, blocks: int, tp_group: ProcessGroup | None = None,
                  order: str = "canonical") -> nn.Module:
    """Put every block's linear layers of ``model`` (a :class:`GPT`, or a pipeline stage holding its ``blocks``) in
    fixed blocks of their weights, or over a tensor-parallel group, in place
    (:mod:`fireflyer.haiscale.canonical_linear`).

    In the canonical order each linear computes in ``blocks`` fixed blocks of its weight, summed in the canonical
    tree: without ``tp_group`` whole on this rank (a :class:`CanonicalLinear`); on a TP group (an hfreduce group in
    the canonical order) ``qkv`` and the MLP's first linear column-parallel (a rank's share of ``qkv`` is its heads'
    q, k and v), ``proj`` and the MLP's second row-parallel, each attention keeping ``heads / tp`` heads. Every TP
    degree dividing ``blocks`` computes the same products and sums, so it gives the bits of one process. With
    ``order="fast"`` the same split is plain Megatron (``blocks`` ignored: one product per rank). Parameter names
    and full shapes stay the plain model's, so a saved state moves between them.
    """
    import torch.distributed as dist

    from fireflyer.haiscale.canonical_linear import (CanonicalLinear, ColumnParallelCanonicalLinear,
                                                     RowParallelCanonicalLinear)

    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    blocks = tp if order == "fast" else blocks
    for block in model.blocks:
        attn, mlp = block.attn, getattr(block, "mlp", None)  # a MoE block has no MLP: its experts stay whole
        if tp_group is None:
            attn.qkv = CanonicalLinear.from_linear(attn.qkv, blocks, chunks=QKV_CHUNKS)
            attn.proj = CanonicalLinear.from_linear(attn.proj, blocks)
            if mlp is not None:
                mlp[0] = CanonicalLinear.from_linear(mlp[0], blocks)
                mlp[2] = CanonicalLinear.from_linear(mlp[2], blocks)
            continue
        if attn.heads % tp:
            raise UserError(f"tp ({tp}) does not divide the attention's {attn.heads} heads")
        column = dict(group=tp_group, blocks=blocks, order=order)
        attn.qkv = ColumnParallelCanonicalLinear.from_full(attn.qkv, chunks=QKV_CHUNKS, **column)
        attn.proj = RowParallelCanonicalLinear.from_full(attn.proj, **column)
        if mlp is not None:
            mlp[0] = ColumnParallelCanonicalLinear.from_full(mlp[0], **column)
            mlp[2] = RowParallelCanonicalLinear.from_full(mlp[2], **column)
        attn.heads //= tp
    return model
