"""Synthetic kernel logs with Fire-Flyer's Xid mix, for tests and demos.

:func:`generate` draws ``xids`` Xid events whose codes follow the paper's Table VI (Xid 74 at
42.57%, 43 at 33.48%, 31 at 19.18%, ...), scatters them over ``nodes`` nodes and ``days`` days,
adds InfiniBand link incidents (flash cuts that come back within seconds, and a share of outages
that stay down for minutes or never come back) and ordinary kernel chatter, and writes one log per
node. Nodes take turns at the three formats: raw ``dmesg`` (seconds since boot; every node boots
at ``start``), ``dmesg -T`` and journalctl ``short`` (no year; host field = node name).

The default number of IB incidents keeps the paper's ratio of flash cuts to Xids: 213 flash cuts
in Table VIII against 12,970 Xids in Table VI over about a year. The outage share is ours; the
paper does not give one.

The same seed gives the same logs. :class:`SynthLog` carries the ground truth (per-node counts of
every Xid code, flash cuts, outages, noise and malformed lines) that an analysis must recover.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from fireflyer.validator.xid import TABLE_VI
from fireflyer.errors import UserError

FORMATS = ("dmesg", "dmesg-T", "journal")
IB_PER_XID = 213 / 12970
"""Flash cuts per Xid event in the paper (Table VIII's 213 against Table VI's 12,970)."""

_MONTH_ABBR = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
_DAY_ABBR = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]

_XID_TEXT = {
    74: "NVLink: fatal error detected on link {n}(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    31: "Ch 0000{n:04x}, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_{n} faulted @ 0x7f{n:02x}_2c000000. "
        "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
    43: "Ch 0000{n:04x}",
    13: "Graphics SM Warp Exception on (GPC {n}, TPC 1, SM 0): Out Of Range Address",
    45: "Ch 0000{n:04x}",
    63: "Row Remapper: New row marked for remapping, reset gpu to activate.",
    64: "Row Remapper: Failed to remap row, reset gpu and run field diagnostics.",
    79: "GPU has fallen off the bus.",
    119: "Timeout after 6s of waiting for RPC response from GPU{n} GSP! Expected function 76 (GSP_RM_CONTROL).",
}
_NOISE = (
    "EXT4-fs (nvme0n1p{n}): mounted filesystem with ordered data mode. Quota mode: none.",
    "perf: interrupt took too long ({n}000 > 2500), lowering kernel.perf_event_max_sample_rate to 63000",
    "nvidia-uvm: Loaded the UVM driver, major device number {n}.",
    "TCP: request_sock_TCP: Possible SYN flooding on port {n}. Sending cookies.",
    "audit: type=1400 audit({n}.123:45): apparmor=\"STATUS\" operation=\"profile_load\"",
    "mlx5_core 0000:e1:00.{n}: mlx5_pcie_event:301:(pid {n}): PCIe slot advertised sufficient power (75W).",
    "NVRM: GPU at PCI:0000:{n:02x}:00: GPU-1f2e3d4c-0000-0000-0000-00000000000{n}",
    "xfs filesystem being remounted at /data supports timestamps until 2038 (0x{n}fffffff)",
)
_JOURNAL_NOISE = (
    "systemd[1]: Started Session {n} of User root.",
    "sshd[{n}]: Accepted publickey for root from 10.0.0.{n} port 52{n:03d} ssh2",
    "slurmd[{n}]: launch task StepId={n}.0 request from UID:1000",
)
_GPU_BUSES = ("0e", "13", "4b", "51", "93", "99", "cb", "d1")


@dataclass(frozen=True, kw_only=True)
class SynthConfig:
    """What to generate. Checks itself."""

    xids: int
    nodes: int = 4
    seed: int = 0
    days: float = 30.0
    start: datetime = datetime(2023, 10, 1, tzinfo=timezone.utc)
    """First instant of the logs and the boot time of every node (UTC)."""
    ib_incidents: int | None = None
    """IB link incidents in all; ``None``: the paper's ratio, at least one when there are Xids."""
    outage_fraction: float = 0.2
    noise_per_event: float = 2.0
    malformed: int = 0
    flash_max_s: float = 20.0
    """Flash cuts come back within this many seconds (keep it under the analysis window)."""

    def __post_init__(self) -> None:
        if self.xids < 0:
            raise UserError(f"xids must be >= 0, got {self.xids}")
        if self.nodes < 1:
            raise UserError(f"nodes must be >= 1, got {self.nodes}")
        if self.days <= 0:
            raise UserError(f"days must be > 0, got {self.days}")
        if not 0 <= self.outage_fraction <= 1:
            raise UserError(f"outage_fraction must be in [0, 1], got {self.outage_fraction}")
        if self.ib_incidents is not None and self.ib_incidents < 0:
            raise UserError(f"ib_incidents must be >= 0, got {self.ib_incidents}")
        if self.malformed < 0 or self.noise_per_event < 0:
            raise UserError("malformed and noise_per_event must be >= 0")
        if self.start.tzinfo is None:
            raise UserError("start must carry a time zone (use UTC)")


@dataclass(kw_only=True)
class NodeTruth:
    file: str
    format: str
    xids: dict[int, int] = field(default_factory=dict)
    flash_cuts: int = 0
    outages: int = 0
    noise: int = 0
    malformed: int = 0


@dataclass(kw_only=True)
class SynthLog:
    """Generated logs (file name → text) and the ground truth behind them."""

    files: dict[str, str]
    nodes: dict[str, NodeTruth]
    boot_time: datetime
    year: int

    @property
    def xids(self) -> dict[int, int]:
        total: dict[int, int] = {}
        for t in self.nodes.values():
            for code, n in t.xids.items():
                total[code] = total.get(code, 0) + n
        return total

    def truth(self) -> dict:
        """The ground truth as JSON-ready data."""
        return {
            "boot_time": self.boot_time.isoformat(), "year": self.year,
            "xids": {str(k): v for k, v in sorted(self.xids.items())},
            "nodes": {
                name: {"file": t.file, "format": t.format, "xids": {str(k): v for k, v in sorted(t.xids.items())},
                       "flash_cuts": t.flash_cuts, "outages": t.outages, "noise": t.noise, "malformed": t.malformed}
                for name, t in self.nodes.items()
            },
        }


def _stamp(fmt: str, t: datetime, boot: datetime, host: str, ident: str = "kernel") -> str:
    if fmt == "dmesg":
        return f"[{(t - boot).total_seconds():12.6f}]"
    if fmt == "dmesg-T":
        return f"[{_DAY_ABBR[t.weekday()]} {_MONTH_ABBR[t.month - 1]} {t.day:2d} {t:%H:%M:%S} {t.year}]"
    return f"{_MONTH_ABBR[t.month - 1]} {t.day:02d} {t:%H:%M:%S} {host} {ident}:"


def _link_lines(rng: random.Random) -> tuple[str, str]:
    """A down message and its matching up message, in one of the styles the parser knows."""
    port = rng.randrange(2)
    style = rng.randrange(4)
    if style == 0:
        dev = f"mlx5_core 0000:{('e1', '61')[port]}:00.0 ib{port}"
        return f"{dev}: Link down", f"{dev}: Link up"
    if style == 1:
        return f"ib{port}: lost carrier", f"IPv6: ADDRCONF(NETDEV_CHANGE): ib{port}: link becomes ready"
    if style == 2:
        return (f"mlx5_ib: mlx5_{port}: port 1 state changed: ACTIVE -> DOWN",
                f"mlx5_ib: mlx5_{port}: port 1 state changed: DOWN -> ACTIVE")
    return f"ib_core: mlx5_{port} port 1 event: PORT_ERR", f"ib_core: mlx5_{port} port 1 event: PORT_ACTIVE"


def generate(config: SynthConfig) -> SynthLog:
    """Generate logs for ``config``. Pure: the same config gives the same text."""
    rng = random.Random(config.seed)
    names = [f"node{i:02d}" for i in range(config.nodes)]
    span = config.days * 86400.0
    boot = config.start
    truth = {
        name: NodeTruth(file=f"{name}.{FORMATS[i % len(FORMATS)]}.log", format=FORMATS[i % len(FORMATS)])
        for i, name in enumerate(names)
    }
    entries: dict[str, list[tuple[float, str, str]]] = {n: [] for n in names}  # (offset s, ident, message)

    codes = list(TABLE_VI)
    for code in rng.choices(codes, weights=[TABLE_VI[c] for c in codes], k=config.xids):
        node = rng.choice(names)
        bus = rng.choice(_GPU_BUSES)
        n = rng.randrange(1, 12)
        text = _XID_TEXT.get(code, "Ch 0000{n:04x}").format(n=n)
        msg = f"NVRM: Xid (PCI:0000:{bus}:00): {code}, pid={rng.randrange(1000, 99999)}, name=python3, {text}"
        entries[node].append((rng.uniform(0, span), "kernel", msg))
        truth[node].xids[code] = truth[node].xids.get(code, 0) + 1

    n_ib = config.ib_incidents if config.ib_incidents is not None else (
        max(1, round(config.xids * IB_PER_XID)) if config.xids else 0)
    per_node: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(n_ib):
        per_node[rng.choice(names)].append(rng.uniform(0, span))
    for node, starts in per_node.items():
        free = 0.0  # incidents on one node never overlap, so each down pairs with its own up
        for t in sorted(starts):
            t = max(t, free)
            down, up = _link_lines(rng)
            entries[node].append((t, "kernel", down))
            if rng.random() < config.outage_fraction:
                truth[node].outages += 1
                back = rng.choice((None, rng.uniform(300.0, 3600.0)))
                if back is not None:
                    entries[node].append((t + back, "kernel", up))
                free = t + 3601.0
            else:
                truth[node].flash_cuts += 1
                entries[node].append((t + rng.uniform(1.0, config.flash_max_s), "kernel", up))
                free = t + config.flash_max_s + 1.0

    events = config.xids + n_ib
    for _ in range(round(events * config.noise_per_event)):
        node = rng.choice(names)
        n = rng.randrange(1, 10)
        if truth[node].format == "journal" and rng.random() < 0.3:
            ident, msg = rng.choice(_JOURNAL_NOISE).format(n=n).split(": ", 1)
        else:
            ident, msg = "kernel", rng.choice(_NOISE).format(n=n)
        entries[node].append((rng.uniform(0, span), ident, msg))
        truth[node].noise += 1

    for _ in range(config.malformed):
        node = rng.choice(names)
        bad = rng.choice(("NVRM: Xid (PCI:0000:4b:00): , pid=1", "NVRM: Xid (PCI:0000:4b:00): seventy-four"))
        if rng.random() < 0.5:
            entries[node].append((rng.uniform(0, span), "kernel", bad))
        else:  # no ident: written without a time stamp
            entries[node].append((rng.uniform(0, span), "", "truncated line without a time stamp"))
        truth[node].malformed += 1

    files = {}
    for node in names:
        t = truth[node]
        lines = []
        if t.format == "journal":
            lines.append(f"-- Logs begin at {boot:%a %Y-%m-%d %H:%M:%S} UTC. --")
            t.noise += 1
        for offset, ident, msg in sorted(entries[node]):
            at = boot + timedelta(seconds=offset)
            if ident == "":
                lines.append(msg)
            else:
                lines.append(f"{_stamp(t.format, at, boot, node, ident)} {msg}")
        files[t.file] = "\n".join(lines) + "\n"
    return SynthLog(files=files, nodes=truth, boot_time=boot, year=boot.year)
