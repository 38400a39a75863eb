"""Files the fabric commands write: JSON and PNG charts, atomically (temporary file, fsync,
rename, with :func:`fireflyer.fsutil.atomic_write`, which imports no torch). matplotlib is
imported only when a chart is drawn, with the Agg backend.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fireflyer.fabric import paper
from fireflyer.fabric.collectives import ALGO_TITLES, AllreduceResult
from fireflyer.fsutil import atomic_write

if TYPE_CHECKING:
    from fireflyer.fabric.plan import Plan


def _write(path: str | Path, write: Any) -> Path:
    """``write(file)`` into a hidden temporary file beside ``path``, then :func:`atomic_write`'s fsync and rename."""
    path = Path(path)
    atomic_write(str(path), write, tmp_name=f".{path.name}.{os.getpid()}.tmp")
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path) -> Path:
    plt = _pyplot()
    try:
        return _write(path, lambda f: fig.savefig(f, format="png", dpi=90))
    finally:
        plt.close(fig)


# -- charts ----------------------------------------------------------------------------------

def plot_allreduce(series: dict[str, list[AllreduceResult]], path: str | Path, *, title: str = "",
                   paper_points: bool = True) -> Path:
    """algbw against GPU count, one line per series, with the paper's Figure 7 readings."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.6))
    for label, rs in series.items():
        ax.plot([r.gpus for r in rs], [r.algbw_gb_s for r in rs], marker="o", ms=4, label=f"model: {label}")
    if paper_points:
        for pts, label, mk, color in ((paper.FIG7A_HFREDUCE, "paper 7a HFReduce", "s", "tab:blue"),
                                      (paper.FIG7A_NCCL, "paper 7a NCCL", "v", "tab:orange"),
                                      (paper.FIG7B_IN_ZONE, "paper 7b HFReduce+NVLink", "D", "tab:green"),
                                      (paper.FIG7B_CROSS_ZONE, "paper 7b cross-zone", "X", "tab:red")):
            pts = {paper.FIG7_RUN_GPUS.get(g, g) if pts is paper.FIG7A_HFREDUCE or pts is paper.FIG7A_NCCL else g: v
                   for g, v in pts.items()}  # the chart's "1440" ran on 1,280 GPUs
            ax.scatter(list(pts), list(pts.values()), marker=mk, s=36, color=color, edgecolor="black",
                       linewidths=0.6, zorder=4, label=label)
        lo, hi, a, b = paper.FIG7A_NCCL_BAND
        ax.fill_between([lo, hi], [a, a], [b, b], color="tab:orange", alpha=0.15, label="paper 7a NCCL band")
    ax.set_xscale("log", base=2)
    ticks = sorted({r.gpus for rs in series.values() for r in rs})
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("GPUs")
    ax.set_ylabel("algbw (GB/s)")
    ax.set_title(title or "allreduce of 186 MiB: model against the paper's Figure 7")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return _save(fig, path)


def plot_training(series: dict[str, dict[int, float]], path: str | Path) -> Path:
    """Figures 8 and 9: the model's step time (lines) against the paper's readings (markers)."""
    plt = _pyplot()
    want = {**paper.FIG8A, **paper.FIG8B, "LLaMA-13B PP=4": paper.FIG9A, "DeepSeekMoE-16B PP=10": paper.FIG9B}
    panels = [("Fig. 8a: VGG16, DDP (weak scaling)", [k for k in series if k in paper.FIG8A]),
              ("Fig. 8b: GPT-2 medium, FSDP (weak scaling)", [k for k in series if k in paper.FIG8B]),
              ("Fig. 9a: LLaMA-13B, PP=4 (strong scaling)", ["LLaMA-13B PP=4"]),
              ("Fig. 9b: DeepSeekMoE-16B, PP=10 (strong scaling)", ["DeepSeekMoE-16B PP=10"])]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (title, names) in zip(axes.flat, panels):
        for i, name in enumerate(names):
            pts = series.get(name, {})
            color = f"C{i}"
            ax.plot(list(pts), list(pts.values()), marker="o", ms=4, color=color, label=f"model: {name}")
            ref = want[name]
            ax.scatter(list(ref), list(ref.values()), marker="D", s=36, color=color, edgecolor="black",
                       linewidths=0.6, zorder=4, label=f"paper: {name}")
        ax.set_xscale("log", base=2)
        ticks = sorted({g for n in names for g in want[n]})
        ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=8)
        ax.minorticks_off()
        if "strong" in title:
            from matplotlib.ticker import NullFormatter, ScalarFormatter

            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("GPUs")
        ax.set_ylabel("seconds per step")
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("step-time model (one set of constants) against the paper's Figures 8 and 9", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def plot_plan(plan: Plan, directory: str | Path) -> list[Path]:
    """``fabric-topology.png`` (the design's switches) and ``fabric-cost.png`` (against the alternatives)."""
    directory = Path(directory)
    return [_plot_topology(plan, directory / "fabric-topology.png"), _plot_cost(plan, directory / "fabric-cost.png")]


def _plot_topology(plan: Plan, path: Path) -> Path:
    plt = _pyplot()
    from matplotlib.patches import Rectangle

    f = plan.design.fabric
    fig, ax = plt.subplots(figsize=(9, 3.8))
    zones = f.zones
    leaves = f.leaves_per_zone or f.leaf
    spines = f.spines_per_zone or f.spine
    zone_w = 10.0
    gap = 3.0 if zones > 1 else 0.0
    for z in range(zones):
        x0 = z * (zone_w + gap)
        ax.add_patch(Rectangle((x0 - 0.3, -0.6), zone_w + 0.6, 4.4, fill=False, ls="--", lw=0.8, color="gray"))
        lx = [x0 + (i + 0.5) * zone_w / leaves for i in range(leaves)]
        sx = [x0 + (i + 0.5) * zone_w / spines for i in range(spines)]
        step = max(1, leaves // 10)
        for i in range(0, leaves, step):
            for j in range(0, spines, max(1, spines // 5)):
                ax.plot([lx[i], sx[j]], [0.5, 2.5], color="tab:blue", lw=0.3, alpha=0.5)
        ax.scatter(lx, [0.5] * leaves, marker="s", s=max(4, 600 / leaves), color="tab:green", zorder=3)
        ax.scatter(sx, [2.5] * spines, marker="s", s=max(4, 600 / spines), color="tab:orange", zorder=3)
        per = f.zone_endpoints[z] if z < len(f.zone_endpoints) else f.endpoints
        ax.text(x0 + zone_w / 2, 3.4, f"zone {z}: {leaves} leaves, {spines} spines, {per:,} endpoints",
                ha="center", fontsize=8)
    if f.bridge:
        total_w = zones * zone_w + (zones - 1) * gap
        for b in range(f.bridge):
            bx = total_w / 2 + (b - (f.bridge - 1) / 2) * 1.5
            ax.scatter([bx], [-1.6], marker="D", s=60, color="tab:red", zorder=3)
            for z in range(zones):
                x0 = z * (zone_w + gap)
                ax.plot([bx, x0 + zone_w * (0.9 if z == 0 else 0.1)], [-1.6, 0.5], color="tab:red", lw=0.8)
        ax.text(total_w / 2, -2.4, f"{f.bridge} bridge switches, {f.bridge_links} links into each zone",
                ha="center", fontsize=8)
    ax.set_xlim(-1, zones * zone_w + (zones - 1) * gap + 1)
    ax.set_ylim(-2.9, 4.0)
    ax.axis("off")
    planes = f" x {f.planes} planes" if f.planes > 1 else ""
    ax.set_title(f"{plan.config.gpus:,} GPUs: {f.kind}{planes}, {f.switches:,} switches "
                 f"({plan.design.switch.name}); leaves green, spines orange, bridges red", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def _plot_cost(plan: Plan, path: Path) -> Path:
    plt = _pyplot()
    designs = plan.designs()
    names = ["this design"] + [("PCIe 3-layer" if d is plan.three_layer else d.node.name) for d in designs[1:]]
    metrics = [("switches", [d.fabric.switches for d in designs]),
               ("network price", [d.cost.network for d in designs]),
               ("total price", [d.cost.total for d in designs]),
               ("power (kW)", [d.cost.power_w / 1000 for d in designs])]
    fig, axes = plt.subplots(1, 4, figsize=(11, 3.4))
    colors = ["tab:green", "tab:blue", "tab:gray"][: len(designs)]
    for ax, (label, vals) in zip(axes, metrics):
        ax.bar(range(len(vals)), vals, color=colors)
        ax.set_xticks(range(len(vals)), names, fontsize=7, rotation=15)
        ax.set_title(label, fontsize=9)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(f"{plan.config.gpus:,} GPUs: cost and power (Table III units)", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def algo_label(algo: str, placement: str = "packed") -> str:
    base = ALGO_TITLES.get(algo, algo)
    return base if placement == "packed" else f"{base} ({placement})"
