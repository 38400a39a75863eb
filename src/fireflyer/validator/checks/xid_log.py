"""Xid errors in the kernel log since a given time.

The NVIDIA driver reports GPU faults as kernel log lines ``NVRM: Xid (PCI:0000:65:00): 79,
pid=..., GPU has fallen off the bus``. This check reads the log (a given file, else ``dmesg``,
else ``journalctl -k``), keeps the Xid lines at or after ``since``, and grades them: a
hardware Xid that needs the node drained (fallen off the bus, double-bit ECC, NVLink, GSP
timeouts, ...) FAILs, any other Xid (usually an application fault such as 13/31/43) WARNs.
The full analysis of Xid history lives in ``fireflyer failures``; this parser is deliberately
small and only needs each line's time, PCI address and code.

Timestamps understood: ISO 8601 (``journalctl -o short-iso``, rsyslog), ``dmesg`` seconds since
boot (``[12345.678]``, turned into wall time with the boot time), ``dmesg -T``
(``[Mon May  6 10:00:00 2024]``) and classic syslog (``May  6 10:00:00 host kernel:``, the
year assumed current).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

from fireflyer.validator.checks.base import Check, CheckContext, Findings, SkipCheck

DRAIN_XIDS = [46, 48, 61, 62, 64, 74, 79, 95, 119, 120, 140, 143, 144, 145, 146, 147, 148, 149, 150, 155, 158]
"""Xids that mean a hardware fault: take the node out of scheduling (see the research notes §3.3)."""

XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?([^)]*)\): (\d+)(?:, (.*))?")
_ISO_RE = re.compile(r"^(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:?\d{2})?)")
_MONO_RE = re.compile(r"^\[\s*(\d+\.\d+)\]")
_CTIME_RE = re.compile(r"^\[(\w{3} \w{3} [ \d]\d \d{2}:\d{2}:\d{2} \d{4})\]")
_SYSLOG_RE = re.compile(r"^(\w{3} [ \d]\d \d{2}:\d{2}:\d{2}) ")


@dataclass(frozen=True, kw_only=True)
class XidEvent:
    """One Xid line: when (None if the line has no time), which GPU, which code."""

    time: datetime | None
    pci: str
    xid: int
    message: str


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.astimezone()


def line_time(line: str, boot_time: datetime | None, now: datetime | None = None) -> datetime | None:
    """The wall-clock time a kernel log line carries, timezone-aware; None if it has none."""
    if m := _ISO_RE.match(line):
        text = m.group(1).replace("Z", "+00:00")
        text = re.sub(r"([+-]\d{2})(\d{2})$", r"\1:\2", text)
        return _aware(datetime.fromisoformat(text))
    if m := _CTIME_RE.match(line):
        return _aware(datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y"))
    if m := _MONO_RE.match(line):
        return None if boot_time is None else boot_time + timedelta(seconds=float(m.group(1)))
    if m := _SYSLOG_RE.match(line):
        now = now or datetime.now().astimezone()
        t = _aware(datetime.strptime(f"{now.year} {m.group(1)}", "%Y %b %d %H:%M:%S"))
        return t.replace(year=now.year - 1) if t > now + timedelta(days=1) else t
    return None


def parse_xids(text: str, *, boot_time: datetime | None = None, now: datetime | None = None) -> list[XidEvent]:
    """Every Xid line of ``text`` in order."""
    events = []
    for line in text.splitlines():
        m = XID_RE.search(line)
        if m:
            events.append(XidEvent(time=line_time(line, boot_time, now), pci=m.group(1).strip(),
                                   xid=int(m.group(2)), message=(m.group(3) or "").strip()))
    return events


def since_filter(events: list[XidEvent], since: datetime | None) -> tuple[list[XidEvent], int]:
    """Events at or after ``since``, and how many undated events were left out (none if ``since`` is None)."""
    if since is None:
        return list(events), 0
    since = _aware(since)
    kept = [e for e in events if e.time is not None and e.time >= since]
    return kept, sum(1 for e in events if e.time is None)


def boot_time(procfs_root: str = "/proc") -> datetime | None:
    """When this machine booted (``btime`` of /proc/stat)."""
    try:
        for line in (Path(procfs_root) / "stat").read_text().splitlines():
            if line.startswith("btime "):
                return datetime.fromtimestamp(int(line.split()[1])).astimezone()
    except (OSError, ValueError):
        pass
    return None


def read_kernel_log(timeout: float, since: datetime | None) -> tuple[str, str]:
    """The kernel log as text and where it came from: ``dmesg``, else ``journalctl -k``.

    Raises SkipCheck when neither can be read (not installed, no permission).
    """
    tried = []
    if shutil.which("dmesg"):
        done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode == 0:
            return done.stdout, "dmesg"
        tried.append(f"dmesg: {done.stderr.strip() or f'exit {done.returncode}'}")
    if shutil.which("journalctl"):
        cmd = ["journalctl", "-k", "-q", "--no-pager", "-o", "short-iso"]
        if since is not None:
            cmd.append(f"--since={_aware(since).astimezone().strftime('%Y-%m-%d %H:%M:%S')}")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode == 0:
            return done.stdout, "journalctl -k"
        tried.append(f"journalctl: {done.stderr.strip() or f'exit {done.returncode}'}")
    raise SkipCheck("cannot read the kernel log (" + ("; ".join(tried) or "neither dmesg nor journalctl found")
                    + "); pass --xid-log FILE")


class XidErrors(Check):
    """No GPU Xid errors in the kernel log since ``--since``; drain-class Xids FAIL, others WARN."""

    name = "xid"
    title = "GPU Xid errors in the kernel log"
    metrics: ClassVar[dict[str, str]] = {"count": "events"}
    params: ClassVar[dict[str, Any]] = {"fail_xids": DRAIN_XIDS, "ignore_xids": []}
    budget_s = 10.0
    quick_budget_s = 5.0

    def _measure(self, ctx: CheckContext, out: Findings) -> None:
        since = ctx.options.since
        if ctx.options.xid_log:
            try:
                text = Path(ctx.options.xid_log).read_text(errors="replace")
            except OSError as exc:
                raise SkipCheck(f"cannot read {ctx.options.xid_log}: {exc.strerror}") from exc
            source = ctx.options.xid_log
        else:
            text, source = read_kernel_log(max(1.0, ctx.time_left()), since)
        events, undated = since_filter(parse_xids(text, boot_time=boot_time(ctx.options.procfs_root)), since)
        ignore = set(ctx.param("ignore_xids"))
        events = [e for e in events if e.xid not in ignore]
        drain = set(ctx.param("fail_xids"))
        out.metric("count", len(events), grade_it=False)
        out.details.update(source=source, since=since.isoformat() if since else None, undated_skipped=undated,
                           events=[{"time": e.time.isoformat() if e.time else None, "pci": e.pci, "xid": e.xid,
                                    "message": e.message} for e in events[-50:]])
        by_code: dict[int, set[str]] = {}
        for e in events:
            by_code.setdefault(e.xid, set()).add(e.pci)
        for code in sorted(by_code):
            n = sum(1 for e in events if e.xid == code)
            text = f"Xid {code} x{n} on {', '.join(sorted(by_code[code]))}"
            (out.fail if code in drain else out.warn)(text + (" (hardware: drain)" if code in drain else ""))
        out.note(f"{len(events) or 'no'} Xid errors in {source}" + (f" since {since:%Y-%m-%d %H:%M}" if since else ""))
        if undated:
            out.note(f"{undated} Xid lines without a time were left out")
