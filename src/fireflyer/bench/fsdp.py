"""``fireflyer bench fsdp``: haiscale FSDP on hfreduce against torch FSDP2 over gloo, and FSDP memory against DDP.

For each layout (``NxL``: N emulated nodes of L ranks, started with real torchrun
through :func:`fireflyer.launch.run_local`) every rank trains the same GPT on the same
batches with each variant in turn (:mod:`fireflyer.bench.fsdp_worker`):

* step time (forward, backward, optimizer step; the slowest rank's median) of
  haiscale FSDP, with and without the optimizer in backward, against torch FSDP2 over
  gloo and over hfreduce, all in the same processes;
* per-rank memory: parameter, gradient and optimizer-state bytes (exact, from the
  tensors) and the growth of the resident set during training, against torch DDP.
  ZeRO-3 should hold about 1/N of DDP's parameters, gradients and optimizer state.

The table goes to the terminal, JSON and a PNG to ``--out`` (``fsdp.json``, ``fsdp.png``).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from fireflyer.cliutil import ArgumentParser, doc_summary
from fireflyer.bench.harness import figure, make_console, progress
from fireflyer.bench.skeleton import run_bench, run_ranks
from fireflyer.errors import UserError
from fireflyer.bench.fsdp_worker import VARIANTS
from fireflyer.train.model import ModelShape

BASELINE = "fsdp2-gloo"
MEMORY_BASELINE = "ddp"
_COUNT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)\s*$", re.IGNORECASE)


def parse_count(text: str) -> int:
    """A parameter count: ``"25M"``, ``"1.5m"``, ``"800k"``, ``"1000000"`` (decimal units)."""
    m = _COUNT_RE.match(str(text))
    if not m:
        raise UserError(f"cannot read count {text!r}; write a number with an optional K, M or G (e.g. 25M)")
    return int(float(m.group(1)) * 1000 ** " kmg".index((m.group(2) or " ").lower()))


def parse_layout(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(1)) * int(m.group(2)) < 2:
        raise UserError(f"bad layout {text!r}; write NODESxRANKS with at least 2 ranks, e.g. 1x4 or 2x2")
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True, kw_only=True)
class FSDPBenchConfig:
    layouts: tuple[tuple[int, int], ...] = ((1, 4), (2, 2))
    model: ModelShape = field(default_factory=lambda: ModelShape(vocab_size=8192, context=128, layers=6, d_model=512,
                                                                 heads=8))
    batch: int = 2
    """Sequences per rank per step."""
    steps: int = 4
    warmup: int = 1
    variants: tuple[str, ...] = VARIANTS
    lr: float = 1e-3
    timeout_s: float = 1800.0
    """Per layout; past it every rank is killed."""
    out_dir: str = "benchmarks/results"

    def __post_init__(self) -> None:
        if self.batch < 1 or self.steps < 1 or self.warmup < 0:
            raise UserError(f"need --batch >= 1, --steps >= 1 and --warmup >= 0, got {self.batch}, {self.steps}, {self.warmup}")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise UserError(f"unknown variant(s) {unknown or '(none given)'}; choose from {', '.join(VARIANTS)}")
        if not self.layouts:
            raise UserError("--layouts is empty")
        if not self.timeout_s > 0 or not self.lr > 0:
            raise UserError("--timeout and --lr must be positive")


def build_config(argv: list[str]) -> FSDPBenchConfig:
    p = ArgumentParser(prog="fireflyer bench fsdp", description=doc_summary(__doc__))
    p.add_argument("--layouts", default="1x4,2x2", help="comma list of NODESxRANKS (default 1x4,2x2)")
    p.add_argument("--params", default="25M", help="GPT size to aim for (default 25M; e.g. 1M for a smoke run)")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks, the FSDP units (default 6)")
    p.add_argument("--vocab", type=int, default=8192, help="token ids (default 8192)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step (default 2)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant (default 4)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of: " + ", ".join(VARIANTS))
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per layout before the ranks are killed")
    p.add_argument("--out", default="benchmarks/results", metavar="DIR", help="where fsdp.json and fsdp.png go")
    p.add_argument("--quick", action="store_true", help="a smoke run: --params 1M --layers 2 --seq 64 --steps 2")
    a = p.parse_args(argv)
    if a.quick:
        a.params, a.layers, a.seq, a.steps = "1M", 2, 64, 2
    if a.layers < 1 or a.vocab < 2 or a.seq < 1:
        raise UserError("--layers and --seq must be >= 1 and --vocab >= 2")
    try:
        model = ModelShape.for_params(parse_count(a.params), layers=a.layers, vocab_size=a.vocab, context=a.seq)
    except ValueError as exc:
        raise UserError(f"--params/--layers: {exc}") from exc
    return FSDPBenchConfig(
        layouts=tuple(parse_layout(t) for t in a.layouts.split(",") if t.strip()), model=model,
        batch=a.batch, steps=a.steps, warmup=a.warmup,
        variants=tuple(v.strip() for v in a.variants.split(",") if v.strip()),
        timeout_s=a.timeout, out_dir=a.out)


# -- running and collecting ----------------------------------------------------------


def run_layout(cfg: FSDPBenchConfig, nodes: int, per_node: int) -> list[dict[str, Any]]:
    """Every rank's results for one layout."""
    spec = {"model": asdict(cfg.model), "batch": cfg.batch, "steps": cfg.steps, "warmup": cfg.warmup,
            "variants": list(cfg.variants), "lr": cfg.lr, "timeout_s": min(300.0, cfg.timeout_s)}
    return run_ranks("fireflyer.bench.fsdp_worker", spec, (nodes, per_node), timeout_s=cfg.timeout_s)


def summarise(layout: str, world: int, ranks: list[dict[str, Any]], variants: tuple[str, ...]) -> dict[str, Any]:
    """Per variant: the slowest rank's median step, the largest per-rank memory, the mean final loss."""
    rows = {}
    for v in variants:
        per = [r["variants"][v] for r in ranks]
        growth = [p["rss_growth_bytes"] for p in per if p["rss_growth_bytes"] is not None]
        rows[v] = {
            "step_s": max(statistics.median(p["step_s"]) for p in per),
            "step_s_per_rank": [statistics.median(p["step_s"]) for p in per],
            "params_bytes": max(p["params_bytes"] for p in per),
            "grads_bytes": max(p["grads_bytes"] for p in per),
            "optimizer_bytes": max(p["optimizer_bytes"] for p in per),
            "rss_growth_bytes": max(growth) if growth else None,
            "final_loss": statistics.fmean(p["losses"][-1] for p in per),
            "stats": per[0]["stats"],
        }
        rows[v]["tensor_bytes"] = rows[v]["params_bytes"] + rows[v]["grads_bytes"] + rows[v]["optimizer_bytes"]
    base = rows.get(BASELINE)
    mem = rows.get(MEMORY_BASELINE)
    for row in rows.values():
        row["speedup_vs_fsdp2_gloo"] = base["step_s"] / row["step_s"] if base else None
        if mem:
            row["memory_vs_ddp"] = {c: row[f"{c}_bytes"] / mem[f"{c}_bytes"] if mem[f"{c}_bytes"] else None
                                    for c in ("params", "grads", "optimizer", "tensor")}
    return {"layout": layout, "world": world, "ideal_fraction": 1 / world, "rows": rows}


# -- report ------------------------------------------------------------------------


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.1f}"


def print_layout(console: Any, res: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"{res['layout']}: world {res['world']} (ideal ZeRO-3 fraction of DDP: 1/{res['world']} = "
                    f"{res['ideal_fraction']:.2f})", title_justify="left", show_edge=False, pad_edge=False)
    for col in ("variant", "step ms", "speed vs\nfsdp2-gloo", "params\nMB/rank", "grads\nMB/rank",
                "optim\nMB/rank", "tensors\nvs DDP", "peak RSS\n+MB", "final\nloss"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for name, row in res["rows"].items():
        ratio = row.get("memory_vs_ddp", {}).get("tensor")
        speed = row["speedup_vs_fsdp2_gloo"]
        t.add_row(name, f"{row['step_s'] * 1e3:.0f}", "-" if speed is None else f"{speed:.2f}x",
                  _mb(row["params_bytes"]), _mb(row["grads_bytes"]), _mb(row["optimizer_bytes"]),
                  "-" if ratio is None else f"{ratio:.2f}", _mb(row["rss_growth_bytes"]), f"{row['final_loss']:.4f}")
    console.print(t)
    console.print("  step = slowest rank's median of forward+backward+optimizer step; MB = 1e6 B; tensors = "
                  "params+grads+optimizer state held after a step (optbwd frees gradients inside backward); "
                  "peak RSS = growth of the resident set during training, gathered units and activations included")
    console.print()


def write_png(path: str, cfg: FSDPBenchConfig, results: list[dict[str, Any]]) -> None:
    """Left: step time per variant and layout. Right: per-rank tensor bytes by category, with DDP/N marked."""
    with figure(path, 1, 2, figsize=(12, 4.5)) as (fig, (ax_t, ax_m)):
        width = 0.8 / max(1, len(results))
        xs = range(len(cfg.variants))
        for i, res in enumerate(results):
            ax_t.bar([x + i * width for x in xs], [res["rows"][v]["step_s"] * 1e3 for v in cfg.variants], width,
                     label=res["layout"])
        ax_t.set_xticks([x + width * (len(results) - 1) / 2 for x in xs], cfg.variants, rotation=20, fontsize=8)
        ax_t.set_ylabel("step time (ms), slowest rank")
        ax_t.set_title("step time")
        ax_t.legend(fontsize=8)
        res = results[0]
        bottom = [0.0] * len(cfg.variants)
        for cat, color in (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green")):
            vals = [res["rows"][v][f"{cat}_bytes"] / 1e6 for v in cfg.variants]
            ax_m.bar(list(xs), vals, 0.6, bottom=bottom, label=cat, color=color)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        if MEMORY_BASELINE in res["rows"]:
            ax_m.axhline(res["rows"][MEMORY_BASELINE]["tensor_bytes"] / 1e6 / res["world"], color="gray", ls="--",
                         lw=1, label=f"DDP / {res['world']}")
        ax_m.set_xticks(list(xs), cfg.variants, rotation=20, fontsize=8)
        ax_m.set_ylabel("MB per rank")
        ax_m.set_title(f"tensors held per rank, {res['layout']}")
        ax_m.legend(fontsize=8)
        fig.suptitle(f"FSDP: GPT {cfg.model.num_params / 1e6:.1f}M params, {cfg.model.layers} blocks")


def measure(cfg: FSDPBenchConfig) -> list[dict[str, Any]]:
    """Every layout's summary, each layout's table printed as it is done."""
    console, say = make_console(), progress()
    make_console(stderr=True).print(
        f"[dim]GPT {cfg.model.num_params / 1e6:.2f}M params (dim {cfg.model.d_model}, {cfg.model.layers} blocks, "
        f"vocab {cfg.model.vocab_size}, seq {cfg.model.context}), {cfg.batch} sequences per rank[/dim]")
    results = []
    for nodes, per_node in cfg.layouts:
        layout = f"{nodes}x{per_node}"
        say(f"{layout}: {', '.join(cfg.variants)} ...")
        res = summarise(layout, nodes * per_node, run_layout(cfg, nodes, per_node), cfg.variants)
        print_layout(console, res)
        results.append(res)
    return results


def main(argv: list[str]) -> int:
    return run_bench(
        argv, part="fsdp", configure=build_config, measure=measure,
        fields=lambda cfg, results: {
            "config": {"model": asdict(cfg.model), "num_params": cfg.model.num_params, "batch": cfg.batch,
                       "steps": cfg.steps, "warmup": cfg.warmup, "variants": list(cfg.variants), "lr": cfg.lr},
            "layouts": results},
        plot=write_png)
