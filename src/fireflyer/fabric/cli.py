"""``fireflyer plan`` and ``fireflyer simulate``: thin; flags map onto the fabric's config and functions."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence

from fireflyer import cliutil
from fireflyer.cliutil import ArgumentParser
from fireflyer.errors import UserError
from fireflyer.fabric import catalog as catalog_mod
from fireflyer.fabric import topology
from fireflyer.fabric.collectives import ALGOS, ModelParams, sweep
from fireflyer.fabric.plan import PlanConfig, build_design, plan, render
from fireflyer.fabric.routing import PLACEMENTS, Network

DEFAULT_GPUS = "16,32,64,128,256,512,1024,1440"
def parse_size(text: str) -> int:
    """Bytes from ``"1048576"``, ``"64K"``, ``"186MiB"``, ``"1G"`` (binary units)."""
    return cliutil.parse_size(text, example="186MiB", positive=True)


def parse_counts(text: str, what: str = "--gpus") -> list[int]:
    """``"16,32,64"`` as a list of positive ints."""
    out = []
    for part in str(text).split(","):
        part = part.strip().replace("_", "")
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise UserError(f"{what} takes positive whole numbers separated by commas, got {part!r}")
        out.append(int(part))
    if not out:
        raise UserError(f"{what} needs at least one number")
    return out


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    if not args or args[0] not in ("plan", "simulate"):
        raise UserError("usage: fireflyer plan ... | fireflyer simulate allreduce|placement|paper|train|goodput ...")
    if args[0] == "plan":
        return plan_main(args[1:])
    return simulate_main(args[1:])


# -- plan ------------------------------------------------------------------------------------

def plan_main(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer plan", description="Plan a GPU cluster's network, price and power "
                       "(the paper's Fire-Flyer 2 design) against a three-layer fat tree and DGX nodes.")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster")
    p.add_argument("--node", default=None, help="node preset (default pcie-a100)")
    p.add_argument("--switch", default=None, help="switch preset (default frame800)")
    p.add_argument("--planes", type=int, default=1, help="network planes (default 1)")
    p.add_argument("--storage-nodes", type=int, default=0,
                   help="storage servers with one NIC in every zone (default 0)")
    p.add_argument("--alternative-node", default=None, help="node to compare against (default dgx-a100)")
    p.add_argument("--core-rounding", default="pow2", choices=topology.CORE_ROUNDING,
                   help="three-layer core built for the next power of two of pods (pow2, the paper's "
                        "figures) or for the pods there are (exact)")
    p.add_argument("--catalog", default=None, metavar="FILE", help="TOML merged over the default parts catalogue")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--plot", default=None, metavar="DIR", help="write fabric-topology.png and fabric-cost.png into DIR")
    p.add_argument("--job", default=None, metavar="MODEL",
                   help="price a training job on all the GPUs against --baseline-node (a model preset or TOML), "
                        "e.g. deepseekmoe-16b for section IX's MoE design")
    p.add_argument("--ep", type=int, default=-1,
                   help="expert-parallel ranks of --job (default: the model's routed experts; 0: a node's DP ranks)")
    p.add_argument("--baseline-node", default="pcie-a100-nvlink",
                   help="today's node to price --job against (default pcie-a100-nvlink: one NIC)")
    a = p.parse_args(argv)
    cat = catalog_mod.load(a.catalog)
    if a.job:
        cat.node(a.baseline_node)
    cfg = PlanConfig(gpus=a.gpus, node=a.node, switch=a.switch, planes=a.planes, storage_nodes=a.storage_nodes,
                     alternative_node=a.alternative_node, core_rounding=a.core_rounding, job=a.job, ep=a.ep,
                     baseline_node=a.baseline_node)
    result = plan(cfg, cat)
    if a.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(render(result))
    if a.plot:
        from fireflyer.fabric.report import plot_plan

        for path in plot_plan(result, a.plot):
            print(f"wrote {path}", file=sys.stderr if a.json else sys.stdout)
    return 0


# -- simulate --------------------------------------------------------------------------------

def simulate_main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: fireflyer simulate allreduce|placement|paper|train|goodput [options]\n"
              "  allreduce  time, algbw and busbw against GPU count\n"
              "  placement  HAI's zone-aware placement against a naive one\n"
              "  paper      every reproduced figure of the paper, model next to paper\n"
              "  train      a training step's time for a model on N GPUs (the Fig. 8/9 model)\n"
              "  goodput    checkpoint-restart against fault-tolerant training as failures grow with GPU count\n"
              "Run 'fireflyer simulate allreduce --help' for the options.")
        return 0 if argv else 2
    if argv[0] == "allreduce":
        return _allreduce_main(argv[1:])
    if argv[0] == "placement":
        return _placement_main(argv[1:])
    if argv[0] == "paper":
        return _paper_main(argv[1:])
    if argv[0] == "train":
        return _train_main(argv[1:])
    raise UserError(f"unknown simulation {argv[0]!r}; choose allreduce, placement, paper, train or goodput"
                    + (" (goodput is the validator's: run it as 'fireflyer simulate goodput')" if argv[0] == "goodput"
                       else ""))


def _paper_main(argv: list[str]) -> int:
    from fireflyer.fabric import reproduce

    p = ArgumentParser(prog="fireflyer simulate paper",
                       description="Every figure of the paper the fabric model reproduces, model next to paper.")
    p.add_argument("--catalog", default=None, metavar="FILE", help="TOML merged over the default parts catalogue")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the Figure 7 chart (model and paper)")
    p.add_argument("--plot-training", default=None, metavar="PNG",
                   help="write the Figures 8 and 9 chart (step time, model and paper)")
    a = p.parse_args(argv)
    cat = catalog_mod.load(a.catalog)
    rows = reproduce.rows(cat)
    if a.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        print(reproduce.render(rows))
    if a.plot:
        from fireflyer.fabric.report import plot_allreduce

        path = plot_allreduce(reproduce.figure7(cat), a.plot)
        print(f"wrote {path}", file=sys.stderr if a.json else sys.stdout)
    if a.plot_training:
        from fireflyer.fabric.report import plot_training

        path = plot_training(reproduce.figure8_9(cat), a.plot_training)
        print(f"wrote {path}", file=sys.stderr if a.json else sys.stdout)
    return 0


def _train_main(argv: list[str]) -> int:
    from fireflyer.fabric import reproduce
    from fireflyer.fabric.steptime import STRATEGIES, SYSTEMS, Job, step_time
    from fireflyer.fabric.workloads import MODELS, TRAIN_PRESETS, model

    p = ArgumentParser(prog="fireflyer simulate train",
                       description="A training step's time on N GPUs: compute, communication, overlap and the "
                                   "pipeline bubble, with the constants that reproduce Figures 8 and 9.")
    p.add_argument("--model", required=True, help=f"{' | '.join(MODELS)} | FILE.toml (a ModelSpec)")
    p.add_argument("--gpus", required=True, help="GPU counts, comma-separated")
    p.add_argument("--strategy", default=None, choices=STRATEGIES,
                   help="pipeline (default for transformers), ddp or fsdp (weak scaling)")
    p.add_argument("--system", default="haiscale", choices=SYSTEMS, help="haiscale (default) or torch")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages (default: the paper's for the preset, else 1)")
    p.add_argument("--ep", type=int, default=0, help="expert-parallel ranks of an MoE (default: a node's DP ranks)")
    p.add_argument("--global-batch", type=int, default=None, help="samples per step (pipeline)")
    p.add_argument("--batch-per-gpu", type=int, default=None, help="samples per GPU per step (ddp, fsdp)")
    p.add_argument("--no-stagger", action="store_true", help="place a node's GPUs in one DP rank (not the paper's way)")
    p.add_argument("--node", default=None, help="node preset (default pcie-a100-nvlink for pipeline, else pcie-a100)")
    p.add_argument("--catalog", default=None, metavar="FILE", help="TOML merged over the default parts catalogue")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    a = p.parse_args(argv)
    cat = catalog_mod.load(a.catalog)
    spec = model(a.model)
    counts = parse_counts(a.gpus)
    preset = TRAIN_PRESETS.get(spec.name, {})
    strategy = a.strategy or ("pipeline" if spec.layers else "ddp")
    node = cat.node(a.node or ("pcie-a100-nvlink" if strategy == "pipeline" else "pcie-a100"))
    for name in ("pp", "global_batch", "batch_per_gpu"):
        value = getattr(a, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    net = reproduce.fire_flyer_network() if max(counts) <= 10000 else None
    results = []
    for gpus in counts:
        batch = a.global_batch or preset.get("global_batch", 0) or (gpus if strategy == "pipeline" else 0)
        job = Job(model=spec, gpus=gpus, strategy=strategy, system=a.system, pp=a.pp or preset.get("pp", 1),
                  ep=a.ep, global_batch=batch,
                  batch_per_gpu=a.batch_per_gpu or (0 if strategy == "pipeline" else 32), stagger=not a.no_stagger)
        results.append(step_time(job, node, network=net))
    if a.json:
        print(json.dumps({"node": node.name, "results": [r.to_dict() for r in results]}, indent=2))
        return 0
    j0 = results[0].job
    batch = f", {j0.global_batch} samples a step" if strategy == "pipeline" else f", {j0.batch_per_gpu} per GPU"
    print(f"{spec.name} ({spec.training_flops_per_sample:.3g} FLOP per sample, {spec.precision}), {strategy}, "
          f"{a.system}, pp={j0.pp} on {node.name} nodes{batch}")
    base = results[0]
    print(f"{'GPUs':>6} {'step s':>10} {'compute s':>10} {'efficiency':>10}  exposed")
    for r in results:
        if strategy == "pipeline":  # strong scaling: the same batch on more GPUs
            eff = (base.seconds * base.job.gpus) / (r.seconds * r.job.gpus)
        else:
            eff = base.seconds / r.seconds
        exposed = ", ".join(f"{k} {v:.3g}" for k, v in r.parts.items() if v > 0)
        print(f"{r.job.gpus:>6} {r.seconds:>10.4g} {r.compute:>10.4g} {eff:>10.1%}  {exposed}")
    return 0


def _common(p: ArgumentParser) -> None:
    p.add_argument("--node", default="pcie-a100", help="node preset (default pcie-a100)")
    p.add_argument("--switch", default=None, help="switch preset (default frame800)")
    p.add_argument("--cluster-gpus", type=int, default=10000,
                   help="the cluster the jobs are placed in (default 10000: Fire-Flyer 2's two zones)")
    p.add_argument("--planes", type=int, default=1, help="network planes (default 1)")
    p.add_argument("--catalog", default=None, metavar="FILE", help="TOML merged over the default parts catalogue")
    p.add_argument("--size", default="186MiB", help="buffer per GPU (default 186MiB, the paper's Figure 7)")
    p.add_argument("--chunk", default="5MiB", help="HFReduce pipeline chunk (default 5MiB)")
    p.add_argument("--seed", type=int, default=0, help="seed of the naive placement (default 0)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _network(a, cat, node, min_gpus: int) -> Network:
    switch = cat.switch(a.switch or cat.defaults.switch)
    design = build_design(max(a.cluster_gpus, min_gpus), node, switch, cat, planes=a.planes)
    f = design.fabric
    return Network(f, nics_per_node_per_plane=node.nics // a.planes, nodes_per_zone=math.ceil(design.nodes / f.zones))


def _allreduce_main(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer simulate allreduce",
                       description="Model allreduce time, algbw and busbw against GPU count.")
    p.add_argument("--gpus", default=DEFAULT_GPUS, help=f"GPU counts, comma-separated (default {DEFAULT_GPUS})")
    p.add_argument("--algo", default=None,
                   help=f"algorithms, comma-separated, of: {', '.join(ALGOS)} (default hfreduce,ring, "
                        f"and hfreduce-nvlink on a node with NVLink)")
    p.add_argument("--placement", default="packed", choices=PLACEMENTS,
                   help="packed: one zone (HAI); cross-zone: half in each zone, one crossing pair; "
                        "naive: random nodes anywhere (default packed)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a chart of algbw against GPUs")
    _common(p)
    a = p.parse_args(argv)
    cat = catalog_mod.load(a.catalog)
    node = cat.node(a.node)
    counts = parse_counts(a.gpus)
    algos = [x.strip() for x in a.algo.split(",")] if a.algo else (
        ["hfreduce", "ring"] + (["hfreduce-nvlink"] if node.nvlink != "none" else []))
    for algo in algos:
        if algo not in ALGOS:
            raise UserError(f"unknown algorithm {algo!r}; choose from: {', '.join(ALGOS)}")
    size = parse_size(a.size)
    params = ModelParams(chunk_bytes=parse_size(a.chunk))
    net = _network(a, cat, node, max(counts))
    results = sweep(algos, counts, size, node, network=net, placement_policy=a.placement, params=params,
                    seed=a.seed)
    if a.json:
        print(json.dumps({"node": node.name, "size_bytes": size, "placement": a.placement,
                          "results": [r.to_dict() for r in results]}, indent=2))
    else:
        print(f"allreduce of {size / (1 << 20):g} MiB per GPU on {node.name} nodes, {a.placement} placement "
              f"in a {a.cluster_gpus:,}-GPU cluster ({net.fabric.kind})")
        print(f"{'GPUs':>6} {'nodes':>6}  {'algorithm':<16} {'time ms':>9} {'algbw GB/s':>11} {'busbw GB/s':>11}"
              f"  bottleneck")
        for r in results:
            print(f"{r.gpus:>6} {r.nodes:>6}  {r.algo:<16} {r.seconds * 1000:>9.2f} {r.algbw_gb_s:>11.2f} "
                  f"{r.busbw_gb_s:>11.2f}  {r.bottleneck}")
    if a.plot:
        from fireflyer.fabric.report import algo_label, plot_allreduce

        series = {algo_label(algo, a.placement): [r for r in results if r.algo == algo] for algo in algos}
        path = plot_allreduce(series, a.plot)
        print(f"wrote {path}", file=sys.stderr if a.json else sys.stdout)
    return 0


def _placement_main(argv: list[str]) -> int:
    from fireflyer.fabric.placement import render as render_study
    from fireflyer.fabric.placement import study

    p = ArgumentParser(prog="fireflyer simulate placement",
                       description="Tasks placed the HAI way (one cross-zone task at most, one crossing pair) "
                                   "against naively, all running an allreduce at once.")
    p.add_argument("--tasks", default="400,300,200,150,100,50,50",
                   help="nodes of each task, comma-separated (default 400,300,200,150,100,50,50)")
    p.add_argument("--algo", default="hfreduce", choices=ALGOS, help="algorithm (default hfreduce)")
    _common(p)
    a = p.parse_args(argv)
    cat = catalog_mod.load(a.catalog)
    node = cat.node(a.node)
    tasks = parse_counts(a.tasks, "--tasks")
    net = _network(a, cat, node, 0)
    params = ModelParams(chunk_bytes=parse_size(a.chunk))
    res = study(net, node, tasks, algo=a.algo, size_bytes=parse_size(a.size), seed=a.seed, params=params)
    if a.json:
        print(json.dumps({k: v.to_dict() for k, v in res.items()}, indent=2))
    else:
        print(f"{len(tasks)} tasks ({sum(tasks):,} nodes) in a {a.cluster_gpus:,}-GPU cluster of {net.zones} zones, "
              f"{net.bridges} bridges x {net.bridge_links} links; {a.algo} allreduce of {a.size} in every task at once")
        print(render_study(res))
        for name, r in res.items():
            if r.unplaced:
                print(f"{name}: could not place tasks of {r.unplaced} nodes")
    return 0
