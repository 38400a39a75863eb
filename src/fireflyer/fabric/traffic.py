"""Traffic accounting: the one model of what an HFReduce allreduce moves.

Per unit of data (one GPU's buffer), as the paper counts it: PCIe per GPU (IV-B) and host
memory per node (IV-D3, the 24x); the collective model builds on these. In bytes, as
hfreduce's engine runs it on this machine's CPU tensors (:func:`engine_path`,
:func:`engine_traffic`): the roofline the allreduce benchmark prints beside each time.
Pure arithmetic (numpy at most, never torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from fireflyer.errors import UserError
from fireflyer.fabric.trees import double_binary_tree


def ring_pcie_units_paper(n: int) -> float:
    """PCIe bidirectional units per GPU for a ring allreduce, as the paper writes it: (2n-1)/n."""
    _check_n(n)
    return (2 * n - 1) / n


def ring_pcie_units(n: int) -> float:
    """The standard ring allreduce: each GPU sends (and receives) 2(n-1)/n units."""
    _check_n(n)
    return 2 * (n - 1) / n


def hfreduce_pcie_units(nvlink: bool = False) -> float:
    """HFReduce: one D2H and one H2D per unit, one unit of bidirectional PCIe per GPU.
    With NVLink pairs each GPU copies half (the pair reduces and gathers over NVLink)."""
    return 0.5 if nvlink else 1.0


def _check_n(n: int) -> None:
    if n < 1:
        raise UserError(f"GPU count must be at least 1, got {n}")


@dataclass(frozen=True, kw_only=True)
class MemoryTraffic:
    """Host memory reads and writes per node, in units of one GPU's data (paper IV-D3)."""

    d2h_writes: float
    reduce_reads: float
    reduce_writes: float
    net_send_reads: float
    net_recv_writes: float
    net_add_reads: float
    h2d_reads: float

    @property
    def phases(self) -> dict[str, float]:
        return {
            "D2H": self.d2h_writes,
            "intra-node reduce": self.reduce_reads + self.reduce_writes,
            "inter-node allreduce": self.net_send_reads + self.net_recv_writes + self.net_add_reads,
            "H2D": self.h2d_reads,
        }

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def ceiling_gb_s(self, memory_gb_s: float) -> float:
        """The allreduce rate (algbw) host memory allows: memory bandwidth / total."""
        return memory_gb_s / self.total


def memory_traffic(gpus: int = 8, *, h2d: str = "gdrcopy", numa_nodes: int = 2, nvlink: bool = False,
                   sends: float = 2.0, recvs: float = 2.0, adds: float = 1.0) -> MemoryTraffic:
    """HFReduce's host memory traffic per node.

    D2H writes each GPU's data (half of it with NVLink pairs, which reduce first); the
    intra-node reduce reads those and writes one result; the inter-node tree reads what the
    NIC sends, writes what it receives and reads again to add children's data (a double
    binary tree: 2, 2 and 1); H2D reads the result once per NUMA node with GDRCopy (which
    then writes the node's GPUs from cache) or once per GPU with cudaMemcpy. The paper's
    defaults give 8 + 9 + 5 + 2 = 24.
    """
    if gpus < 1 or numa_nodes < 1:
        raise UserError("gpus and numa_nodes must be at least 1")
    if h2d not in ("gdrcopy", "memcpy"):
        raise UserError(f"h2d must be 'gdrcopy' or 'memcpy', got {h2d!r}")
    copies = gpus / 2 if nvlink else gpus
    if h2d == "gdrcopy":
        h2d_reads = float(min(numa_nodes, gpus))
    else:
        h2d_reads = float(copies)
    return MemoryTraffic(d2h_writes=copies, reduce_reads=copies, reduce_writes=1.0, net_send_reads=sends,
                         net_recv_writes=recvs, net_add_reads=adds, h2d_reads=h2d_reads)


# -- the engine's allreduce of CPU tensors, in bytes ---------------------------------------

ONE_SHOT = "one-shot"
PIPELINE = "pipeline"
TREES = "pipeline+trees"
"""The paths hfreduce's engine takes: one shot, the chunked pipeline, the pipeline into the trees."""


def engine_path(nbytes: int, num_nodes: int, *, oneshot_bytes: int, chunk_bytes: int) -> str:
    """The path an allreduce of ``nbytes`` per rank (contiguous CPU tensors) takes.

    One node: one shot up to ``oneshot_bytes`` (and within one chunk of ``chunk_bytes``),
    else the pipeline. Several nodes: the pipeline into the trees, whatever the size.
    """
    if num_nodes > 1:
        return TREES
    return ONE_SHOT if nbytes <= min(oneshot_bytes, chunk_bytes) else PIPELINE


def engine_traffic(nbytes: int, local_size: int, num_nodes: int, itemsize: int = 4, *,
                   path: str | None = None) -> dict[str, float]:
    """Bytes one node moves for an allreduce of ``nbytes`` per rank (CPU tensors), for the roofline.

    ``mem_bytes`` counts reads plus writes through memory, as the engine does them on ``path``
    (default: the pipeline, with the trees when ``num_nodes`` > 1):

    - one shot: every rank copies all of its input into its slot (read + write), then reads
      all L inputs (its own in place) and writes its result: 2LS + L(L+1)S;
    - stage-in: every rank copies all but its own slice into the arena (read + write);
    - reduce: every rank reads its slice from all L inputs and writes one result (in
      the accumulation dtype when the partial sum goes on to the trees);
    - trees (several nodes, the double binary tree of :mod:`fireflyer.fabric.trees`): each
      byte sent or received over a socket is copied once between user and kernel memory
      (read + write); every message from a child is combined (read two, write one); the
      root rounds its half into the result (a plain fp32 sum writes its last combine
      straight into the result instead);
    - stage-out: every rank copies the whole result into its tensor (read + write).

    ``floor_mem_bytes``: each rank's input read once and its output written once.
    ``link_bytes``: what the busiest node sends per direction on its NIC.
    """
    L, S, N = local_size, float(nbytes), num_nodes
    floor = 2.0 * L * S
    if path == ONE_SHOT:
        if N > 1:
            raise UserError("the one-shot path runs on one node only")
        return {"mem_bytes": 2 * L * S + L * (L + 1) * S, "floor_mem_bytes": floor, "link_bytes": 0.0}
    a = 4.0 / itemsize if itemsize < 4 else 1.0  # accumulation bytes per data byte
    stage_in = 2 * (L - 1) * S
    stage_out = 2 * L * S
    reduce = L * S + (a * S if N > 1 else S)
    tree_mem, link = 0.0, 0.0
    if N > 1:
        parents = double_binary_tree(N).parents
        kids_of = [[int((par == node).sum()) for node in range(N)] for par in parents]
        per_node = []
        for node in range(N):
            sent = received = combine = 0.0
            for t in (0, 1):
                kids = kids_of[t][node]
                half = S / 2
                if parents[t][node] < 0:  # the root
                    if not (a == 1.0 and kids):
                        combine += 2 * half  # round the finished half (read acc, write result)
                else:
                    sent += a * half
                    received += half
                received += kids * a * half
                sent += kids * half
                combine += kids * 3 * a * half
            per_node.append((sent, 2 * (sent + received) + combine))
        link = max(sent for sent, _ in per_node)
        tree_mem = sum(mem for _, mem in per_node) / N
    mem = stage_in + reduce + tree_mem + stage_out
    return {"mem_bytes": mem, "floor_mem_bytes": floor, "link_bytes": link}
