"""The main job's configuration: one keyword-only dataclass that checks itself.

A run is described by a :class:`TrainConfig`. It can come from a flat TOML file
(``configs/demo.toml`` is the default, ``configs/tiny.toml`` is for tests), and
command-line flags override single fields (``--steps 50`` sets ``steps``). Every field
is checked when the object is made; a bad value raises :class:`UserError` (a
``ValueError``) that names the field and says what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
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
class TrainConfig:
    """Everything one run of ``fireflyer train`` needs. Defaults are the demo's."""

    # --- layout ---
    nodes: int = 2
    """Emulated nodes: one torchrun agent each, with its own FIREFLYER_NODE_ID."""
    ranks_per_node: int = 2
    """Ranks (processes) per node."""
    device: str = "auto"
    """auto (CUDA when present, else CPU), cpu, or cuda (rank r uses cuda:LOCAL_RANK)."""

    # --- model ---
    context: int = 64
    """Tokens the model sees at once (its block size)."""
    layers: int = 2
    """Transformer blocks."""
    d_model: int = 128
    """Width of the residual stream."""
    heads: int = 4
    """Attention heads; must divide d_model."""
    model: str = "dense"
    """dense (a GPT with GELU MLPs) or moe (a DeepSeekMoE: routed plus shared SwiGLU experts in every block)."""
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

    # --- parallelism ---
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

    # --- optimisation ---
    steps: int = 300
    """Optimizer steps in the whole run (the learning-rate schedule spans them)."""
    global_batch: int = 64
    """Sequences in one optimizer step over the whole job, the same on every layout: its micro-batches are shared
    evenly among the data-parallel replicas (each rank, or each pipeline when pp > 1)."""
    micro_batch_size: int = 16
    """Sequences in one micro-batch: one forward and backward (gradient accumulation when a replica holds several),
    or one slot of the 1F1B schedule when pp > 1; must divide global_batch."""
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
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB: each full bucket's allreduce starts during backward."""

    # --- data and evaluation ---
    data: str = ""
    """A UTF-8 text file, or a folder whose .txt files are read in sorted order (relative: to the current folder); empty: the shipped Shakespeare."""
    data_cache: str = ""
    """Folder of the record shards built from the text (one per content hash); empty: $FIREFLYER_DATA_CACHE, else ~/.cache/fireflyer/data."""
    seed: int = 1234
    """Seeds the weights and every batch: the same config gives the same losses."""
    val_fraction: float = 0.1
    """Share of the corpus held out for validation."""
    eval_interval: int = 50
    """Measure validation loss every this many steps (and at the end); 0: only at the end."""
    eval_batches: int = 4
    """Validation batches per evaluation, each as large as the global batch."""
    sample_tokens: int = 200
    """Characters of text the trained model writes for the summary; 0 skips it."""

    # --- run control ---
    out: str = "runs/demo"
    """Directory for the state, run.json, loss.png and logs."""
    save_every: int = 100
    """Save the training state every this many steps (it is always saved at the end); 0: only at the end."""
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

    def __post_init__(self) -> None:
        self._check_types()
        positive = ("nodes", "ranks_per_node", "context", "layers", "d_model", "heads", "steps", "global_batch",
                    "micro_batch_size", "eval_batches", "experts", "expert_hidden", "top_k", "ep", "pp", "tp",
                    "linear_blocks")
        for name in positive:
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name, cap in LIMITS.items():
            if getattr(self, name) > cap:
                raise UserError(f"{name} must be at most {cap:,}, got {getattr(self, name):,}")
        non_negative = ("max_restarts", "shared_experts", "warmup_steps", "eval_interval", "save_every", "sample_tokens", "seed",
                        "weight_decay", "bias_update_speed",
                        "grad_clip", "min_lr")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise UserError(f"{name} must not be negative, got {getattr(self, name)}")
        for name in ("lr", "bucket_cap_mb", "timeout"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.stop_grace <= 3600:
            raise UserError(f"stop_grace must be 0 to 3600 seconds, got {self.stop_grace}")
        if self.d_model % self.heads:
            raise UserError(f"heads ({self.heads}) must divide d_model ({self.d_model})")
        if self.warmup_steps > self.steps:
            raise UserError(f"warmup_steps ({self.warmup_steps}) must not exceed steps ({self.steps})")
        if self.min_lr > self.lr:
            raise UserError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if not 0 < self.val_fraction <= 0.5:
            raise UserError(f"val_fraction must be in (0, 0.5], got {self.val_fraction}")
        if self.device not in DEVICES:
            raise UserError(f"device must be one of {', '.join(DEVICES)}; got {self.device!r}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise UserError(f"stop_at must be between 1 and steps ({self.steps}), got {self.stop_at}")
        if not self.out:
            raise UserError("out must name a directory")
        self._check_parallel()

    def _check_parallel(self) -> None:
        """The model kind and the layout: refused here, before any rank starts, with the reason."""
        if self.model not in MODELS:
            raise UserError(f"model must be one of {', '.join(MODELS)}; got {self.model!r}")
        if self.model == "dense" and self.ep != 1:
            raise UserError(f"ep={self.ep} needs experts: expert parallel is for model = 'moe' (--model moe)")
        if self.model == "moe":
            if self.top_k > self.experts:
                raise UserError(f"top_k ({self.top_k}) must be at most experts ({self.experts})")
            if self.experts % self.ep:
                raise UserError(f"ep ({self.ep}) does not divide experts ({self.experts}): every EP rank holds "
                                f"the same number of routed experts; choose ep from "
                                f"{', '.join(str(d) for d in range(1, self.experts + 1) if self.experts % d == 0)}")
            if self.ranks_per_node % self.ep:
                raise UserError(f"ep ({self.ep}) does not divide ranks_per_node ({self.ranks_per_node}): an "
                                "expert-parallel group stays inside one node, where its all-to-all goes "
                                "through shared memory")
        self._check_tensor_parallel()
        if self.world_size % (self.pp * self.ep * self.tp):
            degrees = f"pp x ep = {self.pp} x {self.ep}" if self.tp == 1 else \
                f"pp x ep x tp = {self.pp} x {self.ep} x {self.tp}"
            raise UserError(f"{degrees} does not divide the world size {self.world_size} "
                            f"({plural(self.nodes, 'node')} x {plural(self.ranks_per_node, 'rank')}); data parallel takes the rest")
        self._check_batch()
        self._check_order()
        self._check_fault_tolerant()
        self._check_sharded()
        if self.pp > 1:
            if self.pp > self.layers:
                raise UserError(f"pp ({self.pp}) is more than layers ({self.layers}): every stage needs a block")
            if self.micro_batches < self.pp:
                raise UserError(f"a pipeline of {self.pp} stages needs at least {self.pp} micro-batches per step for "
                                f"the 1F1B schedule, but each of its {plural(self.replicas, 'pipeline')} gets "
                                f"{self.micro_batches} ({self._batch_words()}); raise global_batch or lower "
                                "micro_batch_size")

    def _check_tensor_parallel(self) -> None:
        """Tensor parallel: a group inside one node that splits whole heads and whole blocks of every linear."""
        if self.linear_blocks & (self.linear_blocks - 1):
            raise UserError(f"linear_blocks must be a power of two (1, 2, 4, ...), got {self.linear_blocks}: aligned "
                            "blocks are subtrees of the canonical tree")
        if self.linear_blocks > 1 and self.d_model % self.linear_blocks:
            raise UserError(f"linear_blocks ({self.linear_blocks}) must divide d_model ({self.d_model}): every block "
                            "of a linear layer has one shape")
        if self.tp == 1:
            return
        if self.model == "moe" and self.ranks_per_node % (self.ep * self.tp):
            raise UserError(f"ep x tp ({self.ep} x {self.tp}) does not divide ranks_per_node ({self.ranks_per_node}): "
                            "an expert-parallel group of TP groups stays inside one node")
        if self.ranks_per_node % self.tp:
            raise UserError(f"tp ({self.tp}) does not divide ranks_per_node ({self.ranks_per_node}): a TP group stays "
                            "inside one node, since it exchanges activations in every layer")
        if self.heads % self.tp:
            raise UserError(f"tp ({self.tp}) does not divide heads ({self.heads}): each TP rank holds whole "
                            "attention heads")
        if self.order == "canonical" and self.linear_blocks % self.tp:
            raise UserError(f"order = 'canonical' with tp = {self.tp} needs linear_blocks a multiple of {self.tp} "
                            f"(got {self.linear_blocks}): each TP rank computes whole blocks of every linear layer, "
                            f"and the runs it is compared with must use the same linear_blocks")

    def _check_sharded(self) -> None:
        """FSDP: the dense model, each rank one shard of it."""
        if not self.fsdp:
            return
        if self.model != "dense" or self.pp > 1 or self.tp > 1:
            raise UserError("fsdp shards the dense model over data parallel only so far (not with moe, pp > 1 or "
                            "tp > 1)")
        if self.fault_tolerant:
            raise UserError("fault_tolerant with fsdp is not supported: a replica group must hold whole weights to "
                            "heal another")
        if self.order == "canonical" and self.replicas & (self.replicas - 1):
            raise UserError(f"order = 'canonical' with fsdp needs a power-of-two count of ranks, got "
                            f"{self.replicas}: a step's micro-batches are dealt to the shards in turn, each turn an "
                            "aligned subtree of the canonical tree")

    def _check_fault_tolerant(self) -> None:
        """What --fault-tolerant needs: a replica of all the state on every node."""
        if not self.fault_tolerant:
            return
        if self.nodes < 2:
            raise UserError("fault_tolerant needs at least 2 nodes: each node is a replica of the model, and with "
                            "a single replica there is nothing to train on while it is lost (use --nodes 2 or more)")
        if self.pp > 1:
            raise UserError(f"fault_tolerant cannot run a pipeline across nodes (pp = {self.pp}): each stage's "
                            "weights live on one node only, so a lost node has no replica to heal from")
        if self.tp > 1:
            raise UserError(f"fault_tolerant with tp = {self.tp} is not supported yet: a replica's ranks hold whole "
                            "models there")
        if self.model == "moe" and self.order == "canonical":
            raise UserError("fault_tolerant runs the MoE model in the fast order only: its replicas' expert gradients "
                            "are not split into the canonical tree's blocks yet (use --order fast)")
        # model = "moe": its experts stay inside a node (ep divides ranks_per_node), so every node holds them all

    def _check_order(self) -> None:
        """Gradient accumulation and the canonical order: what the layout must be for the run's bits to hold."""
        if self.order not in ORDERS:
            raise UserError(f"order must be one of {', '.join(ORDERS)}; got {self.order!r}")
        if self.order != "canonical":
            return
        dp = self.world_size // (self.pp * self.ep * self.tp)
        if self.model == "moe" and dp > 1 and self.ep & (self.ep - 1):
            raise UserError(f"order = 'canonical' with ep = {self.ep} on {dp} data-parallel copies of each expert "
                            "needs a power-of-two ep: an EP group's micro-batches must be a subtree of the tree "
                            "over the global batch")
        if self.replicas > 1 and self.micro_batches & (self.micro_batches - 1):
            raise UserError(f"order = 'canonical' on {plural(self.replicas, 'data-parallel replica')} needs a "
                            f"power-of-two count of micro-batches per replica (1, 2, 4, ...), but each gets "
                            f"{self.micro_batches} ({self._batch_words()}): each replica's micro-batches must be a "
                            "subtree of the tree over the global batch")
        if self.nodes > 1 and self.ranks_per_node & (self.ranks_per_node - 1):
            raise UserError(f"order = 'canonical' across {self.nodes} nodes needs a power-of-two ranks_per_node "
                            f"(1, 2, 4, ...), got {self.ranks_per_node}: each node's ranks must be a subtree of "
                            "the tree over all ranks")

    def _check_batch(self) -> None:
        """The global batch: whole micro-batches, shared evenly among the data-parallel replicas."""
        if self.global_batch % self.micro_batch_size:
            raise UserError(f"micro_batch_size ({self.micro_batch_size}) must divide global_batch "
                            f"({self.global_batch}): a step is a whole number of micro-batches")
        if self.global_micro_batches % self.replicas:
            fits = [n * self.micro_batch_size for n in range(self.replicas, 4 * self.replicas + 1, self.replicas)]
            raise UserError(f"the global batch's {self._batch_words()} cannot be shared evenly among "
                            f"{plural(self.replicas, 'data-parallel replica')} ({self._replica_words()}); choose a "
                            f"global_batch that is a multiple of {self.replicas} x {self.micro_batch_size} "
                            f"({', '.join(map(str, fits[:3]))}, ...) or another micro_batch_size")
        if self.micro_batches > MAX_MICRO_BATCHES:
            raise UserError(f"each replica would run {self.micro_batches:,} micro-batches a step ({self._batch_words()}); "
                            f"at most {MAX_MICRO_BATCHES:,}: raise micro_batch_size")

    def _batch_words(self) -> str:
        return (f"{self.global_batch} sequences = {plural(self.global_micro_batches, 'micro-batch', 'micro-batches')}"
                f" of {self.micro_batch_size}")

    def _replica_words(self) -> str:
        ranks = f"{plural(self.nodes, 'node')} x {plural(self.ranks_per_node, 'rank')}"
        split = [f"{name} {getattr(self, name)}" for name in ("pp", "tp") if getattr(self, name) > 1]
        return f"{ranks} / {' x '.join(split)}" if split else ranks

    @property
    def global_micro_batches(self) -> int:
        """Micro-batches in one step over all replicas: the canonical order's tree spans them."""
        return self.global_batch // self.micro_batch_size

    @property
    def micro_batches(self) -> int:
        """Micro-batches per data-parallel replica per step (derived: global micro-batches / replicas)."""
        return self.global_micro_batches // self.replicas

    @property
    def batch_per_replica(self) -> int:
        """Sequences per data-parallel replica per step (derived: its micro-batches x micro_batch_size)."""
        return self.micro_batches * self.micro_batch_size

    def describe_batch(self) -> str:
        """The batch in words, as the run prints it: the global batch and how the layout divides it."""
        each = "pipeline" if self.pp > 1 else "TP group" if self.tp > 1 else "rank"
        return (f"global batch {self._batch_words()}; {plural(self.micro_batches, 'micro-batch', 'micro-batches')} "
                f"per {each} x {plural(self.replicas, each)}")

    def _check_types(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = _field_kind(f)
            if value is None and f.name in OPTIONAL:
                continue
            ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
                ok = True
            if kind is float and ok and not math.isfinite(value):
                ok = False
            if not ok:
                raise UserError(f"{f.name} must be {_KIND_NAMES[kind]}, got {value!r}")

    @property
    def world_size(self) -> int:
        """Ranks in the job: nodes × ranks_per_node."""
        return self.nodes * self.ranks_per_node

    @property
    def replicas(self) -> int:
        """Data-parallel replicas, each reading its own micro-batches: world / (pp x tp) (a pipeline's later stages
        and a TP group's ranks share their replica's)."""
        return self.world_size // (self.pp * self.tp)

    @property
    def tokens_per_step(self) -> int:
        """Tokens consumed by one optimizer step across all ranks."""
        return self.global_batch * self.context

    @property
    def out_dir(self) -> Path:
        return Path(self.out)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed (checked again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> TrainConfig:
        """Make a config from plain data; an unknown key is an error that lists the valid ones."""
        refuse_legacy(data, source)
        unknown = sorted(set(data) - set(FIELD_NAMES))
        if unknown:
            raise UserError(f"{source}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                            f"valid keys: {', '.join(FIELD_NAMES)}")
        return cls(**dict(data))

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """Read a flat TOML file of fields; ``overrides`` (e.g. from flags) win over the file."""
        return cls.from_dict({**read_toml(path), **overrides}, source=str(path))

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
FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TrainConfig))
_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}

# Fields that fix the shape of the saved weights and the data each rank reads:
# a saved state can only be resumed by a config that agrees on all of them.
SHAPE_FIELDS = ("context", "layers", "d_model", "heads", "model", "experts", "shared_experts", "expert_hidden",
                "top_k")
LAYOUT_FIELDS = ("ep", "pp")
"""Fields that fix which rank holds which weights and reads which batches: a resume keeps them too, but for a
canonical run with the same global batch (its state is saved under global names, its bits do not depend on them)."""


def _same_global_batch(saved: Mapping[str, Any], cfg: TrainConfig, defaults: Mapping[str, Any]) -> bool:
    """A canonical run resumed on another layout: the same micro-batches in every step (their number and size),
    so the run goes on as it would have on the old one."""
    if cfg.order != "canonical" or saved.get("order", defaults["order"]) != "canonical":
        return False
    return all(saved.get(k, defaults[k]) == getattr(cfg, k) for k in ("global_batch", "micro_batch_size"))


LEGACY_BATCH = ("batch_per_rank", "micro_batches", "microbatches")
"""Fields of earlier versions, replaced by global_batch and micro_batch_size."""


def upgrade_saved(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A config saved by an earlier version (``batch_per_rank``, ``micro_batches``, ``microbatches``) in today's
    fields: the same global batch and micro-batches, so its run can be resumed."""
    out = dict(saved)
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
    new = upgrade_saved({**{"nodes": TrainConfig.nodes, "ranks_per_node": TrainConfig.ranks_per_node}, **data})
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
    """A flat TOML file as a dict. Missing files and syntax errors become one-line UserErrors."""
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
    tables = [k for k, v in data.items() if isinstance(v, dict)]
    if tables:
        raise UserError(f"{path}: the config is a flat list of keys; remove the table(s) {', '.join(tables)}")
    return data


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
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    moving = _same_global_batch(saved, cfg, defaults)  # a canonical run: its state and bits are the layout's own
    clashes = [f"{name} {saved.get(name, defaults[name])} -> {getattr(cfg, name)}"
               for name in SHAPE_FIELDS + (() if moving else LAYOUT_FIELDS)
               if saved.get(name, defaults[name]) != getattr(cfg, name)]
    saved_world = int(saved.get("nodes", 0)) * int(saved.get("ranks_per_node", 0))
    if saved_world != cfg.world_size and not moving:
        clashes.append(f"world size {saved_world} -> {cfg.world_size}")
        if cfg.order == "canonical":
            clashes.append(f"a canonical run changes its layout only with the same global batch and micro-batch "
                           f"size: {saved.get('global_batch')} of {saved.get('micro_batch_size')} -> "
                           f"{cfg.global_batch} of {cfg.micro_batch_size}")
    if clashes:
        raise UserError(f"cannot resume {state}: it was saved with a different model or world ({'; '.join(clashes)}); "
                        "use the config it was saved with, or a new --out to start afresh")
    ignored = {"stop_at", "out", "timeout", "stop_grace", "data_cache", "fault_tolerant", "max_restarts"}
    if moving or saved_world != cfg.world_size or saved.get("tp", 1) != cfg.tp or saved.get("fsdp", False) != cfg.fsdp:
        ignored |= {"nodes", "ranks_per_node", "tp", "fsdp", "ep", "pp"}  # another layout: the state is layout-free
    return [name for name in FIELD_NAMES
            if name not in ignored and name in saved and saved[name] != getattr(cfg, name)]
