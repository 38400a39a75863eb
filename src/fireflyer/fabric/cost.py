"""Price and power of a cluster design, and the node comparison of the paper's Table II."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fireflyer.fabric.catalog import Catalog, NodeSpec, SwitchSpec
from fireflyer.fabric.topology import Fabric


@dataclass(frozen=True, kw_only=True)
class Cost:
    """What a design costs (Table III's units) and draws (watts)."""

    nodes: int
    servers: float
    switches: float
    cables: float
    optics: float
    servers_w: float
    switches_w: float
    optics_w: float

    @property
    def network(self) -> float:
        return self.switches + self.cables + self.optics

    @property
    def total(self) -> float:
        return self.servers + self.network

    @property
    def power_w(self) -> float:
        return self.servers_w + self.switches_w + self.optics_w

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(network=self.network, total=self.total, power_w=self.power_w)
        return out


def cost_of(fabric: Fabric, nodes: int, node: NodeSpec, switch: SwitchSpec, catalog: Catalog) -> Cost:
    """Servers, switches (frames as whole chassis, bridges as single boxes), cables and optics."""
    links = catalog.links
    if fabric.frames:
        chip = catalog.chip_of(switch)
        frames = fabric.frames * fabric.planes
        bridges = fabric.bridge * fabric.planes
        sw_price = frames * switch.price + bridges * chip.price
        sw_power = frames * switch.power_w + bridges * chip.power_w
    else:
        sw_price = fabric.switches * switch.price
        sw_power = fabric.switches * switch.power_w
    endpoint_cables = fabric.links_by_kind["endpoint"]
    fibers = fabric.cables - endpoint_cables
    return Cost(
        nodes=nodes,
        servers=nodes * node.price,
        switches=sw_price,
        cables=endpoint_cables * links.endpoint_cable_price + fibers * links.fiber_price,
        optics=fabric.optics * links.optic_price,
        servers_w=nodes * node.power_w,
        switches_w=sw_power,
        optics_w=fabric.optics * links.optic_power_w,
    )


@dataclass(frozen=True, kw_only=True)
class NodeComparison:
    """Table II: one node against another, per GPU."""

    ours: str
    theirs: str
    tf32_ratio: float
    fp16_ratio: float
    price_ratio: float
    power_ratio: float

    @property
    def relative_performance(self) -> float:
        """The mean of the TF32 and FP16 GEMM ratios (Table II rounds both to 83%)."""
        return (self.tf32_ratio + self.fp16_ratio) / 2

    @property
    def cost_performance(self) -> float:
        """Relative performance over relative price (Table II: 1.38)."""
        return self.relative_performance / self.price_ratio

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(relative_performance=self.relative_performance, cost_performance=self.cost_performance)
        return out


def compare_nodes(ours: NodeSpec, theirs: NodeSpec) -> NodeComparison:
    """Per-GPU GEMM throughput, node price and node power of ``ours`` relative to ``theirs``."""
    per_gpu_price = (ours.price / ours.gpus) / (theirs.price / theirs.gpus)
    per_gpu_power = (ours.power_w / ours.gpus) / (theirs.power_w / theirs.gpus)
    return NodeComparison(ours=ours.name, theirs=theirs.name, tf32_ratio=ours.tf32_tflops / theirs.tf32_tflops,
                          fp16_ratio=ours.fp16_tflops / theirs.fp16_tflops, price_ratio=per_gpu_price,
                          power_ratio=per_gpu_power)
