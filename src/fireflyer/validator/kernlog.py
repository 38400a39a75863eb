"""The kernel-log reader: time stamps, host names and NVIDIA Xid lines.

One reader for both users: the ``xid`` health check (:mod:`fireflyer.validator.checks.xid_log`),
which wants the Xids since a time, and the failure analysis (:mod:`fireflyer.validator.failures`),
which counts every line. Text in, data out; reading files and the clock is the callers' part.

**Time stamps.** A kernel log line starts with one of these:

* ``dmesg``: ``[12345.678901] msg``, seconds since *boot*. With a boot time these become
  wall-clock times; without one they stay on the boot clock (:data:`Clock` ``"boot"``).
* ``dmesg -T``: ``[Mon Oct  2 10:11:12 2023] msg``, wall clock with the year.
* journalctl / syslog ``short``: ``Oct 02 10:11:12 host kernel: msg``, wall clock *without* a
  year, usually with the host name, which names the node. The year comes from
  :class:`ParseOptions` (a given year, or the current one); a month that goes backwards
  (Dec → Jan) starts a new year.
* ISO 8601 (journalctl ``short-iso``, rsyslog): ``2023-10-02T10:11:12+08:00 host kernel: msg``.

**Wall-clock times without a zone** (``dmesg -T``, ``short``, an ISO stamp with no offset) are
read as **UTC**, by both users: the log does not say which zone its writer ran in, and the
analysis only needs differences between them. A reader that knows better passes zone-aware
times (``--since``, ``--boot-time``) and reads ``dmesg``'s boot-relative seconds or
``short-iso``, which carry their own reference.

**Xids.** ``NVRM: Xid (PCI:0000:65:00): 74, pid=..., name=..., msg`` is an Xid of code 74 on
the GPU at PCI address ``0000:65:00``. A line that says ``NVRM: Xid`` but does not parse is
:func:`xid_event`'s ``None``; the analysis counts it as malformed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal
from fireflyer.errors import UserError

Clock = Literal["wall", "boot"]
"""``wall``: seconds since the Unix epoch. ``boot``: seconds since the node booted."""

XID_MARK = "NVRM: Xid"
"""What every Xid line says; a line with it that :data:`XID_RE` does not match is malformed."""

XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?([^)]*)\): (\d+)(?:,\s*(.*))?$")
"""An Xid message: the GPU's PCI address (the driver's ``PCI:`` prefix left out), the code, the rest."""

_PID = re.compile(r"pid=(\d+)")
_NAME = re.compile(r"name=([^,]*)")


@dataclass(frozen=True, kw_only=True)
class ParseOptions:
    """How to turn a log's time stamps into times."""

    boot_time: datetime | None = None
    """When the node booted; turns dmesg's boot-relative seconds into wall-clock times."""
    year: int | None = None
    """Year for time stamps without one (journalctl ``short``)."""
    year_is_last: bool = False
    """If true, ``year`` is the year of the log's *last* such line (a file's mtime), else of its first."""
    now: datetime | None = None
    """For a live log (no ``year``): its year-less stamps end at ``now``, so the last one is in
    ``now``'s year, or the year before if that would put it more than a day after ``now``."""
    node: str = "unknown"
    """Node name for lines without a host field."""


@dataclass(frozen=True, kw_only=True)
class Line:
    """One non-blank line of a kernel log."""

    line_no: int
    time: float | None
    """On :attr:`clock`; None: no recognisable time stamp, or one that is not a real date."""
    clock: Clock | None
    host: str | None
    """The host field of a journalctl/syslog line (it names the node); None where the format has none."""
    body: str
    """The message after the time stamp (and host and program); the whole line when it has no stamp."""
    marker: bool = False
    """A journal marker such as ``-- Boot 0123... --``, not a log line."""


@dataclass(frozen=True, kw_only=True)
class XidEvent:
    """One Xid line."""

    node: str
    time: float | None
    """On :attr:`clock`; None if the line had no usable time stamp."""
    clock: Clock | None
    pci: str
    """The GPU's PCI address, e.g. ``0000:65:00``."""
    code: int
    pid: int | None
    process: str | None
    message: str
    """Everything after the code: ``pid=..., name=..., <text>``."""
    line_no: int

    @property
    def when(self) -> datetime | None:
        """The wall-clock time (UTC); None for an undated line or one on the boot clock."""
        if self.time is None or self.clock != "wall":
            return None
        return datetime.fromtimestamp(self.time, timezone.utc)


# ---------------------------------------------------------------- time stamps

_MONTHS = {m: i for i, m in enumerate(["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"], start=1)}
_RAW = re.compile(r"^\[\s*(\d+\.\d+)\]\s?(.*)$")
_DMESG_T = re.compile(r"^\[[A-Z][a-z]{2} ([A-Z][a-z]{2}) +(\d{1,2}) (\d{2}):(\d{2}):(\d{2}) (\d{4})\]\s?(.*)$")
# "host program[pid]: " after a short or ISO stamp; a host never ends in ':' (so "kernel: msg" is a body)
_HOST = r"(?:(\S*[^\s:]) ([^:\s\[]+)(?:\[\d+\])?: ?)?"
_SHORT = re.compile(r"^([A-Z][a-z]{2}) +(\d{1,2}) (\d{2}):(\d{2}):(\d{2})(\.\d+)? " + _HOST + r"(.*)$")
_ISO = re.compile(r"^(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?) " + _HOST + r"(.*)$")
_INNER_RAW = re.compile(r"^\[\s*\d+\.\d+\]\s?")  # kern.log repeats the boot stamp after "kernel:"


def _epoch(year: int, month: int, day: int, h: int, m: int, s: int, frac: float = 0.0) -> float:
    return datetime(year, month, day, h, m, s, tzinfo=timezone.utc).timestamp() + frac


def aware(t: datetime) -> datetime:
    """``t`` with a zone: a zone-less time is read as UTC (this module's rule), a zone-aware one kept."""
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


@dataclass(frozen=True)
class _Stamped:
    line_no: int
    time: float | None  # None: a short stamp whose year is still to be resolved
    clock: Clock
    host: str | None
    body: str
    short: tuple[int, int, int, int, int, float] | None = None  # month, day, h, m, s, frac


def _stamp(line_no: int, line: str, boot: float | None) -> _Stamped | None:
    """Split a line into time stamp, host and message, or ``None`` if it has no recognisable stamp.

    Raises ``ValueError`` for a stamp of the right shape that is not a real date.
    """
    if m := _RAW.match(line):
        rel = float(m.group(1))
        if boot is None:
            return _Stamped(line_no, rel, "boot", None, m.group(2))
        return _Stamped(line_no, boot + rel, "wall", None, m.group(2))
    if m := _DMESG_T.match(line):
        mon = _MONTHS.get(m.group(1))
        if mon is None:
            raise UserError(f"no month {m.group(1)!r}")
        t = _epoch(int(m.group(6)), mon, int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5)))
        return _Stamped(line_no, t, "wall", None, m.group(7))
    if m := _SHORT.match(line):
        mon = _MONTHS.get(m.group(1))
        if mon is None:
            raise UserError(f"no month {m.group(1)!r}")
        frac = float(m.group(6)) if m.group(6) else 0.0
        parts = (mon, int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5)), frac)
        _epoch(2000, *parts)  # leap year: rejects Feb 30 and 25:00 now, accepts Feb 29
        return _Stamped(line_no, None, "wall", m.group(7), _INNER_RAW.sub("", m.group(9)), parts)
    if m := _ISO.match(line):
        stamp = m.group(1).replace(",", ".")
        dt = aware(datetime.fromisoformat(stamp[:-1] + "+00:00" if stamp.endswith("Z") else stamp))
        return _Stamped(line_no, dt.timestamp(), "wall", m.group(2), _INNER_RAW.sub("", m.group(4)))
    return None


def _resolve_years(stamped: list[_Stamped], options: ParseOptions) -> list[_Stamped]:
    """Give year-less stamps a year: the base year plus the rollovers (month going backwards) so far."""
    shorts = [s for s in stamped if s.short is not None]
    if not shorts:
        return stamped
    rollovers, prev = [], 0
    for s in shorts:
        month = s.short[0]  # type: ignore[index]
        rollovers.append((rollovers[-1] if rollovers else 0) + (1 if month < prev else 0))
        prev = month
    if options.year is not None:
        base, is_last = options.year, options.year_is_last
    elif options.now is not None:
        now = aware(options.now)
        base, is_last = now.astimezone(timezone.utc).year, True
        try:
            if _epoch(base, *shorts[-1].short) > now.timestamp() + 86400:  # type: ignore[misc]
                base -= 1  # the log's last line is from last year (it ended before New Year)
        except ValueError:
            pass
    else:
        base, is_last = datetime.now(timezone.utc).year, options.year_is_last
    if is_last:
        base -= rollovers[-1]
    years = {id(s): base + r for s, r in zip(shorts, rollovers)}
    out = []
    for s in stamped:
        if s.short is None:
            out.append(s)
            continue
        mon, day, h, mi, sec, frac = s.short
        try:
            t = _epoch(years[id(s)], mon, day, h, mi, sec, frac)
        except ValueError:  # Feb 29 in a year that has none
            t = None
        out.append(_Stamped(s.line_no, t, "wall", s.host, s.body))
    return out


def read_lines(text: str, options: ParseOptions = ParseOptions()) -> Iterator[Line]:
    """Every non-blank line of ``text`` with its time, host and message, in order. Never raises on content."""
    boot = options.boot_time.timestamp() if options.boot_time is not None else None
    entries: list[_Stamped | Line] = []
    stamped: list[_Stamped] = []
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip()
        if not line.strip():
            continue
        if line.startswith("-- "):  # journalctl markers: "-- Boot 1a2b... --", "-- Logs begin at ..."
            entries.append(Line(line_no=line_no, time=None, clock=None, host=None, body=line, marker=True))
            continue
        try:
            s = _stamp(line_no, line, boot)
        except ValueError:
            s = None
        if s is None:
            entries.append(Line(line_no=line_no, time=None, clock=None, host=None, body=line))
        else:
            entries.append(s)
            stamped.append(s)
    resolved = {s.line_no: s for s in _resolve_years(stamped, options)}
    for e in entries:
        if isinstance(e, Line):
            yield e
            continue
        s = resolved[e.line_no]
        yield Line(line_no=s.line_no, time=s.time, clock=s.clock if s.time is not None else None,
                   host=s.host, body=s.body)


# ---------------------------------------------------------------- Xids

def xid_event(line: Line, *, node: str) -> XidEvent | None:
    """The Xid on ``line``, or None if it has none or one that does not parse (see :data:`XID_MARK`)."""
    if XID_MARK not in line.body:
        return None
    m = XID_RE.search(line.body)
    if m is None:
        return None
    rest = (m.group(3) or "").strip()
    pid, name = _PID.search(rest), _NAME.search(rest)
    return XidEvent(
        node=line.host or node, time=line.time, clock=line.clock, pci=m.group(1).strip(), code=int(m.group(2)),
        pid=int(pid.group(1)) if pid else None, process=name.group(1).strip() if name else None,
        message=rest, line_no=line.line_no,
    )


def parse_xids(text: str, options: ParseOptions = ParseOptions()) -> list[XidEvent]:
    """Every Xid of ``text`` in order, dated or not (an undated one has ``time`` None)."""
    return [e for line in read_lines(text, options) if not line.marker
            and (e := xid_event(line, node=options.node)) is not None]
