"""Linear layers whose bits do not depend on the tensor-parallel degree: the canonical order for TP.

A plain Megatron split changes a linear's arithmetic with the TP degree: a row-parallel layer
adds ``tp`` partial matmuls, each a contraction over ``K / tp``, so TP=1, 2 and 4 round
differently. Here the weight is cut into a fixed grid of ``blocks x blocks`` blocks (rows: the
output features ``N``, columns: the input features ``K``), whatever the layout:

* forward ``y_n = tree over k of x_k @ W_nk^T``, then the bias, added once to the whole sum;
* backward ``dx_k = tree over n of dy_n @ W_nk``, ``dW_nk = dy_n^T @ x_k`` (the tokens
  flattened), ``db_n = dy_n`` summed over the tokens by one ``sum`` of a ``(tokens, N/blocks)`` block.

Every product has the same shapes in every layout (and its operands fresh contiguous copies,
so its kernel sees the same memory too), and every sum over blocks is the canonical tree of
:mod:`fireflyer.hfreduce.plans.canonical`, partials kept in fp32 for half types. A TP rank owns
``blocks / tp`` consecutive blocks: an aligned subtree. It sums them locally, and an hfreduce
group made with ``HFReduceConfig(order="canonical")`` adds the ranks' partials in the tree over
ranks, which is the tree over all blocks. So :class:`CanonicalLinear` in one process and
:class:`ColumnParallelCanonicalLinear` / :class:`RowParallelCanonicalLinear` on any TP degree
that divides ``blocks`` give the same bits, forward and backward, at one thread count.

The column-parallel layer owns ``N`` blocks (no collective forward; ``dx`` is allreduced
backward); the row-parallel one owns ``K`` blocks (its output is allreduced forward, its input
already split). The parameters keep ``nn.Linear``'s names, ``weight (out, in)`` and ``bias (out)``.

A fused projection (attention's ``qkv``: ``chunks=3`` equal parts ``[q; k; v]`` along the output
features) takes ``chunks``: output block ``b`` is then the ``b``-th slice of every chunk (the rows
of :func:`~fireflyer.haiscale.tensor_parallel.fused_rows_order`), one ``(tokens, N/blocks)``
product still, so a column-parallel rank holding blocks ``r·B/tp ..`` holds its share of each
chunk and returns ``[q_r; k_r; v_r]`` (``.chunk(3, -1)`` gives its heads' q, k and v). Weights
and gradients are held in that order on the rank; :meth:`CanonicalLinear.forward` and every full
(layout-free) state are in the model's own ``[q; k; v]`` order, as ``nn.Linear``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from fireflyer.errors import UserError, UserTypeError
from fireflyer.haiscale.accumulate import check_order
from fireflyer.hfreduce import engine_of
from fireflyer.hfreduce.plans.canonical import accumulation_dtype, split_point

__all__ = ["CanonicalLinear", "ColumnParallelCanonicalLinear", "RowParallelCanonicalLinear", "TensorParallelLinear",
           "canonicalize", "check_blocks"]


def check_blocks(blocks: Any, in_features: int, out_features: int, tp: int = 1, chunks: Any = 1) -> None:
    """Raise :class:`UserError` unless ``blocks`` cuts both feature counts (each of the ``chunks`` fused parts of
    the output) evenly and ``tp`` ranks hold whole blocks."""
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1 or blocks & (blocks - 1):
        raise UserError(f"blocks must be a power of two (1, 2, 4, ...) so that aligned blocks are subtrees of the "
                        f"canonical tree, got {blocks!r}")
    for name, count in (("in_features", in_features), ("out_features", out_features)):
        if count % blocks:
            raise UserError(f"{name}={count} is not divisible by blocks={blocks}; choose blocks that divide both "
                            "feature counts, so every block has one shape")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise UserError(f"chunks must be a positive int (the fused parts of the output, 3 for attention's qkv), "
                        f"got {chunks!r}")
    if out_features % (chunks * blocks):
        raise UserError(f"out_features={out_features} is not divisible by chunks*blocks={chunks}*{blocks}; each of "
                        f"the {chunks} fused chunks is cut into blocks={blocks} equal slices, so choose blocks that "
                        f"divide out_features/chunks")
    if blocks % tp:
        raise UserError(f"tensor parallel degree tp={tp} does not divide blocks={blocks}; each TP rank must hold "
                        f"whole blocks, so choose blocks a multiple of {tp}")


@dataclass(frozen=True)
class _Plan:
    """Which blocks a layer holds and where its sums cross ranks."""

    blocks: int  # the global grid's blocks per dimension
    n_blocks: int  # output-feature blocks held here
    k_blocks: int  # input-feature blocks held here
    chunks: int = 1  # fused parts of the output: block n is the n-th slice of each, held chunk after chunk
    forward_group: dist.ProcessGroup | None = None  # row parallel: the output's partials are summed over it
    backward_group: dist.ProcessGroup | None = None  # column parallel: dx's partials are summed over it


def _fresh(t: torch.Tensor, copy: bool) -> torch.Tensor:
    """``t`` in fresh contiguous memory (``copy``), so a product's operands look alike in every layout."""
    return t.clone(memory_format=torch.contiguous_format) if copy else t.contiguous()


def _cut(t: torch.Tensor, count: int, dim: int, copy: bool, chunks: int = 1) -> list[torch.Tensor]:
    """``t`` cut into ``count`` blocks along ``dim``; with ``chunks``, block ``n`` is the ``n``-th slice of each of
    ``t``'s ``chunks`` equal parts along ``dim``, joined chunk after chunk."""
    if chunks == 1:
        return [_fresh(b, copy) for b in t.chunk(count, dim)]
    parts = t.unflatten(dim, (chunks, count, -1))
    return [_fresh(parts.select(dim + 1, n).flatten(dim, dim + 1), copy) for n in range(count)]


def _chunk_major(t: torch.Tensor, count: int, chunks: int) -> torch.Tensor:
    """Undo :func:`_cut` of ``count`` blocks on the last dim of ``t`` (its blocks side by side): ``t`` in the order
    chunk after chunk."""
    if chunks == 1 or count == 1:
        return t
    return t.unflatten(-1, (count, chunks, -1)).transpose(-3, -2).flatten(-3)


def _tree(terms: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The canonical sum of ``terms`` (fresh tensors, added into in place), into ``out`` when given.

    The left-balanced tree of :func:`~fireflyer.hfreduce.plans.canonical.canonical_sum`, without its
    copies: the terms here are products nobody else holds.
    """
    if len(terms) == 1:
        return terms[0] if out is None else out.copy_(terms[0])
    m = split_point(len(terms))
    left, right = _tree(terms[:m]), _tree(terms[m:])
    return left.add_(right) if out is None else torch.add(left, right, out=out)


def _sums(count: int, terms: Callable[[int], list[torch.Tensor]], shape: tuple[int, int],
          dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The canonical sums of ``terms(i)`` for ``i < count`` (each of ``shape``), side by side along dim 1."""
    if count == 1:
        return _tree(terms(0))
    rows, width = shape
    out = torch.empty(rows, count * width, dtype=dtype, device=device)
    for i in range(count):
        _tree(terms(i), out[:, i * width:(i + 1) * width])
    return out


class _BlockedMatmul(torch.autograd.Function):
    """``x @ weight^T + bias`` on 2-D ``x``, block by block as the module docstring says, with an explicit backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                plan: _Plan) -> torch.Tensor:
        copy, acc = plan.blocks > 1, accumulation_dtype(x.dtype)
        xs = _cut(x, plan.k_blocks, 1, copy)
        ws = [_cut(row, plan.k_blocks, 1, copy) for row in _cut(weight, plan.n_blocks, 0, False, plan.chunks)]
        y = _sums(plan.n_blocks, lambda n: [torch.mm(xk, wk.t()).to(acc) for xk, wk in zip(xs, ws[n])],
                  (x.shape[0], ws[0][0].shape[0]), acc, x.device)
        y = _chunk_major(y, plan.n_blocks, plan.chunks)
        if plan.forward_group is not None:
            dist.all_reduce(y, group=plan.forward_group)
        if bias is not None:
            y.add_(bias)
        ctx.plan, ctx.has_bias = plan, bias is not None
        ctx.save_for_backward(*xs, *(w for row in ws for w in row))
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan: _Plan = ctx.plan
        saved = ctx.saved_tensors
        xs, flat = saved[:plan.k_blocks], saved[plan.k_blocks:]
        ws = [flat[n * plan.k_blocks:(n + 1) * plan.k_blocks] for n in range(plan.n_blocks)]
        dys = _cut(dy, plan.n_blocks, 1, plan.blocks > 1, plan.chunks)
        n_width, k_width = ws[0][0].shape
        acc = accumulation_dtype(dy.dtype)
        dx = dw = db = work = None
        if ctx.needs_input_grad[0]:
            dx = _sums(plan.k_blocks, lambda k: [torch.mm(dyn, ws[n][k]).to(acc) for n, dyn in enumerate(dys)],
                       (dy.shape[0], k_width), acc, dy.device)
            if plan.backward_group is not None:  # overlaps the weight's gradient below
                work = dist.all_reduce(dx, group=plan.backward_group, async_op=True)
        if ctx.needs_input_grad[1]:
            if plan.blocks == 1:
                dw = torch.mm(dys[0].t(), xs[0])
            else:  # each block's product in fresh memory, as in every layout, then copied into place
                dw = dy.new_empty(plan.n_blocks * n_width, plan.k_blocks * k_width)
                places = dw.view(plan.chunks, plan.n_blocks, n_width // plan.chunks, dw.shape[1])
                for n, dyn in enumerate(dys):
                    for k, xk in enumerate(xs):
                        places[:, n, :, k * k_width:(k + 1) * k_width] = torch.mm(dyn.t(), xk).view(
                            plan.chunks, -1, k_width)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = _chunk_major(torch.cat([dyn.sum(0) for dyn in dys]), plan.n_blocks, plan.chunks)
        if work is not None:
            work.wait()
        return (None if dx is None else dx.to(dy.dtype)), dw, db, None


class _BlockedLinear(nn.Module):
    """What every canonical linear shares: ``weight`` and ``bias`` (this rank's share of them), the plan, the forward.

    ``_split`` is the dimension of the full weight cut over the TP group: None (one process), 0
    (output features, column parallel) or 1 (input features, row parallel). The bias is cut with
    the output features and replicated otherwise. With ``chunks``, the rows held here (all of
    them, or a column-parallel rank's share) are its share of each chunk, chunk after chunk.
    """

    _split: int | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, blocks: int, group: dist.ProcessGroup | None,
                 device: Any, dtype: torch.dtype | None, chunks: int = 1) -> None:
        super().__init__()
        tp = 1 if group is None else dist.get_world_size(group)
        check_blocks(blocks, in_features, out_features, tp, chunks)
        self.in_features, self.out_features, self.blocks = in_features, out_features, blocks
        self.chunks = chunks
        """How many equal fused parts the output features are (3 for attention's ``qkv``; 1: not fused)."""
        self.tp = tp
        """The TP degree: how many ranks share the blocks (1 in one process)."""
        shape = [out_features, in_features]
        if self._split is not None:
            shape[self._split] //= tp
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(shape[0], device=device, dtype=dtype)) if bias else None
        across = group if tp > 1 else None
        self._plan = _Plan(blocks, n_blocks=blocks // tp if self._split == 0 else blocks,
                           k_blocks=blocks // tp if self._split == 1 else blocks, chunks=chunks,
                           forward_group=across if self._split == 1 else None,
                           backward_group=across if self._split == 0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.weight.shape[1]
        if x.shape[-1:] != (width,):
            raise UserError(f"{type(self).__name__} takes inputs of {width} features in the last dimension, "
                            f"got shape {tuple(x.shape)}")
        y = _BlockedMatmul.apply(x.reshape(-1, width), self.weight, self.bias, self._plan)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        chunks = f", chunks={self.chunks}" if self.chunks > 1 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"blocks={self.blocks}{chunks}, tp={self.tp}")


class CanonicalLinear(_BlockedLinear):
    """``nn.Linear`` in the canonical block order, in one process: the reference every TP degree matches.

    Initialised as ``nn.Linear`` is (the same random draws), with the same parameter names and
    shapes, so state dicts move between the two. ``chunks`` (a fused projection's parts, 3 for
    ``qkv``) changes only which rows share a block; weights and output stay in ``nn.Linear``'s order.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, blocks: int, chunks: int = 1,
                 device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, blocks, None, device, dtype, chunks)
        nn.Linear.reset_parameters(self)  # type: ignore[arg-type]  # nn.Linear's own init, on the same names

    @classmethod
    def from_linear(cls, linear: nn.Linear, blocks: int, *, chunks: int = 1) -> CanonicalLinear:
        """A CanonicalLinear with ``linear``'s weights, device and dtype."""
        if not isinstance(linear, nn.Linear):
            raise UserTypeError(f"from_linear takes an nn.Linear, got {type(linear).__name__}")
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, blocks=blocks, chunks=chunks,
                    device="meta", dtype=w.dtype).to_empty(device=w.device)  # no init: no random draws
        layer.load_state_dict(linear.state_dict())
        return layer


_TP = TypeVar("_TP", bound="TensorParallelLinear")


class TensorParallelLinear(_BlockedLinear):
    """A canonical linear sharded over a TP group of hfreduce in the canonical order (any group when tp is 1).

    Initialised by drawing the full ``nn.Linear`` and keeping this rank's shard, so ranks seeded
    alike hold the weights one process would. :meth:`full_state_dict` and
    :meth:`load_full_state_dict` move the layout-free ``nn.Linear`` state in and out.

    ``order="fast"`` is plain Megatron instead: each rank's share is one product over the whole
    unsplit dimension, summed over any TP group (``blocks`` is then the TP degree); its bits
    depend on the degree, as every such split's do.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, blocks: int,
                 group: dist.ProcessGroup, device: Any = None, dtype: torch.dtype | None = None,
                 chunks: int = 1, order: str = "canonical") -> None:
        if order not in ("fast", "canonical"):
            raise UserError(f"order must be 'fast' or 'canonical', got {order!r}")
        if not isinstance(group, dist.ProcessGroup):
            raise UserTypeError(f"{type(self).__name__} needs the TP process group, got {type(group).__name__}")
        if chunks != 1 and self._split != 0:
            raise UserError(f"{type(self).__name__} does not split its output features, so it takes no chunks (got "
                            f"chunks={chunks!r}); fuse projections in a ColumnParallelCanonicalLinear")
        super().__init__(in_features, out_features, bias, blocks, group, device, dtype, chunks)
        self.order = order
        if order == "fast":  # one product per rank: its share of the split dimension against the whole other one
            self._plan = replace(self._plan, blocks=1, n_blocks=1, k_blocks=1)
        elif self.tp > 1:
            try:
                check_order("canonical", [SimpleNamespace(pg=group, engine=engine_of(group),
                                                          world=self.tp)], None)
            except UserError as e:
                raise UserError(f"{type(self).__name__} sums over its TP group in the canonical order: {e}") from None
        self.group, self.tp_rank = group, dist.get_rank(group)
        self.load_full_state_dict(nn.Linear(in_features, out_features, bias, device=device, dtype=dtype).state_dict())

    @classmethod
    def from_full(cls: type[_TP], source: nn.Linear | CanonicalLinear, group: dist.ProcessGroup, blocks: int, *,
                  chunks: int = 1, order: str = "canonical") -> _TP:
        """This rank's shard of ``source`` (its device and dtype), over the TP ``group``; ``chunks`` and ``order`` as
        the constructor's (not taken from a CanonicalLinear ``source``: its state is in the model's order either
        way)."""
        if not isinstance(source, (nn.Linear, CanonicalLinear)):
            raise UserTypeError(f"from_full takes an nn.Linear or a CanonicalLinear, got {type(source).__name__}")
        w = source.weight
        layer = cls(source.in_features, source.out_features, source.bias is not None, blocks=blocks, group=group,
                    device="meta", dtype=w.dtype, chunks=chunks, order=order).to_empty(device=w.device)  # no draws
        layer.load_full_state_dict(source.state_dict())
        return layer

    def _dim(self, name: str) -> int | None:
        """The dimension of the full ``name`` (``weight`` or ``bias``) cut over the group; None where replicated."""
        if name == "weight":
            return self._split
        return 0 if self._split == 0 else None

    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take this rank's shard of a full (layout-free) ``weight`` and ``bias``, as :meth:`full_state_dict` gives."""
        names = ["weight"] + (["bias"] if self.bias is not None else [])
        if sorted(state) != sorted(names):
            raise UserError(f"a full state of {type(self).__name__} holds {names}, got {sorted(state)}")
        full_shapes = {"weight": (self.out_features, self.in_features), "bias": (self.out_features,)}
        with torch.no_grad():
            for name in names:
                full = state[name]
                if tuple(full.shape) != full_shapes[name]:
                    raise UserError(f"the full {name} must have shape {full_shapes[name]}, got {tuple(full.shape)}")
                getattr(self, name).copy_(self.shard(name, full))

    def _shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's share of ``full`` along ``dim``: of each of the ``chunks`` parts when ``dim`` is the output's."""
        if dim != 0 or self.chunks == 1:
            return full.chunk(self.tp, dim)[self.tp_rank]
        return full.unflatten(0, (self.chunks, self.tp, -1))[:, self.tp_rank].flatten(0, 1)

    def splits(self, name: str) -> bool:
        """Whether parameter ``name`` is cut over the TP group (a row-parallel bias is not: every rank holds it)."""
        return self.tp > 1 and self._dim(name) is not None

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's share of a full tensor shaped like parameter ``name`` (its value, or an optimizer state of
        it), in the model's order: the whole of it where ``name`` is replicated."""
        dim = self._dim(name)
        return full if dim is None else self._shard(full, dim)

    def gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of which ``local`` is this rank's share of parameter ``name`` (its value, its gradient or
        an optimizer state of it), in the model's order: a collective over the TP group where ``name`` is split."""
        dim = self._dim(name)
        if self.tp == 1 or dim is None:
            return local.detach().clone()
        parts = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(parts, local.detach().contiguous(), group=self.group)
        if dim != 0 or self.chunks == 1:
            return torch.cat(parts, dim)
        return torch.stack([p.unflatten(0, (self.chunks, -1)) for p in parts], 1).flatten(0, 2)  # [q; k; v] again

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full ``weight`` and ``bias`` gathered over the TP group (a collective): what ``nn.Linear`` holds."""
        return {n: self.gather(n, p) for n, p in self.named_parameters(recurse=False)}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """The gradients of :meth:`full_state_dict`'s tensors, gathered the same way (a collective)."""
        missing = [n for n, p in self.named_parameters(recurse=False) if p.grad is None]
        if missing:
            raise UserError(f"{', '.join(missing)} of {type(self).__name__} have no gradient yet: run backward first")
        return {n: self.gather(n, p.grad) for n, p in self.named_parameters(recurse=False)}  # type: ignore[arg-type]


class ColumnParallelCanonicalLinear(TensorParallelLinear):
    """The output features' blocks split over the TP group: rank ``r`` holds ``blocks / tp`` consecutive ones.

    Takes the full input and gives this rank's output features, without a collective; backward
    sums ``dx`` over its blocks, then over the group in the canonical order. With ``chunks``
    (fused ``[q; k; v]``: 3), rank ``r`` holds and returns ``[q_r; k_r; v_r]``, its ``1/tp`` of
    each chunk, so ``.chunk(3, -1)`` of its output is its heads' q, k and v; its full states
    (:meth:`full_state_dict`, :meth:`full_grads`, :meth:`load_full_state_dict`) stay in ``[q; k; v]``.
    """

    _split = 0


class RowParallelCanonicalLinear(TensorParallelLinear):
    """The input features' blocks split over the TP group: rank ``r`` holds ``blocks / tp`` consecutive ones.

    Takes this rank's input features (a column-parallel layer's output), sums its blocks, then
    over the group in the canonical order, then adds the replicated bias once: every rank gets
    the full output.
    """

    _split = 1


def canonicalize(module: nn.Module, blocks: int, names: Iterable[str] | None = None, *,
                 chunks: int | Mapping[str, int] = 1) -> nn.Module:
    """Replace ``module``'s ``nn.Linear`` layers (those at ``names``, or every one) by :class:`CanonicalLinear`
    with the same weights, in place; returns ``module`` (or its replacement, when it is itself an ``nn.Linear``).

    ``chunks``: every converted layer's (an int), or the fused ones' by name (``{"attn.qkv": 3}``; the
    others 1)."""
    if names is None:
        if isinstance(module, nn.Linear):
            if isinstance(chunks, Mapping):
                raise UserError("a lone nn.Linear has no layer names: pass its chunks as an int")
            return CanonicalLinear.from_linear(module, blocks, chunks=chunks)
        targets = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)]
    else:
        targets = list(names)
        if "" in targets:
            raise UserError("name the module's linear layers, not the module itself; pass names=None to convert it")
        paths = dict(module.named_modules())
        missing = [n for n in targets if n not in paths]
        if missing:
            raise UserError(f"the module has no submodules named {', '.join(missing)}")
        wrong = [f"{n} ({type(paths[n]).__name__})" for n in targets if not isinstance(paths[n], nn.Linear)]
        if wrong:
            raise UserTypeError(f"only nn.Linear layers can be made canonical, not {', '.join(wrong)}")
    if isinstance(chunks, Mapping):
        stray = [n for n in chunks if n not in targets]
        if stray:
            raise UserError(f"chunks names {', '.join(map(str, stray))}, which are not among the linears converted")
    for name in targets:
        parent, _, leaf = name.rpartition(".")
        count = chunks.get(name, 1) if isinstance(chunks, Mapping) else chunks
        try:
            layer = CanonicalLinear.from_linear(module.get_submodule(name), blocks,  # type: ignore[arg-type]
                                                chunks=count)
        except UserError as e:
            raise UserError(f"{name}: {e}") from None
        setattr(module.get_submodule(parent), leaf, layer)
    return module
