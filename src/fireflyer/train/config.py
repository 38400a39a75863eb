"""The main job's configuration: a :class:`TrainConfig` of six sections that checks itself.

The sections are nested dataclasses, as a TOML file's tables are (``configs/demo.toml`` is the
default, ``configs/tiny.toml`` is for tests)::

    [model]        # the network: kind, context, layers, d_model, heads, the experts
    [parallelism]  # the layout: nodes, ranks_per_node, ep, pp, tp, fsdp, the order of the sums
    [data]         # what is read and in what batches: path, cache, global_batch, micro_batch_size, evaluation
    [optimizer]    # AdamW and its schedule: lr, warmup_steps, min_lr, weight_decay, grad_clip
    [checkpoint]   # save_every
    [run]          # steps, seed, device, out, stop_at, timeouts, fault tolerance

Command-line flags override single fields by their *flag names*, which are the fields' own
names but for three: ``--model`` sets ``model.kind``, ``--data`` sets ``data.path`` and
``--data-cache`` sets ``data.cache`` (see :data:`FIELDS`). Every field is checked when the
config is made; a bad value raises :class:`UserError` (a ``ValueError``) that names the field
by its flag name and says what is allowed. A flat file of flag names (the format before the
sections) still loads, with a one-line note.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from fireflyer.cliutil import plural
from fireflyer.errors import UserError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]

DEVICES = ("auto", "cpu", "cuda")
MODELS = ("dense", "moe")
ORDERS = ("fast", "canonical")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """``[model]``: the network's kind and shape."""

    kind: str = "dense"
    """dense (a GPT with GELU MLPs) or moe (a DeepSeekMoE: routed plus shared SwiGLU experts in every block)."""
    context: int = 64
    """Tokens the model sees at once (its block size)."""
    layers: int = 2
    """Transformer blocks."""
    d_model: int = 128
    """Width of the residual stream."""
    heads: int = 4
    """Attention heads; must divide d_model."""
    experts: int = 8
    """moe: routed experts per block, over all EP ranks."""
    shared_experts: int = 1
    """moe: shared experts every token goes through."""
    expert_hidden: int = 128
    """moe: hidden width of one expert."""
    top_k: int = 2
    """moe: routed experts per token."""
    bias_update_speed: float = 0.001
    """moe: step of the auxiliary-loss-free balancing bias per optimizer step (DeepSeek-V3's gamma); 0: off."""


@dataclass(frozen=True, kw_only=True)
class ParallelismConfig:
    """``[parallelism]``: where the ranks run, how they split the model and the batch, and the order of the sums."""

    nodes: int = 2
    """Emulated nodes: one torchrun agent each, with its own FIREFLYER_NODE_ID."""
    ranks_per_node: int = 2
    """Ranks (processes) per node."""
    ep: int = 1
    """moe: expert-parallel degree (ranks of one node that split each block's routed experts)."""
    pp: int = 1
    """Pipeline stages (one per node, a node's ranks in different pipelines); data parallel takes the rest."""
    tp: int = 1
    """Tensor-parallel degree: ranks of one node that split every block's attention heads and dense MLP (Megatron's
    column- then row-parallel linears; a MoE layer's experts stay whole on each) and read the same micro-batches."""
    fsdp: bool = False
    """Shard the weights, gradients and optimizer state over the data-parallel ranks (FSDP2's ZeRO-3 over hfreduce)
    instead of holding a whole replica on each."""
    linear_blocks: int = 1
    """order = canonical: each block's linear layers compute in this many fixed blocks of their weights, summed in
    the canonical tree, so every tp that divides it gives the same bits (a power of two; 1: plain linears)."""
    order: str = "fast"
    """fast, or canonical: every sum of a step in one fixed pairwise tree over the global micro-batches, so the run's bits do not depend on the layout (one thread per rank)."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB: each full bucket's allreduce starts during backward."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """``[data]``: the text, the records built from it, the batches read from them, and evaluation."""

    path: str = ""
    """A UTF-8 text file, or a folder whose .txt files are read in sorted order (relative: to the current folder); empty: the shipped Shakespeare."""
    cache: str = ""
    """Folder of the record shards built from the text (one per content hash); empty: $FIREFLYER_DATA_CACHE, else ~/.cache/fireflyer/data."""
    global_batch: int = 64
    """Sequences in one optimizer step over the whole job, the same on every layout: its micro-batches are shared
    evenly among the data-parallel replicas (each rank, or each pipeline when pp > 1)."""
    micro_batch_size: int = 16
    """Sequences in one micro-batch: one forward and backward (gradient accumulation when a replica holds several),
    or one slot of the 1F1B schedule when pp > 1; must divide global_batch."""
    val_fraction: float = 0.1
    """Share of the corpus held out for validation."""
    eval_interval: int = 50
    """Measure validation loss every this many steps (and at the end); 0: only at the end."""
    eval_batches: int = 4
    """Validation batches per evaluation, each as large as the global batch."""


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """``[optimizer]``: AdamW, its learning-rate schedule and gradient clipping."""

    lr: float = 6e-3
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 20
    """Steps of linear warm-up from 0 to lr."""
    min_lr: float = 6e-4
    """Learning rate at the end of the cosine decay."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (not on biases or LayerNorm gains)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """``[checkpoint]``: how often the training state is saved (under ``OUT/ckpt/``)."""

    save_every: int = 100
    """Save the training state every this many steps (it is always saved at the end); 0: only at the end."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """``[run]``: how long, where, on what, with which seed, and what ends the run."""

    steps: int = 300
    """Optimizer steps in the whole run (the learning-rate schedule spans them)."""
    seed: int = 1234
    """Seeds the weights and every batch: the same config gives the same losses."""
    device: str = "auto"
    """auto (CUDA when present, else CPU), cpu, or cuda (rank r uses cuda:LOCAL_RANK)."""
    out: str = "runs/demo"
    """Directory for the state, run.json, loss.png and logs."""
    sample_tokens: int = 200
    """Characters of text the trained model writes for the summary; 0 skips it."""
    stop_at: int | None = None
    """End this run after this step, as a preemption would; the schedule still spans `steps`, and --resume continues."""
    timeout: float = 600.0
    """Seconds before the whole job is stopped; collectives time out well before it."""
    stop_grace: float = 10.0
    """Seconds the ranks get to finish a checkpoint save in flight when the run is stopped (Ctrl-C, SIGTERM,
    --timeout) before they are killed."""
    fault_tolerant: bool = False
    """Keep training through the loss of a node (torchft: each node a replica group, a quorum every step, a
    restarted node healed from a live one); with order = canonical the steps keep their bits."""
    max_restarts: int = 3
    """fault_tolerant: how many times each node's agent restarts the node's ranks after they die."""


SECTIONS: dict[str, type] = {"model": ModelConfig, "parallelism": ParallelismConfig, "data": DataConfig,
                             "optimizer": OptimizerConfig, "checkpoint": CheckpointConfig, "run": RunConfig}
"""The sections, in the order of the TOML tables and of ``--help``."""
RENAMED = {("model", "kind"): "model", ("data", "path"): "data", ("data", "cache"): "data_cache"}
"""Fields whose flag name is not their own: the section's name would repeat in it (``--model moe``)."""
FIELDS: dict[str, tuple[str, str]] = {
    RENAMED.get((section, f.name), f.name): (section, f.name)
    for section, kind in SECTIONS.items() for f in dataclasses.fields(kind)}
"""Every field by its flag name (``--ranks-per-node`` is ``ranks_per_node``): its section and its name there."""
FIELD_NAMES: tuple[str, ...] = tuple(FIELDS)
FLAG_OF = {place: name for name, place in FIELDS.items()}
"""The flag name of each (section, field)."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything one run of ``fireflyer train`` needs, in sections. Defaults are the demo's."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        for name, kind in SECTIONS.items():
            if not isinstance(getattr(self, name), kind):
                raise UserError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        self._check_types()
        v = self.fields()
        positive = ("nodes", "ranks_per_node", "context", "layers", "d_model", "heads", "steps", "global_batch",
                    "micro_batch_size", "eval_batches", "experts", "expert_hidden", "top_k", "ep", "pp", "tp",
                    "linear_blocks")
        for name in positive:
            if v[name] < 1:
                raise UserError(f"{name} must be at least 1, got {v[name]}")
        for name, cap in LIMITS.items():
            if v[name] > cap:
                raise UserError(f"{name} must be at most {cap:,}, got {v[name]:,}")
        non_negative = ("max_restarts", "shared_experts", "warmup_steps", "eval_interval", "save_every",
                        "sample_tokens", "seed", "weight_decay", "bias_update_speed", "grad_clip", "min_lr")
        for name in non_negative:
            if v[name] < 0:
                raise UserError(f"{name} must not be negative, got {v[name]}")
        for name in ("lr", "bucket_cap_mb", "timeout"):
            if not v[name] > 0:
                raise UserError(f"{name} must be positive, got {v[name]}")
        if not 0 <= self.run.stop_grace <= 3600:
            raise UserError(f"stop_grace must be 0 to 3600 seconds, got {self.run.stop_grace}")
        if self.model.d_model % self.model.heads:
            raise UserError(f"heads ({self.model.heads}) must divide d_model ({self.model.d_model})")
        if self.optimizer.warmup_steps > self.run.steps:
            raise UserError(f"warmup_steps ({self.optimizer.warmup_steps}) must not exceed steps ({self.run.steps})")
        if self.optimizer.min_lr > self.optimizer.lr:
            raise UserError(f"min_lr ({self.optimizer.min_lr}) must not exceed lr ({self.optimizer.lr})")
        if not 0 < self.data.val_fraction <= 0.5:
            raise UserError(f"val_fraction must be in (0, 0.5], got {self.data.val_fraction}")
        if self.run.device not in DEVICES:
            raise UserError(f"device must be one of {', '.join(DEVICES)}; got {self.run.device!r}")
        if self.run.stop_at is not None and not 1 <= self.run.stop_at <= self.run.steps:
            raise UserError(f"stop_at must be between 1 and steps ({self.run.steps}), got {self.run.stop_at}")
        if not self.run.out:
            raise UserError("out must name a directory")
        self._check_parallel()

    def _check_parallel(self) -> None:
        """The model kind and the layout: refused here, before any rank starts, with the reason."""
        m, par = self.model, self.parallelism
        if m.kind not in MODELS:
            raise UserError(f"model must be one of {', '.join(MODELS)}; got {m.kind!r}")
        if m.kind == "dense" and par.ep != 1:
            raise UserError(f"ep={par.ep} needs experts: expert parallel is for model = 'moe' (--model moe)")
        if m.kind == "moe":
            if m.top_k > m.experts:
                raise UserError(f"top_k ({m.top_k}) must be at most experts ({m.experts})")
            if m.experts % par.ep:
                raise UserError(f"ep ({par.ep}) does not divide experts ({m.experts}): every EP rank holds "
                                f"the same number of routed experts; choose ep from "
                                f"{', '.join(str(d) for d in range(1, m.experts + 1) if m.experts % d == 0)}")
            if par.ranks_per_node % par.ep:
                raise UserError(f"ep ({par.ep}) does not divide ranks_per_node ({par.ranks_per_node}): an "
                                "expert-parallel group stays inside one node, where its all-to-all goes "
                                "through shared memory")
        self._check_tensor_parallel()
        if self.world_size % (par.pp * par.ep * par.tp):
            degrees = f"pp x ep = {par.pp} x {par.ep}" if par.tp == 1 else \
                f"pp x ep x tp = {par.pp} x {par.ep} x {par.tp}"
            raise UserError(f"{degrees} does not divide the world size {self.world_size} "
                            f"({plural(par.nodes, 'node')} x {plural(par.ranks_per_node, 'rank')}); data parallel takes the rest")
        self._check_batch()
        self._check_order()
        self._check_fault_tolerant()
        self._check_sharded()
        if par.pp > 1:
            if par.pp > m.layers:
                raise UserError(f"pp ({par.pp}) is more than layers ({m.layers}): every stage needs a block")
            if self.micro_batches < par.pp:
                raise UserError(f"a pipeline of {par.pp} stages needs at least {par.pp} micro-batches per step for "
                                f"the 1F1B schedule, but each of its {plural(self.replicas, 'pipeline')} gets "
                                f"{self.micro_batches} ({self._batch_words()}); raise global_batch or lower "
                                "micro_batch_size")

    def _check_tensor_parallel(self) -> None:
        """Tensor parallel: a group inside one node that splits whole heads and whole blocks of every linear."""
        m, par = self.model, self.parallelism
        if par.linear_blocks & (par.linear_blocks - 1):
            raise UserError(f"linear_blocks must be a power of two (1, 2, 4, ...), got {par.linear_blocks}: aligned "
                            "blocks are subtrees of the canonical tree")
        if par.linear_blocks > 1 and m.d_model % par.linear_blocks:
            raise UserError(f"linear_blocks ({par.linear_blocks}) must divide d_model ({m.d_model}): every block "
                            "of a linear layer has one shape")
        if par.tp == 1:
            return
        if m.kind == "moe" and par.ranks_per_node % (par.ep * par.tp):
            raise UserError(f"ep x tp ({par.ep} x {par.tp}) does not divide ranks_per_node ({par.ranks_per_node}): "
                            "an expert-parallel group of TP groups stays inside one node")
        if par.ranks_per_node % par.tp:
            raise UserError(f"tp ({par.tp}) does not divide ranks_per_node ({par.ranks_per_node}): a TP group stays "
                            "inside one node, since it exchanges activations in every layer")
        if m.heads % par.tp:
            raise UserError(f"tp ({par.tp}) does not divide heads ({m.heads}): each TP rank holds whole "
                            "attention heads")
        if par.order == "canonical" and par.linear_blocks % par.tp:
            raise UserError(f"order = 'canonical' with tp = {par.tp} needs linear_blocks a multiple of {par.tp} "
                            f"(got {par.linear_blocks}): each TP rank computes whole blocks of every linear layer, "
                            f"and the runs it is compared with must use the same linear_blocks")

    def _check_sharded(self) -> None:
        """FSDP: the dense model, each rank one shard of it."""
        m, par, r = self.model, self.parallelism, self.run
        if not par.fsdp:
            return
        if m.kind != "dense" or par.pp > 1 or par.tp > 1:
            raise UserError("fsdp shards the dense model over data parallel only so far (not with moe, pp > 1 or "
                            "tp > 1)")
        if r.fault_tolerant:
            raise UserError("fault_tolerant with fsdp is not supported: a replica group must hold whole weights to "
                            "heal another")
        if par.order == "canonical" and self.replicas & (self.replicas - 1):
            raise UserError(f"order = 'canonical' with fsdp needs a power-of-two count of ranks, got "
                            f"{self.replicas}: a step's micro-batches are dealt to the shards in turn, each turn an "
                            "aligned subtree of the canonical tree")

    def _check_fault_tolerant(self) -> None:
        """What --fault-tolerant needs: a replica of all the state on every node."""
        m, par, r = self.model, self.parallelism, self.run
        if not r.fault_tolerant:
            return
        if par.nodes < 2:
            raise UserError("fault_tolerant needs at least 2 nodes: each node is a replica of the model, and with "
                            "a single replica there is nothing to train on while it is lost (use --nodes 2 or more)")
        if par.pp > 1:
            raise UserError(f"fault_tolerant cannot run a pipeline across nodes (pp = {par.pp}): each stage's "
                            "weights live on one node only, so a lost node has no replica to heal from")
        if par.tp > 1:
            raise UserError(f"fault_tolerant with tp = {par.tp} is not supported yet: a replica's ranks hold whole "
                            "models there")
        if m.kind == "moe" and par.order == "canonical":
            raise UserError("fault_tolerant runs the MoE model in the fast order only: its replicas' expert gradients "
                            "are not split into the canonical tree's blocks yet (use --order fast)")
        # model = "moe": its experts stay inside a node (ep divides ranks_per_node), so every node holds them all

    def _check_order(self) -> None:
        """Gradient accumulation and the canonical order: what the layout must be for the run's bits to hold."""
        m, par = self.model, self.parallelism
        if par.order not in ORDERS:
            raise UserError(f"order must be one of {', '.join(ORDERS)}; got {par.order!r}")
        if par.order != "canonical":
            return
        dp = self.world_size // (par.pp * par.ep * par.tp)
        if m.kind == "moe" and dp > 1 and par.ep & (par.ep - 1):
            raise UserError(f"order = 'canonical' with ep = {par.ep} on {dp} data-parallel copies of each expert "
                            "needs a power-of-two ep: an EP group's micro-batches must be a subtree of the tree "
                            "over the global batch")
        if self.replicas > 1 and self.micro_batches & (self.micro_batches - 1):
            raise UserError(f"order = 'canonical' on {plural(self.replicas, 'data-parallel replica')} needs a "
                            f"power-of-two count of micro-batches per replica (1, 2, 4, ...), but each gets "
                            f"{self.micro_batches} ({self._batch_words()}): each replica's micro-batches must be a "
                            "subtree of the tree over the global batch")
        if par.nodes > 1 and par.ranks_per_node & (par.ranks_per_node - 1):
            raise UserError(f"order = 'canonical' across {par.nodes} nodes needs a power-of-two ranks_per_node "
                            f"(1, 2, 4, ...), got {par.ranks_per_node}: each node's ranks must be a subtree of "
                            "the tree over all ranks")

    def _check_batch(self) -> None:
        """The global batch: whole micro-batches, shared evenly among the data-parallel replicas."""
        d = self.data
        if d.global_batch % d.micro_batch_size:
            raise UserError(f"micro_batch_size ({d.micro_batch_size}) must divide global_batch "
                            f"({d.global_batch}): a step is a whole number of micro-batches")
        if self.global_micro_batches % self.replicas:
            fits = [n * d.micro_batch_size for n in range(self.replicas, 4 * self.replicas + 1, self.replicas)]
            raise UserError(f"the global batch's {self._batch_words()} cannot be shared evenly among "
                            f"{plural(self.replicas, 'data-parallel replica')} ({self._replica_words()}); choose a "
                            f"global_batch that is a multiple of {self.replicas} x {d.micro_batch_size} "
                            f"({', '.join(map(str, fits[:3]))}, ...) or another micro_batch_size")
        if self.micro_batches > MAX_MICRO_BATCHES:
            raise UserError(f"each replica would run {self.micro_batches:,} micro-batches a step ({self._batch_words()}); "
                            f"at most {MAX_MICRO_BATCHES:,}: raise micro_batch_size")

    def _batch_words(self) -> str:
        return (f"{self.data.global_batch} sequences = {plural(self.global_micro_batches, 'micro-batch', 'micro-batches')}"
                f" of {self.data.micro_batch_size}")

    def _replica_words(self) -> str:
        ranks = f"{plural(self.parallelism.nodes, 'node')} x {plural(self.parallelism.ranks_per_node, 'rank')}"
        split = [f"{name} {getattr(self.parallelism, name)}" for name in ("pp", "tp") if getattr(self.parallelism, name) > 1]
        return f"{ranks} / {' x '.join(split)}" if split else ranks

    @property
    def global_micro_batches(self) -> int:
        """Micro-batches in one step over all replicas: the canonical order's tree spans them."""
        return self.data.global_batch // self.data.micro_batch_size

    @property
    def micro_batches(self) -> int:
        """Micro-batches per data-parallel replica per step (derived: global micro-batches / replicas)."""
        return self.global_micro_batches // self.replicas

    @property
    def batch_per_replica(self) -> int:
        """Sequences per data-parallel replica per step (derived: its micro-batches x micro_batch_size)."""
        return self.micro_batches * self.data.micro_batch_size

    def describe_batch(self) -> str:
        """The batch in words, as the run prints it: the global batch and how the layout divides it."""
        each = "pipeline" if self.parallelism.pp > 1 else "TP group" if self.parallelism.tp > 1 else "rank"
        return (f"global batch {self._batch_words()}; {plural(self.micro_batches, 'micro-batch', 'micro-batches')} "
                f"per {each} x {plural(self.replicas, each)}")

    def _check_types(self) -> None:
        for name, (section, attr) in FIELDS.items():
            part = getattr(self, section)
            value = getattr(part, attr)
            kind = _field_kind(next(f for f in dataclasses.fields(part) if f.name == attr))
            if value is None and name in OPTIONAL:
                continue
            ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(part, attr, float(value))
                ok = True
            if kind is float and ok and not math.isfinite(value):
                ok = False
            if not ok:
                raise UserError(f"{name} must be {_KIND_NAMES[kind]}, got {value!r}")

    @property
    def world_size(self) -> int:
        """Ranks in the job: nodes × ranks_per_node."""
        return self.parallelism.nodes * self.parallelism.ranks_per_node

    @property
    def replicas(self) -> int:
        """Data-parallel replicas, each reading its own micro-batches: world / (pp x tp) (a pipeline's later stages
        and a TP group's ranks share their replica's)."""
        return self.world_size // (self.parallelism.pp * self.parallelism.tp)

    @property
    def tokens_per_step(self) -> int:
        """Tokens consumed by one optimizer step across all ranks."""
        return self.data.global_batch * self.model.context

    @property
    def out_dir(self) -> Path:
        return Path(self.run.out)

    def fields(self) -> dict[str, Any]:
        """Every field by its flag name (:data:`FIELDS`), in one flat mapping."""
        return {name: getattr(getattr(self, section), attr) for name, (section, attr) in FIELDS.items()}

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed, by their flag names (checked again)."""
        return TrainConfig.from_fields(**{**self.fields(), **changes})

    def to_dict(self) -> dict[str, Any]:
        """The config as nested plain data, a table per section (what ``config.json`` and a saved state hold)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_fields(cls, *, source: str = "config", **values: Any) -> TrainConfig:
        """A config from fields by their flag names (``nodes=1, model="moe"``); the rest keep their defaults.
        An unknown name is an error that lists the valid ones."""
        unknown = sorted(set(values) - set(FIELDS))
        if unknown:
            raise UserError(f"{source}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                            f"valid keys: {', '.join(FIELD_NAMES)}")
        grouped: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for name, value in values.items():
            section, attr = FIELDS[name]
            grouped[section][attr] = value
        return cls(**{name: SECTIONS[name](**parts) for name, parts in grouped.items()})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> TrainConfig:
        """Make a config from plain data: tables of sections (as :meth:`to_dict` writes), or flat flag names (a
        file or a saved state of the format before the sections). An unknown key is an error that lists the valid
        ones."""
        return cls.from_fields(source=source, **flatten(data, source=source))

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """Read a TOML file of sections; ``overrides`` (flag names, e.g. from flags) win over the file."""
        return cls.from_fields(source=str(path), **{**read_toml(path), **overrides})

    @classmethod
    def from_json(cls, path: str | Path) -> TrainConfig:
        """Read the resolved config the launcher hands to every rank."""
        return cls.from_dict(json.loads(Path(path).read_text()), source=str(path))


OPTIONAL = frozenset({"stop_at"})
MAX_MICRO_BATCHES = 65536
"""Micro-batches one replica may run in a step: beyond it the micro-batch size is a typo."""
LIMITS = {"nodes": 64, "ranks_per_node": 64, "experts": 4096, "shared_experts": 64, "expert_hidden": 65536,
          "top_k": 64, "ep": 64, "pp": 64, "tp": 64, "linear_blocks": 64, "context": 65536, "layers": 1024, "d_model": 65536, "heads": 1024,
          "steps": 10**9, "global_batch": 1 << 24, "micro_batch_size": 1 << 20, "eval_batches": 100_000, "sample_tokens": 1_000_000,
          "save_every": 10**9, "eval_interval": 10**9, "warmup_steps": 10**9, "max_restarts": 1000}
"""Upper bounds: beyond them a value is a typo, not a plan, and is refused before any rank starts."""
_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}

# Fields that fix the shape of the saved weights and the data each rank reads:
# a saved state can only be resumed by a config that agrees on all of them.
SHAPE_FIELDS = ("context", "layers", "d_model", "heads", "model", "experts", "shared_experts", "expert_hidden",
                "top_k")
LAYOUT_FIELDS = ("ep", "pp")
"""Fields that fix which rank holds which weights and reads which batches: a resume keeps them too, but for a
canonical run with the same global batch (its state is saved under global names, its bits do not depend on them)."""


def flatten(data: Mapping[str, Any], *, source: str = "config") -> dict[str, Any]:
    """``data``'s fields by their flag names: each section's table unpacked, a flat key (the format before the
    sections) kept as it is. A key that is neither, or a table that is no section, is an error naming the valid
    ones."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, Mapping):
            valid = [f.name for f in dataclasses.fields(SECTIONS[key])]
            for attr, inner in value.items():
                if attr not in valid:
                    raise UserError(f"{source}: unknown key {attr!r} in [{key}]; valid keys there: {', '.join(valid)}")
                flat[FLAG_OF[(key, attr)]] = inner
        elif isinstance(value, Mapping):
            raise UserError(f"{source}: unknown table [{key}]; the sections are {', '.join(SECTIONS)}")
        elif key in FIELDS or key in LEGACY_BATCH:
            flat[key] = value
        else:
            raise UserError(f"{source}: unknown key {key!r}; valid keys: {', '.join(FIELD_NAMES)} (in their "
                            f"sections: {', '.join(f'[{s}]' for s in SECTIONS)})")
    refuse_legacy(flat, source)
    return flat


def _same_global_batch(saved: Mapping[str, Any], cfg: TrainConfig, defaults: Mapping[str, Any]) -> bool:
    """A canonical run resumed on another layout: the same micro-batches in every step (their number and size),
    so the run goes on as it would have on the old one."""
    if cfg.parallelism.order != "canonical" or saved.get("order", defaults["order"]) != "canonical":
        return False
    now = cfg.fields()
    return all(saved.get(k, defaults[k]) == now[k] for k in ("global_batch", "micro_batch_size"))


LEGACY_BATCH = ("batch_per_rank", "micro_batches", "microbatches")
"""Fields of earlier versions, replaced by global_batch and micro_batch_size."""


def upgrade_saved(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A saved config's fields by their flag names, of any version: in sections (:meth:`TrainConfig.to_dict`), or
    flat, or flat with the per-rank batch of earlier versions (``batch_per_rank``, ``micro_batches``,
    ``microbatches``) turned into the same global batch and micro-batches, so its run can be resumed."""
    out = {k: v for k, v in saved.items() if not isinstance(v, Mapping)}
    for section, table in saved.items():
        if section in SECTIONS and isinstance(table, Mapping):
            out.update({FLAG_OF[(section, attr)]: v for attr, v in table.items() if (section, attr) in FLAG_OF})
    if not any(k in out for k in LEGACY_BATCH):
        return out
    per_rank = int(out.pop("batch_per_rank", 16))
    accumulate, pipeline = int(out.pop("micro_batches", 1)), int(out.pop("microbatches", 4))
    pp = int(out.get("pp", 1))
    replicas = int(out.get("nodes", 2)) * int(out.get("ranks_per_node", 2)) // max(pp, 1)
    out.setdefault("global_batch", replicas * per_rank)
    out.setdefault("micro_batch_size", per_rank // (pipeline if pp > 1 else accumulate))
    return out


def refuse_legacy(data: Mapping[str, Any], source: str) -> None:
    """A config that still names the per-rank batch: say what replaces it, with its values where they are known."""
    old = [k for k in LEGACY_BATCH if k in data]
    if not old:
        return
    layout = ParallelismConfig()
    new = upgrade_saved({"nodes": layout.nodes, "ranks_per_node": layout.ranks_per_node, **data})
    raise UserError(f"{source}: {', '.join(old)} {'are' if len(old) > 1 else 'is'} replaced by global_batch and "
                    f"micro_batch_size, which stay the same on every layout; here that is global_batch = "
                    f"{new['global_batch']}, micro_batch_size = {new['micro_batch_size']}")


def _field_kind(f: dataclasses.Field) -> type:
    annotation = str(f.type)
    for kind in (int, float, str, bool):
        if annotation.split(" |")[0] == kind.__name__:
            return kind
    raise AssertionError(f"field {f.name} has an unsupported type {annotation}")


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML config's fields by their flag names (:func:`flatten`). Missing files, syntax errors and unknown keys
    become one-line UserErrors; a flat file (the format before the sections) loads with a one-line note."""
    if tomllib is None:
        raise UserError("reading TOML configs needs Python 3.11 or newer, or 'pip install tomli' on 3.10")
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"config file {str(path)!r} not found") from None
    except IsADirectoryError:
        raise UserError(f"config {str(path)!r} is a directory, not a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML: {exc}") from None
    flat = flatten(data, source=str(path))
    loose = [k for k, v in data.items() if not isinstance(v, dict)]
    if loose:
        print(f"note: {path} lists {', '.join(loose[:3])}{', ...' if len(loose) > 3 else ''} outside any section, "
              f"as configs did before the sections (deprecated): put each key under its table, "
              f"{', '.join(f'[{s}]' for s in SECTIONS)} (docs/train.md)", file=sys.stderr)
    return flat


def builtin_config(name: str) -> Path:
    """Path of a config shipped with the package (``demo``, ``tiny``)."""
    return Path(str(resources.files("fireflyer.train") / "configs" / f"{name}.toml"))


def check_resumable(saved: Mapping[str, Any], cfg: TrainConfig, *, state: str) -> list[str]:
    """Raise UserError if a state saved under ``saved`` cannot continue under ``cfg``.

    The model shape and the world size must match (the world size fixes which batches
    each rank draws), except that a canonical-order run may move to another layout with the
    same global batch and micro-batch size: its steps go on bit for bit. Returns the other fields that changed, so
    the caller can say so.
    """
    saved = upgrade_saved(saved)
    defaults, now = TrainConfig().fields(), cfg.fields()
    moving = _same_global_batch(saved, cfg, defaults)  # a canonical run: its state and bits are the layout's own
    clashes = [f"{name} {saved.get(name, defaults[name])} -> {now[name]}"
               for name in SHAPE_FIELDS + (() if moving else LAYOUT_FIELDS)
               if saved.get(name, defaults[name]) != now[name]]
    saved_world = int(saved.get("nodes", 0)) * int(saved.get("ranks_per_node", 0))
    if saved_world != cfg.world_size and not moving:
        clashes.append(f"world size {saved_world} -> {cfg.world_size}")
        if cfg.parallelism.order == "canonical":
            clashes.append(f"a canonical run changes its layout only with the same global batch and micro-batch "
                           f"size: {saved.get('global_batch')} of {saved.get('micro_batch_size')} -> "
                           f"{cfg.data.global_batch} of {cfg.data.micro_batch_size}")
    if clashes:
        raise UserError(f"cannot resume {state}: it was saved with a different model or world ({'; '.join(clashes)}); "
                        "use the config it was saved with, or a new --out to start afresh")
    ignored = {"stop_at", "out", "timeout", "stop_grace", "data_cache", "fault_tolerant", "max_restarts"}
    if moving or saved_world != cfg.world_size or saved.get("tp", 1) != cfg.parallelism.tp or saved.get("fsdp", False) != cfg.parallelism.fsdp:
        ignored |= {"nodes", "ranks_per_node", "tp", "fsdp", "ep", "pp"}  # another layout: the state is layout-free
    return [name for name in FIELD_NAMES if name not in ignored and name in saved and saved[name] != now[name]]
