"""Xid errors in the kernel log since a given time.

The NVIDIA driver reports GPU faults as kernel log lines ``NVRM: Xid (PCI:0000:65:00): 79,
pid=..., GPU has fallen off the bus``. This check reads the log (a given file, else ``dmesg``,
else ``journalctl -k``), keeps the Xid lines at or after ``since``, and grades them: a
hardware Xid that needs the node drained (fallen off the bus, double-bit ECC, NVLink, GSP
timeouts, ...) FAILs, any other Xid (usually an application fault such as 13/31/43) WARNs.
The full analysis of Xid history lives in ``fireflyer failures``; both read the log with
:mod:`fireflyer.validator.kernlog` (its time stamps, and zone-less times read as UTC).

Which Xids FAIL is :data:`DRAIN_XIDS`: every code whose catalogued operator action
(:mod:`fireflyer.validator.xid`) is to drain the node.
"""

from __future__ import annotations

import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar

from fireflyer.validator import kernlog
from fireflyer.validator.checks.base import Check, CheckContext, Findings, SkipCheck
from fireflyer.validator.kernlog import XidEvent
from fireflyer.validator.xid import CATALOGUE, Action

DRAIN_XIDS = sorted(code for code, x in CATALOGUE.items() if x.action is Action.DRAIN)
"""Xids that mean a hardware fault: take the node out of scheduling (the catalogue's ``drain`` action)."""


def parse_xids(text: str, *, boot_time: datetime | None = None, now: datetime | None = None) -> list[XidEvent]:
    """Every Xid line of ``text`` in order; year-less stamps are taken to end by ``now`` (default: the clock)."""
    return kernlog.parse_xids(text, kernlog.ParseOptions(boot_time=boot_time, now=now or datetime.now(timezone.utc)))


def since_filter(events: list[XidEvent], since: datetime | None) -> tuple[list[XidEvent], int]:
    """Events at or after ``since``, and how many undated events were left out (none if ``since`` is None).

    An event on the boot clock (no boot time known) counts as undated; a zone-less ``since`` is UTC.
    """
    if since is None:
        return list(events), 0
    since = kernlog.aware(since)
    kept = [e for e in events if e.when is not None and e.when >= since]
    return kept, sum(1 for e in events if e.when is None)


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
            cmd.append(f"--since={kernlog.aware(since).astimezone().strftime('%Y-%m-%d %H:%M:%S')}")  # journalctl: local
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
        events = [e for e in events if e.code not in ignore]
        drain = set(ctx.param("fail_xids"))
        out.metric("count", len(events), grade_it=False)
        out.details.update(source=source, since=since.isoformat() if since else None, undated_skipped=undated,
                           events=[{"time": e.when.isoformat() if e.when else None, "pci": e.pci, "xid": e.code,
                                    "message": e.message} for e in events[-50:]])
        by_code: dict[int, set[str]] = {}
        for e in events:
            by_code.setdefault(e.code, set()).add(e.pci)
        for code in sorted(by_code):
            n = sum(1 for e in events if e.code == code)
            text = f"Xid {code} x{n} on {', '.join(sorted(by_code[code]))}"
            (out.fail if code in drain else out.warn)(text + (" (hardware: drain)" if code in drain else ""))
        out.note(f"{len(events) or 'no'} Xid errors in {source}" + (f" since {since:%Y-%m-%d %H:%M}" if since else ""))
        if undated:
            out.note(f"{undated} Xid lines without a time were left out")
