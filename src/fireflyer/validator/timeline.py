"""The failure timeline of ``fireflyer failures --plot``: where each event goes on the x axis, and the PNG.

Logs are not always on one clock. dmesg without ``--boot-time`` counts seconds since each
node's own boot, and a journalctl line has no year, so without ``--year`` each such log's
year is guessed from its file's date; two logs can then land years apart. The timeline
puts events on one shared axis only where their times are comparable: wall-clock events
share an origin (the first of them) when the user dated the logs (``aligned``); every other
node's events count from that node's own first event. The x axis spans the events
themselves, never an origin they are far from.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from fireflyer.fsutil import atomic_write
from fireflyer.validator.failures import Analysis
from fireflyer.validator.xid import XidClass, lookup

_COLOURS = {XidClass.NVLINK: "tab:red", XidClass.SOFTWARE: "tab:blue", XidClass.GPU_ECC: "tab:orange",
            XidClass.UNCORRECTABLE: "tab:purple", XidClass.GSP: "tab:brown", XidClass.UNCLASSIFIED: "tab:gray",
            XidClass.UNKNOWN: "black"}

SHARED = "shared"
"""The time base of the wall-clock events that share one origin."""


@dataclass(frozen=True, kw_only=True)
class TimelineAxis:
    """Where the timeline puts an event (hours from its time base's origin) and what the axis says."""

    origins: dict[str, float]
    """Time base → the time (seconds, on its clock) drawn at x = 0. A base is :data:`SHARED` or a node's
    own ``"node/clock"``."""
    xlim: tuple[float, float]
    """The x axis, hours: the events' own range and a small margin."""
    label: str
    own_clock: frozenset[str]
    """The nodes drawn from their own first event in a plot where other nodes share a clock."""
    aligned: bool

    def base(self, node: str, clock: str | None) -> str:
        return SHARED if self.aligned and clock == "wall" else f"{node}/{clock}"

    def hours(self, node: str, t: float, clock: str | None) -> float:
        return (t - self.origins[self.base(node, clock)]) / 3600.0


def _points(analysis: Analysis) -> list[tuple[str, float, str | None]]:
    """(node, time, clock) of every event the timeline draws: the dated Xids and the link incidents."""
    return ([(e.node, e.time, e.clock) for e in analysis.xid_events if e.time is not None]
            + [(i.node, i.down, i.clock) for i in analysis.incidents])


def timeline_axis(analysis: Analysis, *, aligned: bool) -> TimelineAxis:
    """The timeline's x axis for ``analysis``.

    ``aligned``: the logs' wall-clock times are comparable across nodes (the user gave
    ``--boot-time`` or ``--year``), so they share one origin, the first of them. Boot-clock
    events, and every event when not ``aligned``, count from their node's own first event.
    """
    points = _points(analysis)
    probe = TimelineAxis(origins={}, xlim=(0.0, 1.0), label="", own_clock=frozenset(), aligned=aligned)
    origins: dict[str, float] = {}
    for node, t, clock in points:
        b = probe.base(node, clock)
        origins[b] = min(origins.get(b, t), t)
    xs = [(t - origins[probe.base(node, clock)]) / 3600.0 for node, t, clock in points]
    lo, hi = (min(xs), max(xs)) if xs else (0.0, 1.0)
    pad = max((hi - lo) * 0.03, 0.05)
    own = frozenset(node for node, _, clock in points if probe.base(node, clock) != SHARED)
    start = (datetime.fromtimestamp(origins[SHARED], timezone.utc).strftime("%Y-%m-%d %H:%M")
             if SHARED in origins else "")
    if SHARED in origins and not own:
        label = f"hours since {start} UTC"
    elif SHARED in origins:
        label = f"hours since {start} UTC; nodes marked * (boot clock) since their own first event"
    elif aligned:
        label = "hours since each node's first event (boot clock: give --boot-time to align the nodes)"
    else:
        label = "hours since each node's first event (not aligned: give --boot-time and --year to align the nodes)"
    return TimelineAxis(origins=origins, xlim=(lo - pad, hi + pad), label=label,
                        own_clock=own if SHARED in origins else frozenset(), aligned=aligned)


def plot_timeline(analysis: Analysis, path: Path, *, aligned: bool = True) -> TimelineAxis:
    """Draw every Xid and IB incident on one row per node (matplotlib's Agg canvas), written atomically;
    returns the axis it drew (see :func:`timeline_axis`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    axis = timeline_axis(analysis, aligned=aligned)
    names = list(analysis.nodes)
    row = {n: i for i, n in enumerate(names)}
    fig = Figure(figsize=(11, 1.2 + 0.35 * max(1, len(names))))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for cls in XidClass:
        evs = [e for e in analysis.xid_events if e.time is not None and lookup(e.code).xid_class is cls]
        if evs:
            ax.scatter([axis.hours(e.node, e.time, e.clock) for e in evs], [row[e.node] for e in evs], s=80,
                       marker="|", linewidths=0.8, color=_COLOURS[cls], label=f"{cls.value} ({len(evs)})")
    for flash, marker, label in ((True, "x", "IB flash cut"), (False, "v", "IB outage")):
        incs = [i for i in analysis.incidents if i.flash is flash]
        if incs:
            ax.scatter([axis.hours(i.node, i.down, i.clock) for i in incs], [row[i.node] + 0.3 for i in incs], s=30,
                       marker=marker, color="green" if flash else "black", label=f"{label} ({len(incs)})")
    ax.set_yticks(range(len(names)), [n + (" *" if n in axis.own_clock else "") for n in names])
    ax.set_ylim(-0.7, len(names) - 0.3)
    ax.set_xlim(*axis.xlim)
    ax.set_xlabel(axis.label)
    ax.set_title("Xid and InfiniBand events per node")
    if ax.get_legend_handles_labels()[0]:  # nothing to name on a quiet log
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    atomic_write(str(path), lambda f: fig.savefig(f, format="png", dpi=110))
    return axis
