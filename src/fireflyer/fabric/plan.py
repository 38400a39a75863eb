"""``plan``: a cluster of N GPUs, its network, price and power, next to the alternatives the
paper weighs it against (a three-layer fat tree for the same nodes, and DGX-A100 nodes on a
three-layer fat tree), and what an allreduce over all of it would reach."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fireflyer.errors import UserError
from fireflyer.fabric import topology
from fireflyer.fabric.catalog import Catalog, NodeSpec, SwitchSpec
from fireflyer.fabric.collectives import AllreduceResult, MiB, allreduce
from fireflyer.fabric.cost import Cost, NodeComparison, compare_nodes, cost_of
from fireflyer.fabric.routing import Network
from fireflyer.fabric.steptime import Job, StepTime, step_time
from fireflyer.fabric.topology import Fabric


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """What to plan. Names of presets are looked up in the catalogue (None: its default)."""

    gpus: int
    """GPUs in the cluster."""
    node: str | None = None
    switch: str | None = None
    planes: int = 1
    """Independent network planes; each node's NICs are spread over them (section IX)."""
    storage_nodes: int = 0
    """Storage servers with one NIC in every zone (Fire-Flyer shares them between its zones)."""
    alternative_node: str | None = None
    alternative_switch: str | None = None
    core_rounding: str = "pow2"
    allreduce_bytes: int = 186 * MiB
    """Buffer of the whole-cluster allreduce estimate (the paper's Figure 7 size)."""
    job: str | None = None
    """A model preset (or ModelSpec TOML) to train on all the cluster's GPUs, priced on this design
    and on ``baseline_node`` (section IX: the MoE design against today's single-NIC node)."""
    ep: int = -1
    """Expert-parallel ranks of the job (-1: the model's routed experts, spread over nodes; 0: a node's DP ranks)."""
    baseline_node: str = "pcie-a100-nvlink"

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise UserError(f"--gpus must be at least 1, got {self.gpus}")
        if self.planes < 1:
            raise UserError(f"--planes must be at least 1, got {self.planes}")
        if self.storage_nodes < 0:
            raise UserError(f"--storage-nodes must not be negative, got {self.storage_nodes}")
        if self.core_rounding not in topology.CORE_ROUNDING:
            raise UserError(f"core rounding must be one of {', '.join(topology.CORE_ROUNDING)}")
        if self.allreduce_bytes < 1:
            raise UserError("the allreduce size must be at least 1 byte")


@dataclass(frozen=True, kw_only=True)
class Design:
    """One way to build the cluster."""

    title: str
    node: NodeSpec
    switch: SwitchSpec
    nodes: int
    fabric: Fabric
    cost: Cost

    def to_dict(self) -> dict:
        f = self.fabric
        return {
            "title": self.title, "node": self.node.name, "switch": self.switch.name, "nodes": self.nodes,
            "gpus": self.nodes * self.node.gpus, "kind": f.kind, "layers": f.layers, "planes": f.planes,
            "zones": f.zones, "radix": f.radix, "endpoints": f.endpoints * f.planes, "ports": f.ports * f.planes,
            "switches": f.switches, "switches_by_layer": f.switches_by_layer, "frames": f.frames * f.planes,
            "links": f.links_by_kind, "backplane_links": f.backplane_links, "cables": f.cables, "optics": f.optics,
            "notes": list(f.notes), "cost": self.cost.to_dict(),
        }


@dataclass(frozen=True, kw_only=True)
class Plan:
    config: PlanConfig
    design: Design
    three_layer: Design | None
    """The same nodes on a three-layer fat tree of as many ports (only when the design has zones)."""
    dgx: Design | None
    """The alternative node on the smallest fat tree of the alternative switch that fits."""
    nodes_compared: NodeComparison | None
    allreduce: AllreduceResult | None
    extra_gpus: int = 0
    notes: tuple[str, ...] = field(default=())
    job: JobPrice | None = None

    def designs(self) -> list[Design]:
        return [d for d in (self.design, self.three_layer, self.dgx) if d is not None]

    def to_dict(self) -> dict:
        return {
            "gpus": self.config.gpus,
            "gpus_built": self.design.nodes * self.design.node.gpus,
            "design": self.design.to_dict(),
            "three_layer": self.three_layer.to_dict() if self.three_layer else None,
            "alternative": self.dgx.to_dict() if self.dgx else None,
            "nodes_compared": self.nodes_compared.to_dict() if self.nodes_compared else None,
            "allreduce": self.allreduce.to_dict() if self.allreduce else None,
            "job": self.job.to_dict() if self.job else None,
            "notes": list(self.notes),
        }


@dataclass(frozen=True, kw_only=True)
class JobPrice:
    """One training job on this design and on the baseline node's design of as many GPUs."""

    model: str
    gpus: int
    ep: int
    design: StepTime
    baseline: StepTime
    design_price: float
    baseline_price: float

    @property
    def speedup(self) -> float:
        return self.baseline.seconds / self.design.seconds

    @property
    def cost_per_step_ratio(self) -> float:
        """(price x step time) of this design over the baseline's: below 1, each step costs less."""
        return (self.design_price * self.design.seconds) / (self.baseline_price * self.baseline.seconds)

    def to_dict(self) -> dict:
        return {"model": self.model, "gpus": self.gpus, "ep": self.ep, "design": self.design.to_dict(),
                "baseline": self.baseline.to_dict(), "design_price": self.design_price,
                "baseline_price": self.baseline_price, "speedup": self.speedup,
                "cost_per_step_ratio": self.cost_per_step_ratio}


def price_job(config: PlanConfig, design: Design, catalog: Catalog) -> JobPrice:
    """Step time of ``config.job`` on all of ``design``'s GPUs and on the baseline node's Fire-Flyer design.

    Both networks are taken as non-blocking (a two-layer fat tree per plane, the job in one zone);
    what differs is the node: its NICs (the all-to-all and the allreduce), its GPU<->NIC path and its
    root ports. The job's layout is the paper's for the preset (PP, global batch); EP spreads the
    routed experts over nodes unless ``config.ep`` says otherwise.
    """
    from fireflyer.fabric.workloads import TRAIN_PRESETS, model

    spec = model(config.job or "")
    preset = TRAIN_PRESETS.get(spec.name, {"pp": 1, "global_batch": design.nodes * design.node.gpus})
    gpus = design.nodes * design.node.gpus
    ep = config.ep if config.ep >= 0 else (spec.experts if spec.moe else 0)
    job = Job(model=spec, gpus=gpus, pp=preset["pp"], global_batch=preset["global_batch"], ep=ep)
    base_node = catalog.node(config.baseline_node)
    base = build_design(gpus, base_node, catalog.switch(catalog.defaults.switch), catalog)
    return JobPrice(model=spec.name, gpus=gpus, ep=ep, design=step_time(job, design.node),
                    baseline=step_time(job, base_node), design_price=design.cost.total, baseline_price=base.cost.total)


def _smallest_tree(endpoints: int, switch: SwitchSpec, core_rounding: str) -> Fabric:
    if endpoints <= topology.two_layer_capacity(switch.radix):
        return topology.two_layer(endpoints, switch.radix, link_gb_s=switch.link_gb_s)
    return topology.three_layer(endpoints, switch.radix, core_rounding=core_rounding, link_gb_s=switch.link_gb_s)


def build_design(gpus: int, node: NodeSpec, switch: SwitchSpec, catalog: Catalog, *, planes: int = 1,
                 storage_nodes: int = 0) -> Design:
    """Fire-Flyer's way: per plane one two-layer fat tree if it fits, else zones of them."""
    if planes > node.nics:
        raise UserError(f"node {node.name!r} has {node.nics} compute NIC(s); it cannot reach {planes} planes")
    if node.nics % planes:
        raise UserError(f"node {node.name!r} has {node.nics} NICs, which do not split evenly over {planes} planes")
    nodes = math.ceil(gpus / node.gpus)
    per_plane = nodes * node.nics // planes
    d = catalog.defaults
    fabric = topology.design(per_plane, switch.radix, frames=switch.is_frame, storage_endpoints=storage_nodes,
                             bridge_switches=d.bridge_switches, bridge_links=d.bridge_links,
                             link_gb_s=switch.link_gb_s)
    fabric = topology.planes_of(fabric, planes)
    title = "this design"
    return Design(title=title, node=node, switch=switch, nodes=nodes, fabric=fabric,
                  cost=cost_of(fabric, nodes, node, switch, catalog))


def plan(config: PlanConfig, catalog: Catalog) -> Plan:
    """Plan ``config.gpus`` GPUs and the alternatives; estimate a whole-cluster HFReduce allreduce."""
    d = catalog.defaults
    node = catalog.node(config.node or d.node)
    switch = catalog.switch(config.switch or d.switch)
    alt_node = catalog.node(config.alternative_node or d.alternative_node)
    alt_switch = catalog.switch(config.alternative_switch or d.alternative_switch)
    if alt_switch.is_frame:
        alt_switch = catalog.chip_of(alt_switch)
    design = build_design(config.gpus, node, switch, catalog, planes=config.planes,
                          storage_nodes=config.storage_nodes)
    f = design.fabric
    notes: list[str] = []
    three = None
    if f.zones > 1 and f.layers == 2:
        ports = f.zones * topology.two_layer_capacity(f.radix)
        chip = catalog.chip_of(switch)
        tl = topology.planes_of(topology.three_layer(ports, f.radix, core_rounding=config.core_rounding,
                                                     link_gb_s=chip.link_gb_s), f.planes)
        three = Design(title="three-layer", node=node, switch=chip, nodes=design.nodes, fabric=tl,
                       cost=cost_of(tl, design.nodes, node, chip, catalog))
    dgx = None
    if alt_node.name != node.name:
        alt_nodes = math.ceil(config.gpus / alt_node.gpus)
        try:
            try:
                af = _smallest_tree(alt_nodes * alt_node.nics, alt_switch, config.core_rounding)
            except UserError:
                chip = catalog.chip_of(switch)
                if chip.radix <= alt_switch.radix:
                    raise
                alt_switch = chip  # too big for the alternative's switch: build it of ours
                af = _smallest_tree(alt_nodes * alt_node.nics, alt_switch, config.core_rounding)
            dgx = Design(title=alt_node.name, node=alt_node, switch=alt_switch, nodes=alt_nodes, fabric=af,
                         cost=cost_of(af, alt_nodes, alt_node, alt_switch, catalog))
        except UserError as exc:
            notes.append(f"no {alt_node.name} alternative: {exc}")
    compared = compare_nodes(node, alt_node) if alt_node.name != node.name else None
    result = None
    if design.nodes > 1:
        net = Network(f, nics_per_node_per_plane=node.nics // config.planes,
                      nodes_per_zone=math.ceil(design.nodes / f.zones))
        algo = "hfreduce-nvlink" if node.nvlink != "none" else "hfreduce"
        gpus = design.nodes * node.gpus
        result = allreduce(algo, gpus, config.allreduce_bytes, node, network=net,
                           placement=net.place(design.nodes, "packed"))
    if f.frames and f.endpoints < f.frames * topology.two_layer_capacity(f.radix) // 2:
        notes.append(f"most of the {switch.name} frames' ports are unused; --switch {catalog.chip_of(switch).name} "
                     f"builds only the leaves needed")
    extra = design.nodes * node.gpus - config.gpus
    if extra:
        notes.append(f"{config.gpus} GPUs round up to {design.nodes} nodes ({extra} more GPUs)")
    job = price_job(config, design, catalog) if config.job else None
    return Plan(config=config, design=design, three_layer=three, dgx=dgx, nodes_compared=compared,
                allreduce=result, extra_gpus=extra, notes=tuple(notes), job=job)


# -- text ------------------------------------------------------------------------------------

def _n(x: float) -> str:
    if isinstance(x, float) and not x.is_integer():
        return f"{x:,.1f}"
    return f"{int(x):,}"


def render(p: Plan) -> str:
    """The plan as the tables ``fireflyer plan`` prints."""
    d = p.design
    f = d.fabric
    node = d.node
    lines = [
        (f"{p.config.gpus:,} GPUs on {d.nodes:,} {node.name} nodes "
         f"({node.gpus} GPUs, {node.nics}x {node.nic_gbps:g}G NIC each)"),
        f"network: {f.kind} of {d.switch.name} ({f.radix}-port, {d.switch.gbps:g}G)"
        + (f"; {f.notes[0]}" if f.notes else ""),
        "",
    ]
    designs = p.designs()
    heads = ["", "this design"] + [f"{x.node.name} {x.fabric.layers}-layer" if x is p.dgx else "PCIe 3-layer"
                                    for x in designs[1:]]
    rows: list[list[str]] = []

    def row(label: str, values: list[object]) -> None:
        rows.append([label, *[("-" if v is None else _n(v) if isinstance(v, (int, float)) else str(v))
                              for v in values]])

    row("GPUs", [x.nodes * x.node.gpus for x in designs])
    row("nodes", [x.nodes for x in designs])
    row("switches", [x.fabric.switches for x in designs])
    for layer in ("core", "spine", "leaf", "bridge"):
        vals = [x.fabric.switches_by_layer.get(layer) for x in designs]
        if any(vals):
            row(f"  {layer}", vals)
    if any(x.fabric.frames for x in designs):
        row("  in frames", [x.fabric.frames * x.fabric.planes or None for x in designs])
    row("endpoint ports", [x.fabric.ports * x.fabric.planes for x in designs])
    row("links", [sum(x.fabric.links_by_kind.values()) for x in designs])
    row("  on backplane", [x.fabric.backplane_links or None for x in designs])
    row("cables", [x.fabric.cables for x in designs])
    row("optics", [x.fabric.optics for x in designs])
    row("network price", [round(x.cost.network) for x in designs])
    row("server price", [round(x.cost.servers) for x in designs])
    row("total price", [round(x.cost.total) for x in designs])
    row("power (kW)", [round(x.cost.power_w / 1000) for x in designs])
    lines += _table(heads, rows)
    if p.dgx is not None:
        base = p.dgx.cost
        lines += ["", (f"against {p.dgx.node.name}: total price {d.cost.total / base.total:.0%}, "
                       f"network price {d.cost.network / base.network:.0%}, "
                       f"power {d.cost.power_w / base.power_w:.0%}")]
    if p.three_layer is not None:
        lines.append(f"network saving against the PCIe three-layer fat tree: "
                     f"{1 - d.cost.network / p.three_layer.cost.network:.0%}")
    c = p.nodes_compared
    if c is not None:
        lines += ["", (f"per GPU, {c.ours} against {c.theirs}: GEMM TF32 {c.tf32_ratio:.0%}, "
                       f"FP16 {c.fp16_ratio:.0%} (relative performance {c.relative_performance:.0%}), "
                       f"price {c.price_ratio:.0%}, cost-performance {c.cost_performance:.2f}, "
                       f"power {c.power_ratio:.0%}")]
    r = p.allreduce
    if r is not None:
        lines += ["", (f"{r.algo} allreduce of {r.size_bytes / MiB:g} MiB over all {r.gpus:,} GPUs "
                       f"(tree depth {r.tree_depth}): {r.seconds * 1000:.1f} ms, algbw {r.algbw_gb_s:.2f} GB/s, "
                       f"busbw {r.busbw_gb_s:.2f} GB/s; bottleneck: {r.bottleneck}")]
    jp = p.job
    if jp is not None:
        lines += ["", (f"{jp.model} on all {jp.gpus:,} GPUs (ep={jp.ep}): {jp.design.seconds:.3g} s a step on "
                       f"{node.name} against {jp.baseline.seconds:.3g} s on {p.config.baseline_node} "
                       f"({jp.speedup:.2f}x); total price {jp.design_price:,.0f} against {jp.baseline_price:,.0f}; "
                       f"price x step time {jp.cost_per_step_ratio:.0%} of the baseline's")]
        for label, st in (("this design", jp.design), (p.config.baseline_node, jp.baseline)):
            lines.append(f"  {label}: compute {st.compute:.3g} s, " + ", ".join(
                f"{k} {v:.3g} s" for k, v in st.parts.items() if v > 0))
    for note in p.notes:
        lines.append(f"note: {note}")
    lines.append("prices in Table III units (one PCIe A100 node = 9); override with --catalog FILE")
    return "\n".join(lines)


def _table(heads: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [heads, *rows]) for i in range(len(heads))]
    out = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(heads, widths)))]
    for r in rows:
        out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return out
