"""Every figure of the paper this package reproduces, model value next to paper value.

``fireflyer simulate paper`` prints this table; the unit tests assert the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from fireflyer.fabric import catalog as catalog_mod
from fireflyer.fabric import paper, topology
from fireflyer.fabric.catalog import Catalog
from fireflyer.fabric.collectives import AllreduceResult, sweep
from fireflyer.fabric.cost import compare_nodes
from fireflyer.fabric.plan import PlanConfig, plan
from fireflyer.fabric.routing import Network
from fireflyer.fabric.steptime import Job, step_time
from fireflyer.fabric.workloads import DEEPSEEKMOE_16B, GPT2_MEDIUM, LLAMA_13B, VGG16
from fireflyer.fabric.traffic import (
    memory_traffic,
    ring_pcie_units,
    ring_pcie_units_paper,
)

FIG7A_GPUS = [16, 32, 64, 128, 256, 512, 1024, 1280]
"""Figure 7a's counts as run: the chart's "1440" is the artifact's 160-node job (1,280 GPUs)."""
WITHIN = 0.10
"""Every figure's row is held to 10% unless its paper value is exact (0) or a range (the band)."""

#: Rows the model does not reproduce within 10%, and rows that calibrate a constant, with why.
WHY = {
    "NCCL, 1440 GPUs (GB/s)": "NCCL's cliff (1.63-1.65 GB/s from 1,024 GPUs): no cause the paper supports "
                              "was found (128-160 nodes sit in one zone, the tree's depth and the 9 GiB/s "
                              "GPU<->NIC path do not change at 1,024), so the ring keeps its 2.9 GB/s",
    "NCCL, 1024 GPUs (GB/s)": "NCCL's cliff, as at 1,440: no physical cause found; the model does not invent one",
    "HFReduce+NVLink, 16 GPUs (GB/s)": "the chart's 19.18 GB/s is above the 18.75 GB/s the shared root port "
                                       "allows (4 x 0.5 units on GPU5/6's 37.5 GB/s), before any pipeline fill",
    "HFReduce+NVLink, 32 GPUs (GB/s)": "the chart's 13.0 GB/s at 4 nodes is above the 12.5 GB/s a 25 GB/s NIC "
                                       "allows when each node sends 2 units in a double binary tree",
    "HFReduce+NVLink, 64 GPUs (GB/s)": "near the NIC's 12.5 GB/s bound at 8 nodes; the 5 MiB pipeline fill that "
                                       "matches 128-1,024 GPUs costs too much here",
    "HFReduce, 1440 GPUs (GB/s)": "run on 160 nodes; the chart rises from 6.31 at 1,024 to 6.99 here, while "
                                  "a deeper tree can only lose",
    "HaiScale FSDP, 16 GPUs (s)": "calibration: the TF32 rate is read off this point",
    "LLaMA-13B PP=4, 64 GPUs (s)": "calibration: the BF16 rate is read off this point",
    "HaiScale DDP (HFReduce), 32 GPUs (s)": "VGG16's convolutions run above the one TF32 rate (read off GPT-2 "
                                            "medium); the step is all compute here, so the model is that much slow",
    "Torch FSDP, 16 GPUs (s)": "the chart's Torch FSDP is not monotone (0.84, 0.985, 0.875, 0.99 s); the model "
                               "is flat at compute + allgathers + reduce-scatter",
    "Torch FSDP, 64 GPUs (s)": "as at 16 GPUs: the chart's dip to 0.875 s",
    "DeepSeekMoE-16B PP=10, 80 GPUs (s)": "at 80 GPUs EP goes from 4 to 8 ranks (a node's DP ranks), so each "
                                          "GPU sends 7/8 instead of 3/4 of its tokens, most over PCIe; the chart "
                                          "scales at 98.6% there",
    "DeepSeekMoE-16B PP=10, 160 GPUs (s)": "as at 80 GPUs: EP of 8 over PCIe, serial with compute",
    "DeepSeekMoE-16B PP=10, 320 GPUs (s)": "as at 80 GPUs: EP of 8 over PCIe, serial with compute",
}
FIG7B_GPUS = [16, 32, 64, 128, 256, 512, 1024]


@dataclass(frozen=True)
class Row:
    figure: str
    what: str
    model: float
    paper: float | tuple[float, float]
    tolerance: float
    """Relative tolerance the tests hold the model to (0: exact)."""
    why: str = ""
    """Why the row misses, or which constant it calibrates."""

    @property
    def error(self) -> float:
        """Relative distance from the paper's value (0 inside a band)."""
        if isinstance(self.paper, tuple):
            lo, hi = self.paper
            if lo <= self.model <= hi:
                return 0.0
            return (self.model - hi) / hi if self.model > hi else (self.model - lo) / lo
        return (self.model - self.paper) / self.paper if self.paper else 0.0

    @property
    def ok(self) -> bool:
        return abs(self.error) <= self.tolerance + 1e-9

    def to_dict(self) -> dict:
        return {"figure": self.figure, "what": self.what, "model": self.model,
                "paper": list(self.paper) if isinstance(self.paper, tuple) else self.paper,
                "error": self.error, "tolerance": self.tolerance, "ok": self.ok, "why": self.why}


def fire_flyer_network(nodes: int = 1250) -> Network:
    """Fire-Flyer 2's compute network: two 800-port frame-switch zones and their bridges."""
    return Network(topology.zoned(nodes, 40, frames=True), nodes_per_zone=(nodes + 1) // 2)


def figure7(catalog: Catalog | None = None) -> dict[str, list[AllreduceResult]]:
    """The model's Figure 7 series on Fire-Flyer 2's network."""
    cat = catalog or catalog_mod.default()
    net = fire_flyer_network()
    a100, nvl = cat.node("pcie-a100"), cat.node("pcie-a100-nvlink")
    size = paper.FIG7_BYTES
    return {
        "HFReduce": sweep(["hfreduce"], FIG7A_GPUS, size, a100, network=net),
        "NCCL ring": sweep(["ring"], FIG7A_GPUS, size, a100, network=net),
        "HFReduce with NVLink": sweep(["hfreduce-nvlink"], FIG7B_GPUS, size, nvl, network=net),
        "HFReduce with NVLink, cross-zone": sweep(["hfreduce-nvlink"], [128, 256, 512, 1024], size, nvl, network=net,
                                                  placement_policy="cross-zone"),
    }


def rows(catalog: Catalog | None = None) -> list[Row]:
    cat = catalog or catalog_mod.default()
    out: list[Row] = []
    p = plan(PlanConfig(gpus=10000), cat)
    t3 = paper.TABLE3
    for key, d in (("ours", p.design), ("three_layer", p.three_layer), ("dgx", p.dgx)):
        name = {"ours": "Fire-Flyer 2 (two zones)", "three_layer": "PCIe three-layer", "dgx": "DGX-A100"}[key]
        out.append(Row("Table III", f"{name}: switches", d.fabric.switches, t3[key]["switches"], 0.0))
    for layer, want in paper.TABLE3_DGX_LAYERS.items():
        out.append(Row("III-C", f"DGX fabric: {layer} switches", p.dgx.fabric.switches_by_layer[layer], want, 0.0))
    tl = p.three_layer.fabric.switches_by_layer
    out.append(Row("III-C", "PCIe three-layer (1,600 ports): core switches", tl["core"], 40, 0.0))
    out.append(Row("III-C", "PCIe three-layer: spine + leaf switches", tl["spine"] + tl["leaf"], 160, 0.0))
    for key, d in (("ours", p.design), ("three_layer", p.three_layer), ("dgx", p.dgx)):
        name = {"ours": "Fire-Flyer 2", "three_layer": "PCIe three-layer", "dgx": "DGX-A100"}[key]
        out.append(Row("Table III", f"{name}: network price", round(d.cost.network, 1), t3[key]["network"], 0.05))
        out.append(Row("Table III", f"{name}: server price", d.cost.servers, t3[key]["servers"], 0.0))
        out.append(Row("Table III", f"{name}: total price", round(d.cost.total, 1), t3[key]["total"], 0.01))
    out.append(Row("III-C", "network saving against three layers", round(1 - p.design.cost.network
                                                                           / p.three_layer.cost.network, 3),
                   0.40, WITHIN))
    out.append(Row("VIII-C2", "whole cluster power (MW)", round(p.design.cost.power_w / 1e6, 2),
                   paper.CLUSTER_POWER_MW, 0.0))
    c = compare_nodes(cat.node("pcie-a100"), cat.node("dgx-a100"))
    out.append(Row("Table II", "relative performance (GEMM)", round(c.relative_performance, 3), 0.83, 0.01))
    out.append(Row("Table II", "node relative price", round(c.price_ratio, 3), 0.60, 0.02))
    out.append(Row("Table II", "cost-performance ratio", round(c.cost_performance, 3), 1.38, 0.02))
    out.append(Row("Table II", "power, PCIe node against DGX", round(c.power_ratio, 3), round(2500 / 4200, 3), 0.0))
    for n in (8, 128, 1024):
        out.append(Row("IV-B", f"ring PCIe units per GPU, n={n}, paper's (2n-1)/n", ring_pcie_units_paper(n),
                       (2 * n - 1) / n, 0.0))
        out.append(Row("IV-B", f"ring PCIe units per GPU, n={n}, standard 2(n-1)/n", ring_pcie_units(n),
                       2 * (n - 1) / n, 0.0))
    out.append(Row("IV-B", "HFReduce PCIe units per GPU", 1.0, 1.0, 0.0))
    m = memory_traffic(8)
    out.append(Row("IV-D3", "HFReduce memory traffic (x data)", m.total, paper.MEMORY_TOTAL, 0.0))
    out.append(Row("IV-D3", "memory ceiling at 320 GB/s (GB/s)", round(m.ceiling_gb_s(320), 2),
                   paper.MEMORY_CEILING_GB_S, 0.005))
    mp = plan(PlanConfig(gpus=32768, node="pcie-nextgen", switch="roce128", planes=4), cat).design
    out.append(Row("IX", "GPUs on 4 planes of two-layer trees of 128-port switches",
                   min(mp.nodes * 8, mp.fabric.planes * topology.two_layer_capacity(128)), 32768, 0.0))
    fig = figure7(cat)
    lo_g, hi_g, lo, hi = paper.FIG7A_NCCL_BAND
    label = {run: shown for shown, run in paper.FIG7_RUN_GPUS.items()}
    for r in fig["HFReduce"]:
        g = label.get(r.gpus, r.gpus)
        if g in paper.FIG7A_HFREDUCE:
            out.append(_row("Fig. 7a", f"HFReduce, {g} GPUs (GB/s)", round(r.algbw_gb_s, 2), paper.FIG7A_HFREDUCE[g]))
    for r in fig["NCCL ring"]:
        g = label.get(r.gpus, r.gpus)
        if lo_g <= g <= hi_g:
            out.append(_row("Fig. 7a", f"NCCL, {g} GPUs (GB/s)", round(r.algbw_gb_s, 2), (lo, hi)))
        elif g in paper.FIG7A_NCCL:
            out.append(_row("Fig. 7a", f"NCCL, {g} GPUs (GB/s)", round(r.algbw_gb_s, 2), paper.FIG7A_NCCL[g]))
    for r in fig["HFReduce with NVLink"]:
        out.append(_row("Fig. 7b", f"HFReduce+NVLink, {r.gpus} GPUs (GB/s)", round(r.algbw_gb_s, 2),
                        paper.FIG7B_IN_ZONE[r.gpus]))
    for r in fig["HFReduce with NVLink, cross-zone"]:
        out.append(_row("Fig. 7b", f"HFReduce+NVLink cross-zone, {r.gpus} GPUs (GB/s)", round(r.algbw_gb_s, 2),
                        paper.FIG7B_CROSS_ZONE[r.gpus]))
    out += training_rows(cat)
    return out


def _row(figure: str, what: str, model: float, want: float | tuple[float, float]) -> Row:
    return Row(figure, what, model, want, WITHIN, WHY.get(what, ""))


def figure8_9(catalog: Catalog | None = None) -> dict[str, dict[int, float]]:
    """The model's step times (seconds) for every series of Figures 8 and 9, by GPU count."""
    cat = catalog or catalog_mod.default()
    net = fire_flyer_network()
    a100, nvl = cat.node("pcie-a100"), cat.node("pcie-a100-nvlink")
    out: dict[str, dict[int, float]] = {}
    for (name, strategy, model, batch, node) in (("HaiScale DDP (HFReduce)", "ddp", VGG16, 50, a100),
                                                  ("Torch DDP (NCCL)", "ddp", VGG16, 50, a100),
                                                  ("HaiScale FSDP", "fsdp", GPT2_MEDIUM, 32, a100),
                                                  ("Torch FSDP", "fsdp", GPT2_MEDIUM, 32, a100)):
        system = "haiscale" if name.startswith("HaiScale") else "torch"
        pts = (paper.FIG8A if strategy == "ddp" else paper.FIG8B)[name]
        out[name] = {g: step_time(Job(model=model, gpus=g, strategy=strategy, system=system, batch_per_gpu=batch),
                                  node, network=net).seconds for g in pts}
    for name, model, pp, batch, pts in (("LLaMA-13B PP=4", LLAMA_13B, 4, 4096, paper.FIG9A),
                                        ("DeepSeekMoE-16B PP=10", DEEPSEEKMOE_16B, 10, 4608, paper.FIG9B)):
        out[name] = {g: step_time(Job(model=model, gpus=g, pp=pp, global_batch=batch), nvl, network=net).seconds
                     for g in pts}
    return out


def training_rows(catalog: Catalog | None = None) -> list[Row]:
    """Figures 8a, 8b, 9a and 9b: step time, model next to paper."""
    papers = {**{k: ("Fig. 8a", v) for k, v in paper.FIG8A.items()},
              **{k: ("Fig. 8b", v) for k, v in paper.FIG8B.items()},
              "LLaMA-13B PP=4": ("Fig. 9a", paper.FIG9A), "DeepSeekMoE-16B PP=10": ("Fig. 9b", paper.FIG9B)}
    out = []
    for name, pts in figure8_9(catalog).items():
        fig, want = papers[name]
        for g, sec in pts.items():
            out.append(_row(fig, f"{name}, {g} GPUs (s)", round(sec, 3), want[g]))
    return out


def within(rs: list[Row], limit: float) -> int:
    """Rows whose model is within ``limit`` (relative) of the paper's value or band."""
    return sum(abs(r.error) <= limit + 1e-9 for r in rs)


def worst(rs: list[Row], n: int = 3) -> list[Row]:
    return sorted(rs, key=lambda r: -abs(r.error))[:n]


def render(rs: list[Row]) -> str:
    w = max(len(r.what) for r in rs)
    lines = [f"{'figure':<9}  {'what':<{w}}  {'model':>9}  {'paper':>11}  {'error':>7}  within"]
    for r in rs:
        pv = f"{r.paper[0]:g}-{r.paper[1]:g}" if isinstance(r.paper, tuple) else f"{r.paper:g}"
        lines.append(f"{r.figure:<9}  {r.what:<{w}}  {r.model:>9g}  {pv:>11}  {r.error:>+7.1%}  "
                     f"{'yes' if r.ok else 'NO'} (+-{r.tolerance:.0%})")
    bad = [r for r in rs if not r.ok]
    lines.append(f"{len(rs) - len(bad)} of {len(rs)} within tolerance; {within(rs, 0.10)} of {len(rs)} within 10%, "
                 f"{within(rs, 0.05)} within 5%")
    lines.append("worst rows:")
    for r in worst(rs):
        lines.append(f"  {r.figure} {r.what}: {r.error:+.1%}; {r.why or 'no reason recorded'}")
    rest = [r for r in bad if r not in worst(rs)]
    if rest:
        lines.append("other rows outside 10%:")
        lines += [f"  {r.figure} {r.what}: {r.error:+.1%}; {r.why or 'no reason recorded'}" for r in rest]
    return "\n".join(lines)
