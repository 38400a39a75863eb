"""The parts catalogue: node, switch and link presets with their price, power and the
physical numbers the collective model uses.

The defaults ship as ``catalog.toml`` next to this module (package data). A user file
with the same layout is merged over them field by field (``--catalog FILE``), so any
number can be replaced by a real quote. Prices are in Table III's units (one PCIe A100
node = 9); see the TOML file for where each default comes from.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from fireflyer.errors import UserError

NVLINK_KINDS = ("none", "pairs", "nvswitch")


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """A GPU server: what it holds, what it costs, and the bandwidths that bound its collectives."""

    name: str
    description: str = ""
    gpus: int
    """GPUs per node."""
    nics: int
    """NICs on the compute fabric (a multi-plane network spreads them over the planes)."""
    storage_nics: int = 0
    """NICs on a separate storage fabric (not counted in the compute network)."""
    nic_gbps: float
    price: float
    power_w: float
    tf32_tflops: float
    fp16_tflops: float
    pcie_gb_s: float
    """One GPU's PCIe link, GB/s per direction."""
    root_port_gb_s: float = 0.0
    """A shared root port's path to the CPU, GB/s for both directions together (0: none shared)."""
    shared_root_ports: tuple[tuple[int, ...], ...] = ()
    """Groups of GPUs (by index) behind one root port."""
    memory_gb_s: float
    """Practical host memory bandwidth, GB/s."""
    gpu_nic_p2p_gb_s: float
    """GPU<->NIC peer-to-peer (GPUDirect RDMA), GB/s per direction."""
    numa_nodes: int = 2
    nvlink: str = "none"
    nvlink_gb_s: float = 300.0
    """NVLink between two GPUs, GB/s per direction."""

    def __post_init__(self) -> None:
        for name in ("gpus", "nics", "numa_nodes"):
            if getattr(self, name) < 1:
                raise UserError(f"node {self.name!r}: {name} must be at least 1, got {getattr(self, name)}")
        for name in ("nic_gbps", "pcie_gb_s", "memory_gb_s", "gpu_nic_p2p_gb_s", "nvlink_gb_s"):
            if not getattr(self, name) > 0:
                raise UserError(f"node {self.name!r}: {name} must be positive, got {getattr(self, name)}")
        for name in ("price", "power_w", "tf32_tflops", "fp16_tflops", "root_port_gb_s", "storage_nics"):
            if getattr(self, name) < 0:
                raise UserError(f"node {self.name!r}: {name} must not be negative, got {getattr(self, name)}")
        if self.nvlink not in NVLINK_KINDS:
            raise UserError(f"node {self.name!r}: nvlink must be one of {', '.join(NVLINK_KINDS)}, got {self.nvlink!r}")
        if self.nvlink == "pairs" and self.gpus % 2:
            raise UserError(f"node {self.name!r}: NVLink pairs need an even number of GPUs, got {self.gpus}")
        seen: set[int] = set()
        for group in self.shared_root_ports:
            for g in group:
                if not 0 <= g < self.gpus or g in seen:
                    raise UserError(f"node {self.name!r}: shared_root_ports names GPU {g} badly "
                                    f"(GPUs are 0..{self.gpus - 1}, each in one group at most)")
                seen.add(g)
        if self.shared_root_ports and not self.root_port_gb_s > 0:
            raise UserError(f"node {self.name!r}: shared_root_ports needs root_port_gb_s > 0")

    @property
    def nic_gb_s(self) -> float:
        """One NIC's line rate in GB/s per direction."""
        return self.nic_gbps / 8.0

    def nvlink_peer(self, gpu: int) -> int | None:
        """The GPU this one shares an NVLink Bridge with (pairs), or None."""
        if self.nvlink != "pairs":
            return None
        return gpu ^ 1


@dataclass(frozen=True, kw_only=True)
class SwitchSpec:
    """A switch, or a frame (chassis) switch built of several switch chips."""

    name: str
    description: str = ""
    radix: int
    """Ports of one switch chip."""
    gbps: float
    price: float
    power_w: float
    frame_ports: int = 0
    """External ports of a frame switch: a whole two-layer fat tree of chips in one chassis (0: a single box)."""
    chip: str = ""
    """For a frame: the single-box part used for extra switches next to it (zone bridges)."""

    def __post_init__(self) -> None:
        if self.radix < 4 or self.radix % 2:
            raise UserError(f"switch {self.name!r}: radix must be an even number of at least 4, got {self.radix}")
        if not self.gbps > 0:
            raise UserError(f"switch {self.name!r}: gbps must be positive")
        if self.price < 0 or self.power_w < 0:
            raise UserError(f"switch {self.name!r}: price and power_w must not be negative")
        if self.frame_ports and self.frame_ports != self.radix * self.radix // 2:
            raise UserError(f"switch {self.name!r}: a frame of {self.radix}-port chips has "
                            f"{self.radix * self.radix // 2} external ports, not {self.frame_ports}")

    @property
    def is_frame(self) -> bool:
        return self.frame_ports > 0

    @property
    def chips(self) -> int:
        """Switch chips inside (1 for a box; leaves plus spines for a frame)."""
        return 3 * self.radix // 2 if self.is_frame else 1

    @property
    def link_gb_s(self) -> float:
        return self.gbps / 8.0


@dataclass(frozen=True, kw_only=True)
class LinkPrices:
    """Cables and optics."""

    endpoint_cable_price: float = 0.01
    fiber_price: float = 0.004
    optic_price: float = 0.008
    optic_power_w: float = 4.5

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise UserError(f"links: {f.name} must not be negative")


@dataclass(frozen=True, kw_only=True)
class Defaults:
    node: str = "pcie-a100"
    switch: str = "frame800"
    alternative_node: str = "dgx-a100"
    alternative_switch: str = "qm8700"
    bridge_switches: int = 2
    bridge_links: int = 8

    def __post_init__(self) -> None:
        if self.bridge_switches < 1 or self.bridge_links < 1:
            raise UserError("defaults: bridge_switches and bridge_links must be at least 1")


@dataclass(frozen=True, kw_only=True)
class Catalog:
    """All presets, looked up by name with an error that lists the valid ones."""

    nodes: Mapping[str, NodeSpec]
    switches: Mapping[str, SwitchSpec]
    links: LinkPrices = field(default_factory=LinkPrices)
    defaults: Defaults = field(default_factory=Defaults)

    def node(self, name: str) -> NodeSpec:
        if name not in self.nodes:
            raise UserError(f"unknown node preset {name!r}; choose one of: {', '.join(sorted(self.nodes))}")
        return self.nodes[name]

    def switch(self, name: str) -> SwitchSpec:
        if name not in self.switches:
            raise UserError(f"unknown switch preset {name!r}; choose one of: {', '.join(sorted(self.switches))}")
        return self.switches[name]

    def chip_of(self, switch: SwitchSpec) -> SwitchSpec:
        """The single-box part for switches placed next to ``switch`` (itself unless it is a frame)."""
        if not switch.is_frame:
            return switch
        return self.switch(switch.chip) if switch.chip else switch


# -- loading --------------------------------------------------------------------------------

def default_data() -> dict[str, Any]:
    """The shipped catalogue as plain TOML data."""
    text = resources.files("fireflyer.fabric").joinpath("catalog.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` merged into a copy of ``base``: tables recursively, other values replaced."""
    out = copy.deepcopy(dict(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _resolve(kind: str, table: Mapping[str, Any], name: str, stack: tuple[str, ...] = ()) -> dict[str, Any]:
    if name in stack:
        raise UserError(f"{kind} preset {name!r}: 'base' goes round in a circle ({' -> '.join(stack + (name,))})")
    if name not in table:
        raise UserError(f"{kind} preset {stack[-1]!r} names base {name!r}, which does not exist")
    entry = dict(table[name])
    base = entry.pop("base", None)
    if base is None:
        return entry
    return merge(_resolve(kind, table, base, stack + (name,)), entry)


def _build(cls: type, kind: str, name: str, data: Mapping[str, Any]) -> Any:
    allowed = {f.name for f in fields(cls)} - {"name"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise UserError(f"{kind} preset {name!r}: unknown field(s) {', '.join(unknown)}; "
                        f"known: {', '.join(sorted(allowed))}")
    values = dict(data)
    if "shared_root_ports" in values:
        values["shared_root_ports"] = tuple(tuple(int(g) for g in grp) for grp in values["shared_root_ports"])
    if any(f.name == "name" for f in fields(cls)):
        values["name"] = name
    try:
        return cls(**values)
    except TypeError as exc:
        raise UserError(f"{kind} preset {name!r}: {exc}") from None


def from_data(data: Mapping[str, Any]) -> Catalog:
    """A :class:`Catalog` from TOML data laid out as ``catalog.toml``."""
    node_table = data.get("node", {})
    switch_table = data.get("switch", {})
    nodes = {n: _build(NodeSpec, "node", n, _resolve("node", node_table, n)) for n in node_table}
    switches = {n: _build(SwitchSpec, "switch", n, _resolve("switch", switch_table, n)) for n in switch_table}
    links = _build(LinkPrices, "links", "links", data.get("links", {}))
    defaults = _build(Defaults, "defaults", "defaults", data.get("defaults", {}))
    cat = Catalog(nodes=nodes, switches=switches, links=links, defaults=defaults)
    for name in (defaults.node, defaults.alternative_node):
        cat.node(name)
    for name in (defaults.switch, defaults.alternative_switch):
        cat.switch(name)
    for sw in switches.values():
        if sw.is_frame and sw.chip:
            cat.switch(sw.chip)
    return cat


def load(path: str | Path | None = None) -> Catalog:
    """The default catalogue, with the TOML file at ``path`` (if any) merged over it."""
    data = default_data()
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise UserError(f"cannot read catalog {str(p)!r}: {exc.strerror or exc}") from None
        try:
            over = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"catalog {str(p)!r} is not valid TOML: {exc}") from None
        data = merge(data, over)
    return from_data(data)


_DEFAULT: Catalog | None = None


def default() -> Catalog:
    """The shipped catalogue (loaded once)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = load()
    return _DEFAULT
