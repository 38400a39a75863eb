"""The models the paper trains (Figs. 8 and 9) as plain numbers: FLOPs per sample, parameters,
and the shapes the communication depends on. Sizes are the models' published ones (VGG16:
Simonyan and Zisserman; GPT-2 medium: Radford et al.; LLaMA-13B: Touvron et al.;
DeepSeekMoE 16B: Dai et al., arXiv 2401.06066); the training setups are the paper's (§V) and
its artifact's (per-GPU batches, sequence lengths, PP degrees).

A model can also be read from a TOML file (``fireflyer simulate train --model FILE``) with the
fields of :class:`ModelSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from fireflyer.errors import UserError


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model as the step-time model sees it."""

    name: str
    params: float
    """All parameters (what DP reduces and FSDP shards)."""
    active_params: float = 0.0
    """Parameters one token passes through (MoE); 0: all of them."""
    layers: int = 0
    """Transformer layers (0: not a transformer; give ``flops_per_sample``)."""
    hidden: int = 0
    seq: int = 0
    """Tokens per sample."""
    flops_per_sample: float = 0.0
    """Training FLOPs per sample (forward + backward); 0: 6 x active params + attention, per token."""
    precision: str = "bf16"
    """"tf32" (an FP32 model) or "bf16"."""
    experts: int = 0
    """Routed experts per MoE layer (0: dense)."""
    top_k: int = 0
    moe_layers: int = 0

    def __post_init__(self) -> None:
        if not self.params > 0:
            raise UserError(f"model {self.name!r}: params must be positive")
        if self.precision not in ("tf32", "bf16"):
            raise UserError(f"model {self.name!r}: precision must be 'tf32' or 'bf16', got {self.precision!r}")
        if self.flops_per_sample <= 0 and not (self.layers > 0 and self.hidden > 0 and self.seq > 0):
            raise UserError(f"model {self.name!r}: give flops_per_sample, or layers, hidden and seq")
        for name in ("active_params", "layers", "hidden", "seq", "experts", "top_k", "moe_layers"):
            if getattr(self, name) < 0:
                raise UserError(f"model {self.name!r}: {name} must not be negative")
        if self.experts and not (0 < self.top_k <= self.experts and 0 < self.moe_layers <= self.layers):
            raise UserError(f"model {self.name!r}: an MoE needs 0 < top_k <= experts and 0 < moe_layers <= layers")

    @property
    def training_flops_per_sample(self) -> float:
        """6 FLOPs per active parameter per token, plus attention's 12 x layers x hidden x seq per token."""
        if self.flops_per_sample > 0:
            return self.flops_per_sample
        n = self.active_params or self.params
        per_token = 6.0 * n + 12.0 * self.layers * self.hidden * self.seq
        return per_token * self.seq

    @property
    def moe(self) -> bool:
        return self.experts > 0


VGG16 = ModelSpec(name="vgg16", params=138.36e6, flops_per_sample=3 * 30.94e9, precision="tf32")
GPT2_MEDIUM = ModelSpec(name="gpt2-medium", params=354.8e6, layers=24, hidden=1024, seq=256, precision="tf32")
LLAMA_13B = ModelSpec(name="llama-13b", params=13.0e9, layers=40, hidden=5120, seq=2048)
DEEPSEEKMOE_16B = ModelSpec(name="deepseekmoe-16b", params=16.4e9, active_params=2.8e9, layers=28, hidden=2048,
                            seq=4096, experts=64, top_k=6, moe_layers=27)
MODELS = {m.name: m for m in (VGG16, GPT2_MEDIUM, LLAMA_13B, DEEPSEEKMOE_16B)}
#: The paper's layouts for its two LLMs (Fig. 9), the defaults of ``simulate train`` and ``plan --job``.
TRAIN_PRESETS = {"llama-13b": {"pp": 4, "global_batch": 4096}, "deepseekmoe-16b": {"pp": 10, "global_batch": 4608}}


def model(name_or_file: str) -> ModelSpec:
    """A preset by name, or a TOML file of :class:`ModelSpec`'s fields."""
    if name_or_file in MODELS:
        return MODELS[name_or_file]
    path = Path(name_or_file)
    if not path.suffix == ".toml":
        raise UserError(f"unknown model {name_or_file!r}; choose one of: {', '.join(MODELS)}, or a .toml file")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"cannot read model {str(path)!r}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"model {str(path)!r} is not valid TOML: {exc}") from None
    allowed = {f.name for f in fields(ModelSpec)}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise UserError(f"model {str(path)!r}: unknown field(s) {', '.join(unknown)}; "
                        f"known: {', '.join(sorted(allowed))}")
    data.setdefault("name", path.stem)
    try:
        return ModelSpec(**data)
    except TypeError as exc:
        raise UserError(f"model {str(path)!r}: {exc}") from None
