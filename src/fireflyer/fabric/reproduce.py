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
from fireflyer.fabric.traffic import (
    memory_traffic,
    ring_pcie_units,
    ring_pcie_units_paper,
)

FIG7A_GPUS = [16, 32, 64, 128, 256, 512, 1024, 1440]
FIG7B_GPUS = [16, 32, 64, 128, 256, 512, 1024]


@dataclass(frozen=True)
class Row:
    figure: str
    what: str
    model: float
    paper: float | tuple[float, float]
    tolerance: float
    """Relative tolerance the tests hold the model to (0: exact)."""

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
                "error": self.error, "tolerance": self.tolerance, "ok": self.ok}


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
                   0.40, 0.125))
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
    for r in fig["HFReduce"]:
        if r.gpus in paper.FIG7A_HFREDUCE:
            out.append(Row("Fig. 7a", f"HFReduce, {r.gpus} GPUs (GB/s)", round(r.algbw_gb_s, 2),
                           paper.FIG7A_HFREDUCE[r.gpus], 0.20))
    for r in fig["NCCL ring"]:
        if lo_g <= r.gpus <= hi_g:
            out.append(Row("Fig. 7a", f"NCCL, {r.gpus} GPUs (GB/s)", round(r.algbw_gb_s, 2), (lo, hi), 0.20))
        elif r.gpus in paper.FIG7A_NCCL:
            out.append(Row("Fig. 7a", f"NCCL, {r.gpus} GPUs (GB/s)", round(r.algbw_gb_s, 2),
                           paper.FIG7A_NCCL[r.gpus], 0.20))
    for r in fig["HFReduce with NVLink"]:
        out.append(Row("Fig. 7b", f"HFReduce+NVLink, {r.gpus} GPUs (GB/s)", round(r.algbw_gb_s, 2),
                       paper.FIG7B_IN_ZONE[r.gpus], 0.20))
    for r in fig["HFReduce with NVLink, cross-zone"]:
        out.append(Row("Fig. 7b", f"HFReduce+NVLink cross-zone, {r.gpus} GPUs (GB/s)", round(r.algbw_gb_s, 2),
                       paper.FIG7B_CROSS_ZONE[r.gpus], 0.20))
    return out


def render(rs: list[Row]) -> str:
    w = max(len(r.what) for r in rs)
    lines = [f"{'figure':<9}  {'what':<{w}}  {'model':>9}  {'paper':>11}  {'error':>7}  within"]
    for r in rs:
        pv = f"{r.paper[0]:g}-{r.paper[1]:g}" if isinstance(r.paper, tuple) else f"{r.paper:g}"
        lines.append(f"{r.figure:<9}  {r.what:<{w}}  {r.model:>9g}  {pv:>11}  {r.error:>+7.1%}  "
                     f"{'yes' if r.ok else 'NO'} (+-{r.tolerance:.0%})")
    bad = [r for r in rs if not r.ok]
    lines.append(f"{len(rs) - len(bad)} of {len(rs)} within tolerance"
                 + (f"; not reproduced: {', '.join(r.what for r in bad)}" if bad else ""))
    return "\n".join(lines)
