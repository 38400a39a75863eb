"""NIC link state and speed from sysfs (paper §VII-B: "link speed and link status").

InfiniBand ports live under ``/sys/class/infiniband/DEV/ports/N/`` (``state`` "4: ACTIVE",
``phys_state`` "5: LinkUp", ``rate`` "200 Gb/sec (4X HDR)"); Ethernet interfaces under
``/sys/class/net/IF/`` (``operstate``, ``speed`` in Mb/s, and a ``device`` link when the
interface is a physical function rather than a virtual one). The sysfs root is a parameter,
so tests point it at a fake tree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from fireflyer.validator.checks.base import Check, CheckContext, Findings


@dataclass(frozen=True, kw_only=True)
class IbPort:
    """One InfiniBand (or RoCE) port."""

    device: str
    port: int
    state: str
    """Logical state: ACTIVE, INIT, ARMED, DOWN."""
    phys_state: str
    """Physical state: LinkUp, Polling, Disabled, ..."""
    rate_gbps: float | None
    link_layer: str

    @property
    def up(self) -> bool:
        return self.state == "ACTIVE" and self.phys_state == "LinkUp"


@dataclass(frozen=True, kw_only=True)
class NetLink:
    """One network interface of ``/sys/class/net`` (loopback excluded)."""

    name: str
    operstate: str
    speed_mbps: int | None
    """None when the driver does not report a speed (virtual NICs, links that are down)."""
    physical: bool

    @property
    def up(self) -> bool:
        return self.operstate == "up"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # sysfs answers EINVAL for the speed of a down link
        return None


def _after_colon(text: str | None) -> str:
    """``"4: ACTIVE"`` -> ``"ACTIVE"``."""
    return (text or "").split(":", 1)[-1].strip()


def parse_ib_rate(text: str | None) -> float | None:
    """``"200 Gb/sec (4X HDR)"`` -> 200.0; None when it does not parse."""
    m = re.match(r"\s*([0-9.]+)\s*Gb/sec", text or "")
    return float(m.group(1)) if m else None


def ib_ports(sysfs_root: str = "/sys") -> list[IbPort]:
    """Every port of every RDMA device under ``SYSFS/class/infiniband``."""
    ports = []
    for dev in sorted((Path(sysfs_root) / "class/infiniband").glob("*")):
        for port_dir in sorted((dev / "ports").glob("*"), key=lambda p: p.name):
            if not port_dir.name.isdigit():
                continue
            ports.append(IbPort(
                device=dev.name, port=int(port_dir.name),
                state=_after_colon(_read(port_dir / "state")),
                phys_state=_after_colon(_read(port_dir / "phys_state")),
                rate_gbps=parse_ib_rate(_read(port_dir / "rate")),
                link_layer=_read(port_dir / "link_layer") or "InfiniBand",
            ))
    return ports


def net_links(sysfs_root: str = "/sys") -> list[NetLink]:
    """Every interface under ``SYSFS/class/net`` except loopback."""
    links = []
    for dev in sorted((Path(sysfs_root) / "class/net").glob("*")):
        if dev.name == "lo" or _read(dev / "type") == "772":  # 772: ARPHRD_LOOPBACK
            continue
        speed = _read(dev / "speed")
        speed_mbps = int(speed) if speed and speed.lstrip("-").isdigit() and int(speed) > 0 else None
        links.append(NetLink(name=dev.name, operstate=_read(dev / "operstate") or "unknown",
                             speed_mbps=speed_mbps, physical=(dev / "device").exists()))
    return links


class NicLinks(Check):
    """InfiniBand ports ACTIVE at the expected rate; enough Ethernet links up at the expected speed."""

    name = "nic"
    title = "NIC link state and speed"
    metrics: ClassVar[dict[str, str]] = {"ib_rate": "Gb/s", "eth_speed": "Mb/s"}
    params: ClassVar[dict[str, Any]] = {"ib_ports": 0, "eth_links": 0, "min_links_up": 1}
    budget_s = 2.0
    quick_budget_s = 0.5

    def _measure(self, ctx: CheckContext, out: Findings) -> None:
        root = ctx.options.sysfs_root
        ports, links = ib_ports(root), net_links(root)
        active = [p for p in ports if p.up]
        for p in ports:
            where = f"{p.device}/{p.port}"
            if not p.up:
                out.fail(f"{where} is {p.state or '?'}/{p.phys_state or '?'}, not ACTIVE/LinkUp")
            elif p.rate_gbps is not None:
                out.metric("ib_rate", p.rate_gbps, where=where)
        want_ib = ctx.param("ib_ports")
        if len(active) < want_ib:
            out.fail(f"{len(active)} InfiniBand ports active, the profile expects {want_ib}")
        physical_up = [ln for ln in links if ln.physical and ln.up]
        for ln in physical_up:
            if ln.speed_mbps is not None:
                out.metric("eth_speed", ln.speed_mbps, where=ln.name)
        want_eth = ctx.param("eth_links")
        if len(physical_up) < want_eth:
            out.fail(f"{len(physical_up)} physical Ethernet links up, the profile expects {want_eth}")
        up = [ln for ln in links if ln.up]
        if len(up) < ctx.param("min_links_up"):
            out.fail(f"{len(up)} network interfaces up besides loopback, "
                     f"the profile expects at least {ctx.param('min_links_up')}")
        out.details.update(
            ib=[{"port": f"{p.device}/{p.port}", "state": p.state, "phys_state": p.phys_state,
                 "rate_gbps": p.rate_gbps, "link_layer": p.link_layer} for p in ports],
            net=[{"name": ln.name, "operstate": ln.operstate, "speed_mbps": ln.speed_mbps,
                  "physical": ln.physical} for ln in links],
        )
        out.note(f"{len(active)}/{len(ports)} IB ports active, "
                 f"{len(up)}/{len(links)} interfaces up ({', '.join(ln.name for ln in up) or 'none'})")
