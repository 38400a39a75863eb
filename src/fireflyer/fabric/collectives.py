"""An analytic allreduce model: ring, double binary tree, HFReduce and HFReduce with NVLink,
on the node model of the catalogue and the network of the planner.

How a time is made (the same for every GPU count; nothing is fitted per point):

* **Steady rate.** Each algorithm puts a known load on every resource per unit of data
  (bytes moved per byte of one GPU's buffer): each GPU's PCIe link (per direction), a
  root port shared by several GPUs (both directions together), host memory (HFReduce's
  24x, :mod:`fireflyer.fabric.traffic`), the NIC, the GPU<->NIC peer-to-peer path
  (NCCL's GPUDirect RDMA), NVLink, and every network link under static routing
  (:mod:`fireflyer.fabric.routing`). The steady rate (algbw) is the smallest
  ``capacity / load``: the bottleneck.
* **Pipelines.** HFReduce and the tree move the buffer in chunks through a pipeline of
  ``h`` stages (copy to host, reduce, one hop per tree level up and down, copy back), so
  ``time = (chunks + h - 1) * chunk / rate``: deeper trees pay more filling and draining.
* **Ring.** ``time = 2(n-1)/n * size / edge_rate + 2(n-1) * step_latency``.

Rates are algbw (the buffer's bytes over the time), which is what the paper's 13.3 GB/s
memory ceiling and 12.5 GB/s network ceiling are written in; busbw is algbw x 2(n-1)/n.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from fireflyer.errors import UserError
from fireflyer.fabric.catalog import NodeSpec
from fireflyer.fabric.routing import Network, Placement
from fireflyer.fabric.traffic import memory_traffic
from fireflyer.fabric.trees import (
    DoubleBinaryTree,
    double_binary_tree,
    zoned_double_binary_tree,
)

MiB = 1 << 20
ALGOS = ("ring", "tree", "hfreduce", "hfreduce-nvlink")
ALGO_TITLES = {
    "ring": "NCCL ring",
    "tree": "NCCL double binary tree",
    "hfreduce": "HFReduce",
    "hfreduce-nvlink": "HFReduce with NVLink",
}


@dataclass(frozen=True, kw_only=True)
class ModelParams:
    """The model's own few parameters (the node's are in the catalogue). None is from the paper,
    which gives no chunk size or latency; these are round values, the same at every scale (the
    chunk is read off Figure 7)."""

    chunk_bytes: int = 5 * MiB
    """HFReduce's pipeline chunk. The paper gives none; read off Figure 7, the one figure that shows
    what each level of the tree costs (HFReduce from 16 to 1,280 GPUs, with NVLink from 128 to
    1,024): 5 MiB puts 11 of its 15 HFReduce points within 10% (4 MiB: 8; 6 MiB: 9)."""
    nccl_chunk_bytes: int = 1 * MiB
    """NCCL tree's pipeline chunk."""
    ring_step_latency_s: float = 10e-6
    """One step of NCCL's ring over the network (a synchronised send and receive)."""
    hop_latency_s: float = 2e-6
    """One network hop of a tree (RDMA write and completion)."""
    h2d: str = "gdrcopy"
    """HFReduce's copy back to the GPUs: "gdrcopy" (reads host memory once per NUMA node) or "memcpy"."""

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1 or self.nccl_chunk_bytes < 1:
            raise UserError("chunk sizes must be at least 1 byte")
        if self.ring_step_latency_s < 0 or self.hop_latency_s < 0:
            raise UserError("latencies must not be negative")
        if self.h2d not in ("gdrcopy", "memcpy"):
            raise UserError(f"h2d must be 'gdrcopy' or 'memcpy', got {self.h2d!r}")


@dataclass(frozen=True, kw_only=True)
class AllreduceResult:
    algo: str
    gpus: int
    nodes: int
    size_bytes: int
    seconds: float
    algbw_gb_s: float
    busbw_gb_s: float
    steady_gb_s: float
    """The bottleneck rate, before pipeline fill and latency."""
    bottleneck: str
    caps: dict[str, float] = field(default_factory=dict)
    """Every resource's rate limit (algbw, GB/s)."""
    tree_depth: int = 0
    cross_zone_flows: int = 0
    max_bridge_load: float = 0.0

    def to_dict(self) -> dict:
        return {
            "algo": self.algo, "gpus": self.gpus, "nodes": self.nodes, "size_bytes": self.size_bytes,
            "seconds": self.seconds, "algbw_gb_s": self.algbw_gb_s, "busbw_gb_s": self.busbw_gb_s,
            "steady_gb_s": self.steady_gb_s, "bottleneck": self.bottleneck,
            "caps": {k: round(v, 4) for k, v in self.caps.items()}, "tree_depth": self.tree_depth,
            "cross_zone_flows": self.cross_zone_flows, "max_bridge_load": self.max_bridge_load,
        }


def busbw_factor(gpus: int) -> float:
    """nccl-tests' allreduce bus-bandwidth factor 2(n-1)/n."""
    return 2.0 * (gpus - 1) / gpus


# -- node-side loads -------------------------------------------------------------------------

class _Loads:
    """Per-node resource loads (units per unit of data) and their capacities."""

    def __init__(self, node: NodeSpec) -> None:
        self.node = node
        self.pcie_out = np.zeros(node.gpus)
        self.pcie_in = np.zeros(node.gpus)
        self.nvlink = 0.0  # the busiest NVLink, per direction
        self.p2p = 0.0     # each GPU<->NIC path, per direction
        self.nic = 0.0     # each NIC, per direction
        self.memory = 0.0

    def caps(self) -> dict[str, float]:
        n = self.node
        out: dict[str, float] = {}
        per_gpu = float(max(self.pcie_out.max(), self.pcie_in.max()))
        if per_gpu > 0:
            out["GPU PCIe link"] = n.pcie_gb_s / per_gpu
        for group in n.shared_root_ports:
            load = float(sum(self.pcie_out[g] + self.pcie_in[g] for g in group))
            if load > 0:
                name = "shared root port (GPU" + "/".join(str(g) for g in group) + ")"
                out[name] = n.root_port_gb_s / load
        if self.nvlink > 0:
            out["NVLink"] = n.nvlink_gb_s / self.nvlink
        if self.p2p > 0:
            out["GPU<->NIC P2P"] = n.gpu_nic_p2p_gb_s / self.p2p
        if self.nic > 0:
            out["NIC"] = n.nic_gb_s / self.nic
        if self.memory > 0:
            out["host memory"] = n.memory_gb_s / self.memory
        return out


def _linked(node: NodeSpec, a: int, b: int) -> bool:
    if node.nvlink == "nvswitch":
        return True
    return node.nvlink == "pairs" and (a ^ 1) == b


# -- the model -------------------------------------------------------------------------------

def allreduce(algo: str, gpus: int, size_bytes: int, node: NodeSpec, *, network: Network | None = None,
              placement: Placement | None = None, params: ModelParams | None = None,
              extra_caps: dict[str, float] | None = None) -> AllreduceResult:
    """Model one allreduce of ``size_bytes`` per GPU over ``gpus`` GPUs of ``node``s.

    ``network`` (with ``placement``, or a packed one) adds the links' loads under static
    routing; without it the network is taken as non-blocking. ``extra_caps`` adds rate
    limits found elsewhere (the links' share when several jobs run at once).
    """
    params = params or ModelParams()
    if algo not in ALGOS:
        raise UserError(f"unknown algorithm {algo!r}; choose from: {', '.join(ALGOS)}")
    if gpus < 2:
        raise UserError(f"an allreduce needs at least 2 GPUs, got {gpus}")
    if size_bytes < 1:
        raise UserError(f"size must be at least 1 byte, got {size_bytes}")
    g = node.gpus
    if gpus > g and gpus % g:
        raise UserError(f"{gpus} GPUs is not a whole number of {g}-GPU nodes")
    if algo == "hfreduce-nvlink" and node.nvlink == "none":
        raise UserError(f"hfreduce-nvlink needs a node with NVLink; {node.name!r} has none "
                        f"(try --node pcie-a100-nvlink)")
    nodes = max(1, gpus // g)
    local = min(gpus, g)
    if network is not None and placement is None and nodes > 1:
        placement = network.place(nodes)
    extra = dict(extra_caps or {})
    if algo == "ring":
        return _ring(gpus, nodes, local, size_bytes, node, network, placement, params, extra)
    return _tree_based(algo, gpus, nodes, local, size_bytes, node, network, placement, params, extra)


def _network_cap(network: Network | None, placement: Placement | None, src: np.ndarray, dst: np.ndarray,
                 demand: np.ndarray) -> tuple[float, int, float]:
    if network is None or placement is None or len(src) == 0:
        return math.inf, 0, 0.0
    ll = network.route(placement, src, dst, demand)
    cap = network.link_gb_s / ll.max_load if ll.max_load > 0 else math.inf
    return cap, ll.cross_flows, ll.max_bridge_load


def _finish(algo: str, gpus: int, nodes: int, size: int, seconds: float, caps: dict[str, float], **extra) -> AllreduceResult:
    name, steady = min(caps.items(), key=lambda kv: kv[1])
    algbw = size / seconds / 1e9
    return AllreduceResult(algo=algo, gpus=gpus, nodes=nodes, size_bytes=size, seconds=seconds, algbw_gb_s=algbw,
                           busbw_gb_s=algbw * busbw_factor(gpus), steady_gb_s=steady, bottleneck=name, caps=caps,
                           **extra)


def _ring(gpus: int, nodes: int, local: int, size: int, node: NodeSpec, network: Network | None,
          placement: Placement | None, params: ModelParams, extra: dict[str, float]) -> AllreduceResult:
    """NCCL's ring: one ring per NIC, each node's GPUs in a row, the ring leaving through a NIC."""
    loads = _Loads(node)
    rings = node.nics if nodes > 1 else 1
    share = 1.0 / rings
    for r in range(rings):
        offset = (r * local) // rings
        order = [(offset + i) % local for i in range(local)]
        hops = list(itertools.pairwise(order)) + ([] if nodes > 1 else [(order[-1], order[0])])
        for a, b in hops:
            if _linked(node, a, b):
                loads.nvlink = max(loads.nvlink, share)
            else:
                loads.pcie_out[a] += share
                loads.pcie_in[b] += share
        if nodes > 1:
            loads.pcie_out[order[-1]] += share
            loads.pcie_in[order[0]] += share
            loads.p2p = max(loads.p2p, share)
            loads.nic = max(loads.nic, share)
    u = busbw_factor(gpus)  # units on every ring edge per unit of data
    caps = {k: v / u for k, v in loads.caps().items()}
    cross, bridge = 0, 0.0
    if nodes > 1:
        src = np.arange(nodes)
        net_cap, cross, bridge = _network_cap(network, placement, src, (src + 1) % nodes,
                                              np.full(nodes, u / node.nics))
        if net_cap < math.inf:
            caps["network links"] = net_cap
    caps.update(extra)
    steady = min(caps.values())
    seconds = size / (steady * 1e9) + 2 * (gpus - 1) * (params.ring_step_latency_s if nodes > 1 else 0.0)
    return _finish("ring", gpus, nodes, size, seconds, caps, cross_zone_flows=cross, max_bridge_load=bridge)


def tree_for(nodes: int, placement: Placement | None) -> DoubleBinaryTree:
    """The double binary tree a job uses: zone-aware (one crossing pair) unless placed naively."""
    if placement is not None and not placement.zone_aware:
        return double_binary_tree(nodes)
    zone = placement.zone if placement is not None else np.zeros(nodes, dtype=np.int64)
    return zoned_double_binary_tree(zone)


def flows(algo: str, nodes: int, node: NodeSpec, placement: Placement | None = None,
          gpus: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src rank, dst rank, units per unit of data per NIC) of the flows between nodes."""
    if nodes < 2:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0)
    if algo == "ring":
        src = np.arange(nodes)
        u = busbw_factor(gpus or nodes * node.gpus)
        return src, (src + 1) % nodes, np.full(nodes, u / node.nics)
    src, dst, demand = _tree_flows(tree_for(nodes, placement))
    return src, dst, demand / node.nics


def _tree_flows(tree: DoubleBinaryTree) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    e = tree.edges()
    child, parent = e[:, 0], e[:, 1]
    src = np.concatenate([child, parent])
    dst = np.concatenate([parent, child])
    return src, dst, np.full(len(src), 0.5)


def _tree_based(algo: str, gpus: int, nodes: int, local: int, size: int, node: NodeSpec,
                network: Network | None, placement: Placement | None, params: ModelParams,
                extra: dict[str, float]) -> AllreduceResult:
    tree = tree_for(nodes, placement)
    units = tree.node_units()
    sends = float(units["sends"].max())
    recvs = float(units["recvs"].max())
    adds = float(units["adds"].max())
    loads = _Loads(node)
    if algo == "tree":
        # NCCL: a chain through the node's GPUs, reduce up and broadcast down, the last GPU on the NIC
        for a, b in zip(range(local - 1), range(1, local)):
            if _linked(node, a, b):
                loads.nvlink = max(loads.nvlink, 1.0)
            else:
                loads.pcie_out[a] += 1.0
                loads.pcie_in[b] += 1.0
                loads.pcie_out[b] += 1.0
                loads.pcie_in[a] += 1.0
        if nodes > 1:
            head = local - 1
            loads.pcie_out[head] += sends
            loads.pcie_in[head] += recvs
            loads.p2p = max(sends, recvs) / node.nics
            loads.nic = max(sends, recvs) / node.nics
        stages = 2 * (local - 1)
        chunk = params.nccl_chunk_bytes
    else:
        nvlink = algo == "hfreduce-nvlink"
        copy = 0.5 if nvlink else 1.0
        loads.pcie_out[:local] += copy
        loads.pcie_in[:local] += copy
        if nvlink:
            loads.nvlink = 1.0  # reduce-scatter half to the partner, then allgather half back
        mem = memory_traffic(local, h2d=params.h2d, numa_nodes=node.numa_nodes, nvlink=nvlink,
                             sends=sends, recvs=recvs, adds=adds)
        loads.memory = mem.total
        if nodes > 1:
            loads.nic = max(sends, recvs) / node.nics
        stages = 5 if nvlink else 3  # (NVLink reduce,) D2H, reduce, H2D (, NVLink gather)
        chunk = params.chunk_bytes
    caps = loads.caps()
    cross, bridge = 0, 0.0
    if nodes > 1:
        src, dst, demand = _tree_flows(tree)
        net_cap, cross, bridge = _network_cap(network, placement, src, dst, demand / node.nics)
        if net_cap < math.inf:
            caps["network links"] = net_cap
    caps.update(extra)
    steady = min(caps.values())
    chunks = math.ceil(size / chunk)
    h = stages + 2 * tree.depth
    step = min(chunk, size) / (steady * 1e9)
    seconds = (chunks + h - 1) * step + 2 * tree.depth * params.hop_latency_s
    return _finish(algo, gpus, nodes, size, seconds, caps, tree_depth=tree.depth, cross_zone_flows=cross,
                   max_bridge_load=bridge)


def sweep(algos: list[str], gpu_counts: list[int], size_bytes: int, node: NodeSpec, *,
          network: Network | None = None, placement_policy: str = "packed", params: ModelParams | None = None,
          seed: int = 0) -> list[AllreduceResult]:
    """:func:`allreduce` for every algorithm and GPU count, each job placed by ``placement_policy``."""
    out = []
    for gpus in gpu_counts:
        nodes = max(1, gpus // node.gpus)
        placement = None
        if network is not None and nodes > 1:
            placement = network.place(nodes, placement_policy, seed=seed)
        for algo in algos:
            out.append(allreduce(algo, gpus, size_bytes, node, network=network, placement=placement, params=params))
    return out
