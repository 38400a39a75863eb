"""Traffic accounting per unit of data (one GPU's buffer): PCIe per GPU (paper IV-B) and host
memory per node (paper IV-D3). Pure arithmetic; the collective model builds on it."""

from __future__ import annotations

from dataclasses import dataclass

from fireflyer.errors import UserError


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
