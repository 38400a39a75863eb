"""``fireflyer validate``: run this node's health checks; usable as Slurm's HealthCheckProgram.

Exit codes: 0 when the node is healthy (every check PASS, WARN or SKIP), 1 when a check FAILs
(or WARNs, with ``--warn-is-failure``), 2 for bad usage. A WARN alone keeps the node in
service: it flags a node to look at, not one to drain. On failure the ``--drain`` command runs.
"""

from __future__ import annotations

import re
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

from fireflyer.cliutil import ArgumentParser
from fireflyer.errors import UserError
from fireflyer.validator import kernlog

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")


def parse_since(text: str) -> datetime:
    """``--since``: an ISO time (``2024-05-06T10:00``; UTC unless it carries an offset, like the
    kernel log's own zone-less stamps), or an age like ``30m``, ``24h``, ``7d``."""
    if m := _RELATIVE.match(text.strip()):
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m.group(2)]
        return datetime.now().astimezone() - timedelta(**{unit: float(m.group(1))})
    try:
        t = datetime.fromisoformat(text.strip())
    except ValueError:
        raise UserError(f"--since {text!r}: give an ISO time (2024-05-06T10:00) or an age (30m, 24h, 7d)") from None
    return kernlog.aware(t)


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def build_parser() -> ArgumentParser:
    from fireflyer.validator.checks import ALL_CHECKS

    p = ArgumentParser(
        prog="fireflyer validate",
        description="Check this node's health against a hardware profile (paper section VII-B). "
                    "Exit 0: healthy (PASS/WARN/SKIP); 1: a check FAILed; 2: bad usage.")
    p.add_argument("--checks", type=_names, default=None, metavar="A,B",
                   help=f"run only these checks (default: all that apply): {', '.join(ALL_CHECKS)}")
    p.add_argument("--skip", type=_names, default=[], metavar="A,B", help="leave these checks out")
    p.add_argument("--profile", default=None, metavar="NAME|PATH.toml",
                   help="hardware profile: a built-in name or a TOML file (default: generic-cpu without "
                        "GPUs, else the built-in matching the GPUs, else generic-gpu)")
    p.add_argument("--quick", action="store_true", help="short budgets and small sizes")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of a table")
    p.add_argument("--drain", default=None, metavar="CMD",
                   help="command run (no shell) when the node fails; {reason} and {hostname} are "
                        "replaced, and the reason is also in $FIREFLYER_DRAIN_REASON")
    p.add_argument("--warn-is-failure", action="store_true", help="treat WARN as FAIL (exit code and drain)")
    p.add_argument("--storage-path", default=None, metavar="DIR", help="directory for the storage check")
    p.add_argument("--storage-mb", type=int, default=None, metavar="MB", help="size of the storage check's file")
    p.add_argument("--xid-log", default=None, metavar="FILE", help="read Xid lines from FILE, not dmesg/journalctl")
    p.add_argument("--since", type=parse_since, default=None, metavar="TIME",
                   help="count Xid errors from TIME: ISO time (UTC unless it has an offset) or an age (24h, 7d); "
                        "default: the whole log")
    p.add_argument("--ranks", type=int, default=None, metavar="N", help="ranks of the allreduce check")
    p.add_argument("--budget-scale", type=float, default=1.0, metavar="X", help="multiply every time budget")
    p.add_argument("--sysfs-root", default="/sys", metavar="DIR", help=argparse_suppress())
    p.add_argument("--list", action="store_true", help="list the checks and built-in profiles, then exit")
    return p


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


def _list() -> int:
    from fireflyer.validator.checks import ALL_CHECKS
    from fireflyer.validator.profiles import builtin_profiles, load_profile

    print("checks:")
    for name, cls in ALL_CHECKS.items():
        print(f"  {name:<17} {cls.title}" + (" (GPU)" if cls.needs_gpu else ""))
    print("profiles:")
    for name in builtin_profiles():
        print(f"  {name:<17} {load_profile(name).description}")
    return 0


def main(argv: list[str]) -> int:
    """Entry point of ``fireflyer validate``; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.list:
        return _list()
    from fireflyer.validator.checks import RunOptions
    from fireflyer.validator.checks.gpu_common import gpu_names
    from fireflyer.validator.drain import parse_drain_command, run_drain
    from fireflyer.validator.grading import Status, node_status
    from fireflyer.validator.profiles import default_profile_name, load_profile
    from fireflyer.validator.report import Report
    from fireflyer.validator.runner import run_checks, select_checks

    names = select_checks(args.checks, args.skip)
    if args.xid_log is not None and not Path(args.xid_log).is_file():
        raise UserError(f"--xid-log {args.xid_log}: no such file")
    drain_argv = parse_drain_command(args.drain) if args.drain is not None else None
    profile = load_profile(args.profile or default_profile_name(gpu_names()))
    try:
        options = RunOptions(quick=args.quick, storage_path=args.storage_path, storage_mb=args.storage_mb,
                             xid_log=args.xid_log, since=args.since, sysfs_root=args.sysfs_root,
                             ranks=args.ranks, budget_scale=args.budget_scale)
    except ValueError as exc:
        raise UserError(str(exc)) from exc

    started, t0 = datetime.now().astimezone(), time.monotonic()
    progress = None
    if not args.json and sys.stderr.isatty():
        def progress(r) -> None:
            print(f"  {r.name}: {r.status} ({r.seconds:.1f}s)", file=sys.stderr)
    results = run_checks(profile, options, names, on_result=progress, explicit=args.checks is not None)
    report = Report(profile=profile.name, profile_source=profile.source, quick=args.quick, started=started,
                    results=results, status=node_status(results, warn_is_failure=args.warn_is_failure),
                    seconds=time.monotonic() - t0)
    if report.status == Status.FAIL and drain_argv is not None:
        report.drain = run_drain(drain_argv, report.failure_reason(), status=str(report.status))
    if args.json:
        report.write_json(sys.stdout)
    else:
        report.print_table()
    return report.exit_code
