"""``fireflyer bench fabric``: how long planning and simulating take against cluster size.

For each size: plan the cluster (design, alternatives, cost, whole-cluster allreduce) and
simulate the allreduce sweep of Figure 7 (HFReduce and ring at 16..1,440 GPUs, plus the
whole cluster) on it; single-plane Fire-Flyer nodes up to 10,000 GPUs and section IX's
4-plane network of 128-port switches at 32,768. Targets (the issue's): 10,000 GPUs under
2 s, 32,768 multi-plane under 5 s. Writes ``fabric.json`` and ``fabric.png``.
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Iterable
from dataclasses import dataclass

from fireflyer.bench.harness import figure, timestamp
from fireflyer.bench.skeleton import run_bench
from fireflyer.cliutil import ArgumentParser, doc_summary
from fireflyer.errors import UserError
from fireflyer.fabric import catalog as catalog_mod
from fireflyer.fabric.cli import parse_counts
from fireflyer.fabric.collectives import MiB, sweep
from fireflyer.fabric.plan import PlanConfig, plan
from fireflyer.fabric.routing import Network

FIG7_GPUS = [16, 32, 64, 128, 256, 512, 1024, 1440]


@dataclass(frozen=True, kw_only=True)
class FabricBenchConfig:
    sizes: tuple[int, ...] = (1000, 2000, 5000, 10000)
    multiplane: tuple[int, ...] = (8192, 16384, 32768)
    repeats: int = 3
    out_dir: str = "benchmarks/results"

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise UserError("--repeats must be at least 1")


def run_one(gpus: int, *, node: str, switch: str, planes: int, catalog: catalog_mod.Catalog) -> dict:
    """Plan ``gpus`` GPUs and simulate the Figure 7 sweep and the whole cluster on the plan's network."""
    t0 = time.perf_counter()
    p = plan(PlanConfig(gpus=gpus, node=node, switch=switch, planes=planes), catalog)
    spec = catalog.node(node)
    f = p.design.fabric
    net = Network(f, nics_per_node_per_plane=spec.nics // planes, nodes_per_zone=math.ceil(p.design.nodes / f.zones))
    counts = [g for g in FIG7_GPUS if g <= p.design.nodes * spec.gpus] + [p.design.nodes * spec.gpus]
    algos = ["hfreduce", "ring"] + (["hfreduce-nvlink"] if spec.nvlink != "none" else [])
    results = sweep(algos, counts, 186 * MiB, spec, network=net)
    seconds = time.perf_counter() - t0
    whole = [r for r in results if r.gpus == counts[-1]]
    return {
        "gpus": gpus, "node": node, "switch": switch, "planes": planes, "seconds": seconds,
        "kind": f"{planes} plane{'s' if planes > 1 else ''}, {node}, {switch}",
        "switches": f.switches, "simulations": len(results),
        "whole_cluster_algbw_gb_s": {r.algo: r.algbw_gb_s for r in whole},
    }


TARGETS = {"10000": 2.0, "32768": 5.0}
"""Seconds to plan and simulate, at most, by GPU count."""


def build_config(argv: list[str]) -> FabricBenchConfig:
    p = ArgumentParser(prog="fireflyer bench fabric", description=doc_summary(__doc__))
    p.add_argument("--sizes", default="1000,2000,5000,10000",
                   help="single-plane cluster sizes in GPUs (default 1000,2000,5000,10000)")
    p.add_argument("--multiplane", default="8192,16384,32768",
                   help="4-plane cluster sizes in GPUs (default 8192,16384,32768)")
    p.add_argument("--repeats", type=int, default=3, help="runs per size; the best is kept (default 3)")
    p.add_argument("--out", default="benchmarks/results", help="where fabric.json and fabric.png go")
    a = p.parse_args(argv)
    return FabricBenchConfig(sizes=tuple(parse_counts(a.sizes, "--sizes")),
                             multiplane=tuple(parse_counts(a.multiplane, "--multiplane")), repeats=a.repeats,
                             out_dir=a.out)


def run(cfg: FabricBenchConfig) -> dict:
    """The result document (its own head: ``bench``, ``when``, ``machine``), each size and the verdicts printed."""
    cat = catalog_mod.default()
    rows = []
    jobs = [(g, "pcie-a100", "frame800", 1) for g in cfg.sizes]
    jobs += [(g, "pcie-nextgen", "roce128", 4) for g in cfg.multiplane]
    print(f"{'GPUs':>7}  {'network':<34} {'switches':>8} {'sims':>5} {'seconds':>8}")
    for gpus, node, switch, planes in jobs:
        best = None
        for _ in range(cfg.repeats):
            row = run_one(gpus, node=node, switch=switch, planes=planes, catalog=cat)
            if best is None or row["seconds"] < best["seconds"]:
                best = row
        rows.append(best)
        print(f"{gpus:>7}  {best['kind']:<34} {best['switches']:>8} {best['simulations']:>5} {best['seconds']:>8.3f}")
    verdicts = {}
    for key, limit in TARGETS.items():
        hit = [r for r in rows if r["gpus"] == int(key)]
        if hit:
            verdicts[key] = {"seconds": hit[0]["seconds"], "target_s": limit, "met": hit[0]["seconds"] < limit}
    report = {
        "bench": "fabric", "when": timestamp(),
        "machine": {"python": platform.python_version(), "processor": platform.processor() or platform.machine()},
        "what": "seconds to plan a cluster and simulate the Figure 7 allreduce sweep plus the whole cluster on it "
                "(best of --repeats)",
        "rows": rows, "targets": verdicts,
    }
    for key, v in verdicts.items():
        print(f"{int(key):,} GPUs: {v['seconds']:.3f} s (target < {v['target_s']:g} s): "
              f"{'met' if v['met'] else 'MISSED'}")
    return report


def main(argv: list[str]) -> int:
    return run_bench(argv, part="fabric", configure=build_config, measure=run, fields=lambda cfg, doc: doc,
                     plot=lambda path, cfg, doc: plot_bench(doc["rows"], path), head=lambda argv: {},
                     indent=2)  # as docs/fabric.json has it


def plot_bench(rows: Iterable[dict], path: str) -> str:
    """Bench: seconds to plan and simulate against GPU count."""
    rows = list(rows)
    with figure(path, figsize=(7, 4)) as (fig, ax):
        for kind in sorted({r["kind"] for r in rows}):
            pts = [r for r in rows if r["kind"] == kind]
            ax.plot([r["gpus"] for r in pts], [r["seconds"] for r in pts], marker="o", label=kind)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("seconds (plan + simulate)")
        ax.axhline(2.0, color="red", lw=0.8, ls="--", label="target at 10,000 GPUs: 2 s")
        ax.axhline(5.0, color="purple", lw=0.8, ls=":", label="target at 32,768 GPUs: 5 s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title("fireflyer bench fabric")
    return path
