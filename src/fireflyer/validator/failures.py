"""Failure-log analysis: Xid and InfiniBand events from kernel logs, MTBF, checkpoint interval.

Everything here is pure: text in, data out. Reading files, the clock, printing and plotting live
in :mod:`fireflyer.validator.failures_cli`.

**Line formats.** :mod:`fireflyer.validator.kernlog` reads the time stamps (``dmesg``,
``dmesg -T``, journalctl/syslog ``short`` and ``short-iso``), the host names (they name the
node) and the Xid lines, for this analysis and for the ``xid`` health check alike. Wall-clock
times without a zone are read as UTC; only differences between them matter here.

**Events.** ``NVRM: Xid (PCI:0000:65:00): 74, pid=..., name=..., msg`` is an Xid. InfiniBand
link transitions are recognised from mlx5 netdev messages (``mlx5_core 0000:e1:00.0 ib0: Link
down``/``Link up``), IPoIB carrier messages (``ib0: lost carrier``, ``ib0: Link is Up``, ``link
becomes ready``) and port state changes from ``mlx5_ib``/``ib_core`` (``mlx5_0: port 1 state
changed: ACTIVE -> DOWN``, ``port 1 event: PORT_ERR``). A *flash cut* is a link that goes down
and comes back up within a short window (60 s by default); anything longer, or with no ``up`` at
all, is an *outage*.

**Counting.** Every non-blank line is exactly one of: an event, *noise* (a well-formed log line
about something else, or a journal marker such as ``-- Boot ... --``) or *malformed* (no
recognisable time stamp, a time stamp that is not a date, or an Xid line that does not parse).
Malformed lines are skipped and counted, never fatal.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from fireflyer.validator.kernlog import XID_MARK, Clock, ParseOptions, XidEvent, read_lines, xid_event
from fireflyer.validator.xid import (
    CLASS_ORDER,
    TABLE_VI,
    XidClass,
    lookup,
    recovery_action,
)
from fireflyer.errors import UserError

DEFAULT_FLASH_WINDOW_S = 60.0


@dataclass(frozen=True, kw_only=True)
class LinkEvent:
    node: str
    time: float
    clock: Clock
    link: str
    up: bool
    line_no: int


@dataclass(kw_only=True)
class ParsedLog:
    """What one log file holds."""

    source: str
    xids: list[XidEvent] = field(default_factory=list)
    links: list[LinkEvent] = field(default_factory=list)
    lines: int = 0
    noise: int = 0
    malformed: int = 0
    spans: dict[tuple[str, Clock], tuple[float, float]] = field(default_factory=dict)
    """(node, clock) → (first, last) time stamp seen: the observation window."""


# ---------------------------------------------------------------- messages

_LINK_PATTERNS: tuple[tuple[re.Pattern[str], bool], ...] = (
    (re.compile(r"mlx\d_core \S+ (?P<link>[\w.-]+): Link down\b", re.IGNORECASE), False),
    (re.compile(r"mlx\d_core \S+ (?P<link>[\w.-]+): Link up\b", re.IGNORECASE), True),
    (re.compile(r"\b(?P<link>ib[\w.-]*): (?:lost carrier|link is down)\b", re.IGNORECASE), False),
    (re.compile(r"\b(?P<link>ib[\w.-]*): (?:link is up|link becomes ready|carrier on)\b", re.IGNORECASE), True),
)
_PORT_STATE = re.compile(
    r"\b(?:mlx\d_ib|ib_core|infiniband)\b.*?\b(?P<dev>[a-z]+\d*_\d+):? port (?P<port>\d+)\b.*?"
    r"\b(?:state|event)\b.*?\b(?P<state>PORT_ACTIVE|PORT_ERR|ACTIVE|DOWN)\s*$"
)


def _link_event(body: str) -> tuple[str, bool] | None:
    for pattern, up in _LINK_PATTERNS:
        if m := pattern.search(body):
            return m.group("link"), up
    if m := _PORT_STATE.search(body):
        return f"{m.group('dev')}/{m.group('port')}", m.group("state") in ("ACTIVE", "PORT_ACTIVE")
    return None


def parse_log(text: str, *, source: str, options: ParseOptions = ParseOptions()) -> ParsedLog:
    """Parse one log's text. Never raises on content: bad lines are counted as malformed."""
    log = ParsedLog(source=source)
    for line in read_lines(text, options):
        log.lines += 1
        if line.marker:  # journalctl markers: "-- Boot 1a2b... --", "-- Logs begin at ..."
            log.noise += 1
            continue
        if line.time is None or line.clock is None:
            log.malformed += 1
            continue
        node = line.host or options.node
        lo, hi = log.spans.get((node, line.clock), (line.time, line.time))
        log.spans[(node, line.clock)] = (min(lo, line.time), max(hi, line.time))
        if XID_MARK in line.body:
            event = xid_event(line, node=options.node)
            if event is None:
                log.malformed += 1
            else:
                log.xids.append(event)
        elif (link := _link_event(line.body)) is not None:
            log.links.append(LinkEvent(node=node, time=line.time, clock=line.clock, link=link[0], up=link[1],
                                       line_no=line.line_no))
        else:
            log.noise += 1
    return log


# ---------------------------------------------------------------- analysis

@dataclass(frozen=True, kw_only=True)
class LinkIncident:
    """A link that went down: a *flash cut* if it came back within the window, else an *outage*."""

    node: str
    link: str
    clock: Clock
    down: float
    up: float | None
    flash: bool


def link_incidents(events: Iterable[LinkEvent], *, window_s: float = DEFAULT_FLASH_WINDOW_S) -> list[LinkIncident]:
    """Pair each link's downs with the next up. An up with no down before it is a boot-time link-up, not an incident."""
    by_link: dict[tuple[str, str], list[LinkEvent]] = defaultdict(list)
    for e in events:
        by_link[(e.node, e.link)].append(e)
    out: list[LinkIncident] = []
    for (node, link), evs in by_link.items():
        pending: LinkEvent | None = None
        for e in sorted(evs, key=lambda e: (e.clock, e.time)):
            if not e.up:
                if pending is not None:  # down twice: the first never came back that we saw
                    out.append(LinkIncident(node=node, link=link, clock=pending.clock, down=pending.time, up=None, flash=False))
                pending = e
            elif pending is not None:
                same = pending.clock == e.clock
                flash = same and e.time - pending.time <= window_s
                out.append(LinkIncident(node=node, link=link, clock=pending.clock, down=pending.time,
                                        up=e.time if same else None, flash=flash))
                pending = None
        if pending is not None:
            out.append(LinkIncident(node=node, link=link, clock=pending.clock, down=pending.time, up=None, flash=False))
    return sorted(out, key=lambda i: (i.node, i.clock, i.down))


@dataclass(frozen=True, kw_only=True)
class TableRow:
    """One row of a Table VI-style breakdown."""

    xid_class: str
    code: int
    count: int
    percent: float
    paper_percent: float | None
    action: str
    nvidia_action: str
    fatal: bool | None


def xid_table(counts: Mapping[int, int]) -> list[TableRow]:
    """Counts per Xid as rows in Table VI's order (by class, then code), with % of the total."""
    total = sum(counts.values())
    paper_total = sum(TABLE_VI.values())
    rows = []
    for code, n in counts.items():
        x = lookup(code)
        rows.append(TableRow(
            xid_class=x.xid_class.value, code=code, count=n, percent=100.0 * n / total if total else 0.0,
            paper_percent=100.0 * TABLE_VI[code] / paper_total if code in TABLE_VI else None,
            action=x.action.value, nvidia_action=x.nvidia_action, fatal=x.fatal,
        ))
    order = {c.value: i for i, c in enumerate(CLASS_ORDER)}
    return sorted(rows, key=lambda r: (order[r.xid_class], r.code))


@dataclass(frozen=True, kw_only=True)
class NodeSummary:
    node: str
    xids: dict[int, int]
    flash_cuts: int
    outages: int
    interruptions: int
    """Xids that stop the job (see :attr:`Xid.interrupts`) plus link incidents: the failures of MTBF."""
    hours: float
    clock: Clock


@dataclass(frozen=True, kw_only=True)
class Analysis:
    nodes: dict[str, NodeSummary]
    xid_events: list[XidEvent]
    incidents: list[LinkIncident]
    lines: int
    noise: int
    malformed: int
    clocks: frozenset[str]

    @property
    def xids(self) -> dict[int, int]:
        total: Counter[int] = Counter()
        for n in self.nodes.values():
            total.update(n.xids)
        return dict(total)

    @property
    def node_hours(self) -> float:
        return sum(n.hours for n in self.nodes.values())

    @property
    def interruptions(self) -> int:
        return sum(n.interruptions for n in self.nodes.values())


def _interrupts(e: XidEvent) -> bool:
    return lookup(e.code).interrupts if e.code != 154 else recovery_action(154, e.message).value in ("drain", "reset GPU")


def analyse(logs: Iterable[ParsedLog], *, window_s: float = DEFAULT_FLASH_WINDOW_S, hours_per_node: float | None = None) -> Analysis:
    """Summarise parsed logs per node. A node's hours are its observed span (first to last time
    stamp) on its wall clock if it has one, else on its boot clock, unless ``hours_per_node`` is given."""
    logs = list(logs)
    xids = [e for log in logs for e in log.xids]
    incidents = link_incidents((e for log in logs for e in log.links), window_s=window_s)
    spans: dict[tuple[str, Clock], tuple[float, float]] = {}
    for log in logs:
        for key, (lo, hi) in log.spans.items():
            a, b = spans.get(key, (lo, hi))
            spans[key] = (min(a, lo), max(b, hi))
    names = sorted({node for node, _ in spans})
    nodes = {}
    for name in names:
        clock: Clock = "wall" if (name, "wall") in spans else "boot"
        lo, hi = spans[(name, clock)]
        mine = [e for e in xids if e.node == name]
        incs = [i for i in incidents if i.node == name]
        nodes[name] = NodeSummary(
            node=name, xids=dict(Counter(e.code for e in mine)),
            flash_cuts=sum(i.flash for i in incs), outages=sum(not i.flash for i in incs),
            interruptions=sum(_interrupts(e) for e in mine) + len(incs),
            hours=hours_per_node if hours_per_node is not None else (hi - lo) / 3600.0, clock=clock,
        )
    return Analysis(
        nodes=nodes, xid_events=xids, incidents=incidents, lines=sum(g.lines for g in logs),
        noise=sum(g.noise for g in logs), malformed=sum(g.malformed for g in logs),
        clocks=frozenset(c for _, c in spans),
    )


# ---------------------------------------------------------------- reliability arithmetic

def mtbf_hours(node_hours: float, failures: int) -> float | None:
    """Mean time between failures of *one node*: node-hours observed per failure (``None`` if none failed)."""
    if node_hours < 0:
        raise UserError(f"node_hours must be >= 0, got {node_hours}")
    return node_hours / failures if failures > 0 else None


def young_daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval √(2·C·M) for save cost C and MTBF M (both in seconds).

    It balances the time spent saving (C per interval) against the work lost on a failure (half
    an interval on average). Daly's refinement (:func:`daly_interval`) differs when C is not ≪ M.
    """
    if save_cost_s < 0 or mtbf_s <= 0:
        raise UserError(f"need save cost >= 0 and MTBF > 0, got C={save_cost_s}, M={mtbf_s}")
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (2006): √(2CM)·[1 + ⅓√(C/2M) + ⅑(C/2M)] − C for C < 2M, else M."""
    c, m = save_cost_s, mtbf_s
    if c >= 2 * m:
        return m
    r = c / (2 * m)
    return young_daly_interval(c, m) * (1 + math.sqrt(r) / 3 + r / 9) - c


def xid_class_totals(counts: Mapping[int, int]) -> dict[str, int]:
    """Counts summed per class, in Table VI's order (classes with no events are left out)."""
    out: dict[str, int] = {}
    for cls in CLASS_ORDER:
        n = sum(v for k, v in counts.items() if lookup(k).xid_class is cls)
        if n:
            out[cls.value] = n
    return out


__all__ = [
    "Analysis", "LinkEvent", "LinkIncident", "NodeSummary", "ParseOptions", "ParsedLog", "TableRow",
    "XidClass", "XidEvent", "analyse", "daly_interval", "link_incidents", "mtbf_hours", "parse_log",
    "xid_class_totals", "xid_table", "young_daly_interval",
]
