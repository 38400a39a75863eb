"""Fat-tree sizing from a switch's radix: two-layer trees, zones of two-layer trees joined
by a few bridge switches (the paper's Figure 5), three-layer trees, and multi-plane
networks (section IX).

A k-port switch builds a two-layer (leaf-spine) fat tree of k leaves and k/2 spines with
k^2/2 endpoints, and a three-layer one of k^3/4. Each leaf has k/2 ports down and k/2 up.

Pure functions on plain numbers; :class:`Fabric` is what the cost model and the simulator read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from fireflyer.errors import UserError

CORE_ROUNDING = ("pow2", "exact")


def two_layer_capacity(radix: int) -> int:
    """Endpoints of a full two-layer fat tree of ``radix``-port switches: k^2/2."""
    _check_radix(radix)
    return radix * radix // 2


def three_layer_capacity(radix: int) -> int:
    """Endpoints of a full three-layer fat tree: k^3/4."""
    _check_radix(radix)
    return radix ** 3 // 4


def _check_radix(radix: int) -> None:
    if radix < 4 or radix % 2:
        raise UserError(f"switch radix must be an even number of at least 4, got {radix}")


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True, kw_only=True)
class Fabric:
    """One network design: switch and link counts for all its planes together.

    ``layers`` is 2 or 3. A zoned two-layer design has ``zones`` > 1 full or trimmed
    two-layer trees joined by ``bridges`` switches; each bridge has ``bridge_links`` links
    into every zone, which take endpoint ports there.
    """

    layers: int
    radix: int
    planes: int = 1
    zones: int = 1
    endpoints: int
    """Endpoints asked for, per plane (node NICs plus storage NICs)."""
    ports: int
    """Endpoint ports built, per plane (leaves x k/2, less the bridge links)."""
    leaf: int
    """Leaf switches per plane (all zones)."""
    spine: int
    core: int = 0
    bridge: int = 0
    bridge_links: int = 0
    """Links from each bridge switch into each zone."""
    frames: int = 0
    """Frame switches per plane (each a whole zone)."""
    leaves_per_zone: int = 0
    spines_per_zone: int = 0
    link_gb_s: float = 25.0
    zone_endpoints: tuple[int, ...] = ()
    """Endpoints placed in each zone (per plane)."""
    notes: tuple[str, ...] = field(default=())

    @property
    def switches_per_plane(self) -> int:
        return self.leaf + self.spine + self.core + self.bridge

    @property
    def switches(self) -> int:
        """Switches (chips) in all planes; a frame counts as its chips, as Table III does."""
        return self.planes * self.switches_per_plane

    @property
    def switches_by_layer(self) -> dict[str, int]:
        """Switches by layer, all planes together."""
        out = {"leaf": self.leaf, "spine": self.spine}
        if self.core:
            out["core"] = self.core
        if self.bridge:
            out["bridge"] = self.bridge
        return {k: v * self.planes for k, v in out.items()}

    @property
    def links_by_kind(self) -> dict[str, int]:
        """Links by kind, all planes together. ``leaf-spine`` inside a frame is backplane, not cable."""
        half = self.radix // 2
        out = {
            "endpoint": self.endpoints,
            "leaf-spine": self.leaf * half,
        }
        if self.core:
            out["spine-core"] = self.spine * half
        if self.bridge:
            out["bridge"] = self.bridge * self.zones * self.bridge_links
        return {k: v * self.planes for k, v in out.items()}

    @property
    def backplane_links(self) -> int:
        """Leaf-spine links inside frame switches (no cable, no optics)."""
        return self.links_by_kind["leaf-spine"] if self.frames else 0

    @property
    def cables(self) -> int:
        """Cables: one per link that is not on a frame's backplane."""
        return sum(self.links_by_kind.values()) - self.backplane_links

    @property
    def optics(self) -> int:
        """Optical transceivers: two per switch-to-switch cable; endpoint cables take none."""
        return 2 * (self.cables - self.links_by_kind["endpoint"])

    @property
    def kind(self) -> str:
        if self.layers == 3:
            return "three-layer fat tree"
        base = "two-layer fat tree" if self.zones == 1 else f"{self.zones} zones of two-layer fat trees"
        return base if self.planes == 1 else f"{self.planes} planes of {base}"


def two_layer(endpoints: int, radix: int, *, full: bool = False, link_gb_s: float = 25.0) -> Fabric:
    """A single two-layer fat tree for ``endpoints``: just enough leaves (``full``: all k of them)
    and enough spines to keep it non-blocking (one per two leaves)."""
    _check_radix(radix)
    _check_endpoints(endpoints)
    cap = two_layer_capacity(radix)
    if endpoints > cap:
        raise UserError(f"{endpoints} endpoints do not fit one two-layer fat tree of {radix}-port switches "
                        f"(at most {cap}); use zones, planes or three layers")
    half = radix // 2
    leaves = radix if full else math.ceil(endpoints / half)
    spines = half if full else math.ceil(leaves / 2)
    return Fabric(layers=2, radix=radix, endpoints=endpoints, ports=leaves * half, leaf=leaves, spine=spines,
                  frames=0, leaves_per_zone=leaves, spines_per_zone=spines, link_gb_s=link_gb_s,
                  zone_endpoints=(endpoints,))


def zoned(endpoints: int, radix: int, *, storage_endpoints: int = 0, full: bool = False, frames: bool = False,
          bridge_switches: int = 2, bridge_links: int = 8, zones: int | None = None,
          link_gb_s: float = 25.0) -> Fabric:
    """Fire-Flyer's design (Figure 5): zones of two-layer fat trees joined by a few bridge switches.

    ``endpoints`` compute NICs are split evenly over the zones; each of ``storage_endpoints``
    storage servers has one NIC in every zone. Each bridge switch has ``bridge_links`` links
    into every zone, on leaf ports. With ``frames`` (or ``full``) every zone is a whole
    k^2/2-port tree, as an 800-port frame switch is; otherwise zones are trimmed to the
    leaves they need. One zone needs no bridges.
    """
    _check_radix(radix)
    _check_endpoints(endpoints)
    if storage_endpoints < 0:
        raise UserError(f"storage endpoints must not be negative, got {storage_endpoints}")
    full = full or frames
    cap = two_layer_capacity(radix)
    half = radix // 2
    if zones is None:
        zones = 1
        while True:
            per = math.ceil(endpoints / zones) + storage_endpoints
            if zones > 1:
                per += bridge_switches * _bridge_links(zones, radix, bridge_links)
            if per <= cap:
                break
            zones += 1
            if zones > radix:
                raise UserError(f"{endpoints} endpoints need more than {radix} zones of {radix}-port switches; "
                                f"use a three-layer fat tree or planes")
    if zones < 1:
        raise UserError(f"zones must be at least 1, got {zones}")
    links_in = _bridge_links(zones, radix, bridge_links) if zones > 1 else 0
    bridges = bridge_switches if zones > 1 else 0
    per_zone = [endpoints // zones + (1 if z < endpoints % zones else 0) for z in range(zones)]
    used = [e + storage_endpoints + bridges * links_in for e in per_zone]
    if max(used) > cap:
        raise UserError(f"{max(used)} ports per zone do not fit a two-layer fat tree of {radix}-port switches "
                        f"(at most {cap}); add zones")
    if full:
        leaves_z, spines_z = radix, half
    else:
        leaves_z = math.ceil(max(used) / half)
        spines_z = math.ceil(leaves_z / 2)
    notes = ()
    if zones > 1:
        notes = (f"{bridges} bridge switches, {links_in} links from each into each zone",)
    return Fabric(layers=2, radix=radix, zones=zones, endpoints=endpoints + zones * storage_endpoints,
                  ports=zones * (leaves_z * half - bridges * links_in), leaf=zones * leaves_z, spine=zones * spines_z,
                  bridge=bridges, bridge_links=links_in, frames=zones if frames else 0, leaves_per_zone=leaves_z,
                  spines_per_zone=spines_z, link_gb_s=link_gb_s,
                  zone_endpoints=tuple(e + storage_endpoints for e in per_zone), notes=notes)


def _bridge_links(zones: int, radix: int, wanted: int) -> int:
    """Links from one bridge into each zone: ``wanted``, fewer if the bridge has too few ports."""
    links = min(wanted, radix // zones)
    if links < 1:
        raise UserError(f"a {radix}-port bridge switch cannot reach {zones} zones")
    return links


def three_layer(endpoints: int, radix: int, *, core_rounding: str = "pow2", link_gb_s: float = 25.0) -> Fabric:
    """A three-layer fat tree: pods of k/2 leaves and k/2 spines, and a core layer.

    Leaves are just enough for the endpoints; each pod's spines match its leaves. The core
    takes every spine uplink. ``core_rounding="pow2"`` builds the core for the next power of
    two of pods, so pods can be added without recabling the core: this is the rule that
    gives the paper's Table III figures (25 pods -> a core for 32: 320 switches at 10,000
    endpoints; 4 pods: 40 at 1,600). ``"exact"`` builds the core for the pods there are.
    """
    _check_radix(radix)
    _check_endpoints(endpoints)
    if core_rounding not in CORE_ROUNDING:
        raise UserError(f"core rounding must be one of {', '.join(CORE_ROUNDING)}, got {core_rounding!r}")
    cap = three_layer_capacity(radix)
    if endpoints > cap:
        raise UserError(f"{endpoints} endpoints do not fit a three-layer fat tree of {radix}-port switches "
                        f"(at most {cap}); use planes or a bigger radix")
    half = radix // 2
    leaves = math.ceil(endpoints / half)
    pods = math.ceil(leaves / half)
    spines = leaves
    core_pods = min(next_pow2(pods), radix) if core_rounding == "pow2" else pods
    core = math.ceil(core_pods * half * half / radix)
    notes = (f"{pods} pods; core built for {core_pods}",)
    return Fabric(layers=3, radix=radix, endpoints=endpoints, ports=leaves * half, leaf=leaves, spine=spines,
                  core=core, link_gb_s=link_gb_s, zone_endpoints=(endpoints,), notes=notes)


def planes_of(fabric_per_plane: Fabric, planes: int) -> Fabric:
    """``planes`` copies of one plane's design (section IX's multi-plane network)."""
    if planes < 1:
        raise UserError(f"planes must be at least 1, got {planes}")
    return replace(fabric_per_plane, planes=planes)


def _check_endpoints(endpoints: int) -> None:
    if endpoints < 1:
        raise UserError(f"a fabric needs at least 1 endpoint, got {endpoints}")


def design(endpoints: int, radix: int, *, frames: bool = False, storage_endpoints: int = 0,
           bridge_switches: int = 2, bridge_links: int = 8, link_gb_s: float = 25.0) -> Fabric:
    """The cheapest two-layer design for one plane: one tree if it fits, else zones (Fire-Flyer's choice)."""
    total = endpoints + storage_endpoints
    if total <= two_layer_capacity(radix) and not frames:
        return two_layer(total, radix, link_gb_s=link_gb_s)
    return zoned(endpoints, radix, storage_endpoints=storage_endpoints, frames=frames,
                 bridge_switches=bridge_switches, bridge_links=bridge_links, link_gb_s=link_gb_s)
