"""``fireflyer bench ddp``: haiscale DDP on hfreduce against torch DDP on gloo, in the same run.

For each layout (default 1 node x 4 ranks and 2 emulated nodes x 2), every rank trains
the same ~25M-parameter GPT (about 100 MB of fp32 gradients) several ways, in
alternating rounds: without communication (the compute floor), with haiscale DDP, with
torch DDP over gloo (the baseline), and with torch DDP's own reducer on the hfreduce
process group (to compare haiscale's hooks with torch's reducer on the same engine). It reports the step times, their ratio, each backend's allreduce of the
same buckets with nothing else running, and the fraction of that communication hidden
behind backward. Weak scaling runs haiscale DDP at 1, 2 and 4 ranks on one node with
the per-rank batch fixed.

The floor a DDP step can reach is the compute-alone step: perfect hiding. On a machine
with fewer cores than ranks, communication that runs on the CPU competes with compute
for the same cores, so it cannot be fully hidden there; the report says how many cores
each rank had.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from fireflyer.cliutil import ArgumentParser, doc_summary, plural
from fireflyer.bench.harness import figure, make_console, progress
from fireflyer.bench.skeleton import run_bench, run_ranks
from fireflyer.errors import UserError

WORKER_TIMEOUT_S = 300.0
"""Each rank's process-group timeout."""


@dataclass(frozen=True, kw_only=True)
class DDPBenchConfig:
    layouts: tuple[tuple[int, int], ...] = ((1, 4), (2, 2))
    weak: tuple[int, ...] = (1, 2, 4)
    layers: int = 3
    d_model: int = 768
    vocab: int = 4096
    context: int = 64
    batch: int = 1
    """Sequences per rank per step."""
    steps: int = 6
    """Timed steps per round."""
    rounds: int = 3
    bucket_mb: float = 25.0
    out_dir: str = "benchmarks/results"
    timeout: float = 900.0
    """Seconds per layout before it is stopped."""


def _layout(text: str) -> tuple[int, int]:
    try:
        nodes, per = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise UserError(f"layout {text!r} is not NODESxRANKS, e.g. 2x2") from None
    if nodes < 1 or per < 1 or nodes * per > 16:
        raise UserError(f"layout {text!r} needs 1-16 ranks in all")
    return nodes, per


def build_config(argv: list[str]) -> DDPBenchConfig:
    p = ArgumentParser(prog="fireflyer bench ddp", description=doc_summary(__doc__))
    p.add_argument("--layouts", default="1x4,2x2", help="NODESxRANKS list (default 1x4,2x2)")
    p.add_argument("--weak", default="1,2,4", help="rank counts for weak scaling on one node, or 'none'")
    p.add_argument("--layers", type=int, default=3, help="the GPT's transformer blocks (default 3)")
    p.add_argument("--d-model", type=int, default=768, help="the GPT's width, a multiple of 64 (default 768)")
    p.add_argument("--vocab", type=int, default=4096, help="token ids (default 4096)")
    p.add_argument("--context", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step (default 1)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the ways alternating (default 3)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MiB (default 25)")
    p.add_argument("--out", default="benchmarks/results", help="directory for ddp.json and ddp.png")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per layout before it is stopped")
    a = p.parse_args(argv)
    for name in ("layers", "d_model", "vocab", "context", "batch", "steps", "rounds"):
        if getattr(a, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if a.d_model % 64:
        raise UserError("--d-model must be a multiple of 64 (heads of 64)")
    if not a.bucket_mb > 0:
        raise UserError("--bucket-mb must be positive")
    weak: tuple[int, ...] = ()
    if a.weak.lower() != "none":
        try:
            weak = tuple(int(x) for x in a.weak.split(","))
        except ValueError:
            raise UserError(f"--weak {a.weak!r} is not a list of rank counts") from None
        if any(w < 1 or w > 16 for w in weak):
            raise UserError("--weak rank counts must be between 1 and 16")
    return DDPBenchConfig(layouts=tuple(_layout(x) for x in a.layouts.split(",")), weak=weak, layers=a.layers,
                          d_model=a.d_model, vocab=a.vocab, context=a.context, batch=a.batch, steps=a.steps,
                          rounds=a.rounds, bucket_mb=a.bucket_mb, out_dir=a.out, timeout=a.timeout)


def _run(cfg: DDPBenchConfig, nodes: int, per: int, variants: str) -> dict[str, Any]:
    """One layout's report: the run's sizes (rank 0's) and every rank's times."""
    spec = {"layers": cfg.layers, "d_model": cfg.d_model, "vocab": cfg.vocab, "context": cfg.context,
            "batch": cfg.batch, "steps": cfg.steps, "rounds": cfg.rounds, "bucket_mb": cfg.bucket_mb,
            "variants": variants.split(","), "timeout_s": WORKER_TIMEOUT_S}
    ranks = run_ranks("fireflyer.bench.ddp_worker", spec, (nodes, per), timeout_s=cfg.timeout)
    return {**ranks[0]["run"], "ranks": ranks}


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    """Slowest rank decides a step; hidden = share of the stand-alone allreduce time not seen as extra step time."""
    ranks = report["ranks"]
    step = {k: max(r["step_s"][k] for r in ranks) for k in ranks[0]["step_s"]}
    comm = {k: max(r["comm_alone_s"][k] for r in ranks) for k in ranks[0]["comm_alone_s"]}
    row: dict[str, Any] = {"world": report["world"], "nodes": report["nodes"], "params": report["params"],
                           "grad_bytes": report["grad_bytes"], "tokens_per_rank": report["tokens_per_rank"],
                           "threads_per_rank": report["threads_per_rank"], "buckets": report["buckets"],
                           "step_s": step, "comm_alone_s": comm}
    compute = step["compute"]
    row["allreduce_gbps_alone"] = {k: report["grad_bytes"] / v / 1e9 for k, v in comm.items()}
    row["exposed_s"] = {k: step[k] - compute for k in comm}
    row["hidden_fraction"] = {k: min(1.0, max(0.0, 1 - row["exposed_s"][k] / comm[k])) for k in comm}
    waits = [r["haiscale_wait_s"] for r in ranks if r.get("haiscale_wait_s") is not None]
    if waits and "haiscale" in comm:
        row["haiscale_wait_s"] = max(waits)
        row["hidden_fraction_wait"] = min(1.0, max(0.0, 1 - max(waits) / comm["haiscale"]))
    if "gloo" in step and "haiscale" in step:
        row["ratio"] = step["haiscale"] / step["gloo"]
    if "torch-hfreduce" in step and "gloo" in step:
        row["ratio_torch_reducer_on_hfreduce"] = step["torch-hfreduce"] / step["gloo"]
    row["pct_of_floor"] = {k: compute / v * 100 for k, v in step.items() if k != "compute"}
    return row


def _print(console: Any, rows: list[dict[str, Any]], weak: list[dict[str, Any]]) -> None:
    from rich.table import Table

    t = Table(title="DDP step: haiscale on hfreduce vs torch DDP on gloo (slowest rank, median of rounds)")
    for col in ("layout", "params", "compute floor", "haiscale", "gloo", "ratio", "torch DDP on hfreduce",
                "hidden hs", "hidden gloo", "allreduce alone hs / gloo"):
        t.add_column(col, justify="right")
    for r in rows:
        s, h = r["step_s"], r["hidden_fraction"]
        t.add_row(f"{r['nodes']}x{r['world'] // r['nodes']}", f"{r['params'] / 1e6:.1f}M", f"{s['compute'] * 1e3:.0f} ms",
                  f"{s['haiscale'] * 1e3:.0f} ms", f"{s['gloo'] * 1e3:.0f} ms", f"{r['ratio']:.2f}x",
                  f"{s['torch-hfreduce'] * 1e3:.0f} ms" if "torch-hfreduce" in s else "-",
                  f"{h['haiscale'] * 100:.0f}%", f"{h['gloo'] * 100:.0f}%",
                  f"{r['allreduce_gbps_alone']['haiscale']:.2f} / {r['allreduce_gbps_alone']['gloo']:.2f} GB/s")
    console.print(t)
    if weak:
        w = Table(title="Weak scaling, haiscale DDP, one node, fixed batch per rank")
        for col in ("ranks", "step", "compute floor", "efficiency vs 1 rank", "compute-only efficiency"):
            w.add_column(col, justify="right")
        for r in weak:
            w.add_row(str(r["world"]), f"{r['step_s']['haiscale'] * 1e3:.0f} ms", f"{r['step_s']['compute'] * 1e3:.0f} ms",
                      f"{r['efficiency'] * 100:.0f}%", f"{r['compute_efficiency'] * 100:.0f}%")
        console.print(w)


def _write_png(path: str, rows: list[dict[str, Any]], weak: list[dict[str, Any]]) -> None:
    with figure(path, 1, 2 if weak else 1, figsize=(11 if weak else 6, 4), squeeze=False) as (fig, axes):
        ax = axes[0][0]
        labels = [f"{r['nodes']}x{r['world'] // r['nodes']}" for r in rows]
        xs = range(len(rows))
        for k, (name, color) in enumerate((("compute", "#999999"), ("haiscale", "#1f77b4"), ("gloo", "#d62728"))):
            ax.bar([x + (k - 1) * 0.27 for x in xs], [r["step_s"][name] * 1e3 for r in rows], width=0.27,
                   label={"compute": "compute alone (floor)", "haiscale": "haiscale DDP (hfreduce)",
                          "gloo": "torch DDP (gloo)"}[name], color=color)
        for x, r in zip(xs, rows):
            ax.text(x + 0.27, r["step_s"]["gloo"] * 1e3, f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"DDP step, {rows[0]['params'] / 1e6:.0f}M params" if rows else "DDP step")
        ax.legend(fontsize=8)
        if weak:
            ax2 = axes[0][1]
            ax2.plot([r["world"] for r in weak], [r["efficiency"] * 100 for r in weak], "o-", label="haiscale DDP")
            ax2.plot([r["world"] for r in weak], [r["compute_efficiency"] * 100 for r in weak], "s--",
                     color="#999999", label="compute alone")
            ax2.set_xlabel("ranks (one node)")
            ax2.set_ylabel("weak-scaling efficiency (%)")
            ax2.set_ylim(0, 110)
            ax2.legend(fontsize=8)
            ax2.set_title("Weak scaling")


def measure(cfg: DDPBenchConfig) -> dict[str, list[dict[str, Any]]]:
    """Every layout's summary and the weak-scaling runs'."""
    say = progress()
    rows = []
    for nodes, per in cfg.layouts:
        say(f"layout {nodes}x{per}: compute, haiscale DDP, torch DDP over gloo ...")
        rows.append(summarise(_run(cfg, nodes, per, "compute,haiscale,gloo,torch-hfreduce")))
    weak = []
    for n in cfg.weak:
        say(f"weak scaling: {plural(n, 'rank')} ...")
        weak.append(summarise(_run(cfg, 1, n, "compute,haiscale")))
    for r in weak:  # fixed work per rank: efficiency is the smallest run's step time over this one's
        r["efficiency"] = weak[0]["step_s"]["haiscale"] / r["step_s"]["haiscale"]
        r["compute_efficiency"] = weak[0]["step_s"]["compute"] / r["step_s"]["compute"]
    return {"layouts": rows, "weak_scaling": weak}


def main(argv: list[str]) -> int:
    return run_bench(
        argv, part="ddp", configure=build_config, measure=measure,
        report=lambda cfg, r: _print(make_console(), r["layouts"], r["weak_scaling"]),
        fields=lambda cfg, r: {"baseline": "torch.nn.parallel.DistributedDataParallel over gloo",
                               "floor": "compute alone: the same steps with no communication (perfect hiding)",
                               "target": {"ratio_at_most": 0.6}, **r},
        plot=lambda path, cfg, r: _write_png(path, r["layouts"], r["weak_scaling"]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
