"""``fireflyer failures``: Xid and InfiniBand failure analysis of kernel logs, and synthetic logs.

Analyse::

    fireflyer failures LOG... [--json] [--plot PNG] [--boot-time ISO] [--year YYYY] [--node NAME]
                              [--save-cost SECONDS] [--job-nodes N] [--window SECONDS] [--hours H]

Generate synthetic logs with the paper's Xid mix (and a ``truth.json`` of what is in them)::

    fireflyer failures --synthesize N [--nodes K] [--seed S] [--days D] [--malformed M] --out DIR

This module is the I/O edge: it reads files and the checkpoint benchmark's JSON, prints, and
draws the timeline. The analysis itself is :mod:`fireflyer.validator.failures`. The synthetic
logs come from the testing wing (its ``synthlog`` module), which a runtime part does
not import: the ``fireflyer`` command passes its generator in as ``main(..., synthesize=...)``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from fireflyer.cliutil import ArgumentParser, plural
from fireflyer.errors import UserError
from fireflyer.fsutil import atomic_write
from fireflyer.validator.failures import (
    DEFAULT_FLASH_WINDOW_S,
    Analysis,
    ParsedLog,
    ParseOptions,
    analyse,
    daly_interval,
    mtbf_hours,
    parse_log,
    xid_class_totals,
    xid_table,
    young_daly_interval,
)
from fireflyer.validator.timeline import plot_timeline
from fireflyer.validator.xid import XidClass, lookup

CHECKPOINT_JSON = Path("benchmarks/results/checkpoint.json")
DEFAULT_SAVE_COST_S = 5.0
"""Save cost when neither --save-cost nor the checkpoint benchmark gives one: the paper's "a few seconds"."""
_SAVE_COST_FIELDS = ("stall_if_step_at_once_s", "stall_s", "sync_save_s")  # the first present wins


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="fireflyer failures",
        description="Count Xid and InfiniBand failures in kernel logs (dmesg, dmesg -T, journalctl), per node and in "
        "total, with NVIDIA's recommended action per Xid, MTBF and the Young/Daly checkpoint interval.",
    )
    p.add_argument("logs", nargs="*", metavar="LOG", help="log files, directories (their *.log files) or - for stdin")
    p.add_argument("--json", action="store_true", help="print the analysis as JSON")
    p.add_argument("--plot", metavar="PNG", type=Path, help="write a timeline of the events to this PNG")
    p.add_argument("--node", help="node name for lines without a host field (default: the file name up to its first dot)")
    p.add_argument("--boot-time", metavar="ISO", type=_iso, help="boot time for dmesg's seconds-since-boot stamps "
                   "(default: keep them on the boot clock, relative)")
    p.add_argument("--year", type=int, help="year of the first journalctl line without a year (default: the year of the "
                   "file's mtime, taken as the year of its last line)")
    p.add_argument("--window", type=_positive, default=DEFAULT_FLASH_WINDOW_S, metavar="SECONDS",
                   help=f"an IB link back up within this is a flash cut, else an outage (default {DEFAULT_FLASH_WINDOW_S:g})")
    p.add_argument("--hours", type=_positive, metavar="H", help="observed hours per node (default: each log's first to last stamp)")
    p.add_argument("--save-cost", type=_non_negative, metavar="SECONDS", help="checkpoint save cost C (default: "
                   f"{'/'.join(_SAVE_COST_FIELDS)} from {CHECKPOINT_JSON} if present, else {DEFAULT_SAVE_COST_S:g} s)")
    p.add_argument("--checkpoint-json", type=Path, default=None, metavar="PATH",
                   help=f"the checkpoint benchmark's JSON for the save cost (default {CHECKPOINT_JSON}, if it is there)")
    p.add_argument("--job-nodes", type=int, metavar="N", help="nodes one job spans, for its MTBF (default: every node seen)")
    g = p.add_argument_group("synthetic logs")
    g.add_argument("--synthesize", type=int, metavar="N", help="write logs with N Xid events in the paper's mix instead")
    g.add_argument("--nodes", type=int, default=4, help="nodes to spread them over (default 4)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    g.add_argument("--days", type=_positive, default=30.0, help="days the logs span (default 30)")
    g.add_argument("--malformed", type=int, default=0, help="malformed lines to mix in (default 0)")
    g.add_argument("--out", type=Path, metavar="DIR", help="directory for the synthetic logs")
    return p


def _iso(text: str) -> datetime:
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an ISO time like 2023-10-01T08:00:00") from None
    return dt if dt.tzinfo is not None else dt.replace(tzinfo=timezone.utc)


def _positive(text: str) -> float:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


# ---------------------------------------------------------------- inputs

def _log_paths(items: list[str]) -> list[str]:
    out: list[str] = []
    for item in items:
        path = Path(item)
        if item != "-" and path.is_dir():
            found = sorted(str(p) for p in path.glob("*.log"))
            if not found:
                raise UserError(f"no *.log files in directory {item}")
            out += found
        else:
            out.append(item)
    return out


def read_logs(items: list[str], *, node: str | None, boot_time: datetime | None, year: int | None) -> list[ParsedLog]:
    """Read and parse each log. An unreadable file is a :class:`UserError`."""
    logs = []
    for item in _log_paths(items):
        if item == "-":
            text, name, mtime_year = sys.stdin.read(), node or "stdin", datetime.now(timezone.utc).year
        else:
            try:
                raw = Path(item).read_bytes()
                mtime_year = datetime.fromtimestamp(os.stat(item).st_mtime, timezone.utc).year
            except OSError as exc:
                raise UserError(f"cannot read log {item}: {exc.strerror or exc}") from None
            text, name = raw.decode("utf-8", errors="replace"), node or Path(item).name.split(".")[0] or item
        options = ParseOptions(boot_time=boot_time, year=year if year is not None else mtime_year,
                               year_is_last=year is None, node=name)
        logs.append(parse_log(text, source=item, options=options))
    return logs


def save_cost(flag: float | None, path: Path | None) -> tuple[float, str]:
    """The checkpoint save cost C and where it came from: the flag, the benchmark's JSON, or the default.

    A JSON the user named (``path`` given) must be readable; the default one may be missing."""
    if flag is not None:
        return flag, "--save-cost"
    try:
        data = json.loads((path or CHECKPOINT_JSON).read_text())
    except (OSError, ValueError) as exc:
        if path is not None:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"not JSON ({exc})"
            raise UserError(f"--checkpoint-json {path}: {why}") from None
        return DEFAULT_SAVE_COST_S, "default (no readable checkpoint benchmark)"
    path = path or CHECKPOINT_JSON
    for name in _SAVE_COST_FIELDS:
        value = _find_number(data, name)
        if value is not None:
            return value, f"{path}: {name}"
    return DEFAULT_SAVE_COST_S, f"default ({path} has no {' or '.join(_SAVE_COST_FIELDS)})"


def _find_number(data: Any, key: str) -> float | None:
    """The first non-negative number under ``key`` anywhere in a JSON document (depth first)."""
    if isinstance(data, dict):
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
            return float(value)
        children = list(data.values())
    elif isinstance(data, list):
        children = data
    else:
        return None
    for child in children:
        found = _find_number(child, key)
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------- report

def report(analysis: Analysis, logs: list[ParsedLog], *, save_cost_s: float, save_cost_source: str,
           job_nodes: int | None, window_s: float) -> dict[str, Any]:
    """The whole analysis as JSON-ready data (the ``--json`` output)."""
    def rows(counts: dict[int, int]) -> list[dict[str, Any]]:
        return [r.__dict__ for r in xid_table(counts)]

    node_hours = analysis.node_hours
    per_node = mtbf_hours(node_hours, analysis.interruptions)
    k = job_nodes if job_nodes is not None else max(1, len(analysis.nodes))
    job = per_node / k if per_node is not None else None
    young = daly = None
    if job is not None and job > 0:
        young = young_daly_interval(save_cost_s, job * 3600.0)
        daly = daly_interval(save_cost_s, job * 3600.0)
    clocks = sorted(analysis.clocks)
    return {
        "clock": clocks[0] if len(clocks) == 1 else ("mixed" if clocks else "none"),
        "lines": analysis.lines, "noise": analysis.noise, "malformed": analysis.malformed,
        "logs": [{"source": g.source, "lines": g.lines, "noise": g.noise, "malformed": g.malformed} for g in logs],
        "total": {
            "xids": {str(c): n for c, n in sorted(analysis.xids.items())}, "events": sum(analysis.xids.values()),
            "classes": xid_class_totals(analysis.xids), "table": rows(analysis.xids),
            "flash_cuts": sum(n.flash_cuts for n in analysis.nodes.values()),
            "outages": sum(n.outages for n in analysis.nodes.values()),
            "interruptions": analysis.interruptions, "node_hours": node_hours,
        },
        "nodes": {
            name: {
                "xids": {str(c): v for c, v in sorted(n.xids.items())}, "classes": xid_class_totals(n.xids),
                "table": rows(n.xids), "flash_cuts": n.flash_cuts, "outages": n.outages,
                "interruptions": n.interruptions, "hours": n.hours, "clock": n.clock,
                "mtbf_hours": mtbf_hours(n.hours, n.interruptions),
            }
            for name, n in analysis.nodes.items()
        },
        "actions": {
            str(code): {"name": x.mnemonic, "class": x.xid_class.value, "action": x.action.value,
                        "nvidia_action": x.nvidia_action, "fatal": x.fatal, "meaning": x.meaning}
            for code in sorted(analysis.xids) for x in [lookup(code)]
        },
        "ib_window_s": window_s,
        "mtbf": {"node_hours": node_hours, "interruptions": analysis.interruptions, "per_node_hours": per_node,
                 "job_nodes": k, "job_hours": job},
        "checkpoint": {"save_cost_s": save_cost_s, "save_cost_source": save_cost_source,
                       "young_interval_s": young, "daly_interval_s": daly},
    }


def _fmt_h(hours: float | None) -> str:
    if hours is None:
        return "-"
    return f"{hours:,.1f} h" if hours >= 1 else f"{hours * 60:.1f} min"


def _count_pct(count: int, total: int) -> str:
    return f"{count} {100 * count / total:.0f}%" if total and count else str(count)


def render_text(rep: dict[str, Any]) -> str:
    """The human-readable report."""
    out = []
    clock = {"boot": "seconds since boot (no --boot-time)", "wall": "wall clock", "mixed": "mixed: some logs on the "
             "boot clock (give --boot-time)", "none": "none"}[rep["clock"]]
    out.append(f"{plural(len(rep['logs']), 'log')}, {plural(rep['lines'], 'line')}: {rep['total']['events']} Xid events, "
               f"{rep['noise']} other lines, {rep['malformed']} malformed lines skipped; times: {clock}")
    out.append("")
    out.append(f"{'class':<14}{'Xid':>5}{'count':>8}{'%':>8}{'paper %':>9}  {'action':<12}{'NVIDIA action':<28}fatal")
    for r in rep["total"]["table"]:
        paper = "-" if r["paper_percent"] is None else f"{r['paper_percent']:.2f}"
        fatal = {True: "yes", False: "no", None: "-"}[r["fatal"]]
        out.append(f"{r['xid_class']:<14}{r['code']:>5}{r['count']:>8}{r['percent']:>8.2f}{paper:>9}  "
                   f"{r['action']:<12}{r['nvidia_action']:<28}{fatal}")
    out.append(f"{'total':<19}{rep['total']['events']:>8}{100.0 if rep['total']['events'] else 0.0:>8.2f}")
    out.append("")
    classes = [c.value for c in XidClass]
    short = {"NVLink Error": "NVLink", "Uncorrectable": "Uncorr", "Unclassified": "Other"}
    head = f"{'node':<12}" + "".join(f"{short.get(c, c):>10}" for c in classes) + f"{'flash':>7}{'outage':>7}{'hours':>10}{'MTBF':>11}"
    out.append(head)
    for name, n in rep["nodes"].items():
        total = sum(n["classes"].values())
        cells = "".join(f"{_count_pct(n['classes'].get(c, 0), total):>10}" for c in classes)
        out.append(f"{name:<12}{cells}{n['flash_cuts']:>7}{n['outages']:>7}{n['hours']:>10.1f}{_fmt_h(n['mtbf_hours']):>11}")
    out.append("")
    t, m, c = rep["total"], rep["mtbf"], rep["checkpoint"]
    out.append(f"InfiniBand: {plural(t['flash_cuts'], 'flash cut')} (back up within {rep['ib_window_s']:g} s), "
               f"{plural(t['outages'], 'outage')}")
    out.append(f"MTBF: {m['node_hours']:,.1f} node-hours / "
               f"{plural(m['interruptions'], 'job-stopping failure')} "
               f"= {_fmt_h(m['per_node_hours'])} per node; a job on {plural(m['job_nodes'], 'node')}: {_fmt_h(m['job_hours'])}")
    if c["young_interval_s"] is None:
        out.append(f"checkpoint: save cost {c['save_cost_s']:g} s ({c['save_cost_source']}); no failures, no interval")
    else:
        out.append(f"checkpoint: save cost {c['save_cost_s']:g} s ({c['save_cost_source']}); every "
                   f"{c['young_interval_s'] / 60:.1f} min (Young, sqrt(2*C*MTBF)), {c['daly_interval_s'] / 60:.1f} min (Daly)")
    return "\n".join(out)


# ---------------------------------------------------------------- synthetic logs

def _write_text(path: Path, text: str) -> None:
    data = text.encode()
    atomic_write(str(path), lambda f: f.write(data), tmp_name=f".{path.name}.{os.getpid()}.tmp")


Synthesizer = Callable[..., Any]
"""``synthesize(xids=, nodes=, seed=, days=, malformed=)``: a synthetic log set with ``files``
(name → text), ``truth()``, ``xids``, ``boot_time`` and ``year``; ``ValueError`` for a bad setting."""


def _synthesize(args: Any, generate: Synthesizer | None) -> int:
    if args.out is None:
        raise UserError("--synthesize needs --out DIR")
    if args.logs:
        raise UserError("give either LOG files or --synthesize, not both")
    if generate is None:
        raise UserError("--synthesize is served by the fireflyer command: fireflyer failures --synthesize N --out DIR")
    try:
        log = generate(xids=args.synthesize, nodes=args.nodes, seed=args.seed, days=args.days, malformed=args.malformed)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        for name, text in log.files.items():
            _write_text(args.out / name, text)
        _write_text(args.out / "truth.json", json.dumps(log.truth(), indent=2) + "\n")
    except OSError as exc:
        raise UserError(f"cannot write to {args.out}: {exc.strerror or exc}") from None
    print(f"wrote {len(log.files)} logs ({sum(log.xids.values())} Xids) and truth.json to {args.out}; analyse with:")
    print(f"  fireflyer failures {args.out} --boot-time {log.boot_time.isoformat()} --year {log.year}")
    return 0


def main(argv: list[str], *, synthesize: Synthesizer | None = None) -> int:
    """Run ``fireflyer failures``; bad input raises :class:`UserError`, which the CLI prints as one line.

    ``synthesize`` generates the logs of ``--synthesize`` (the ``fireflyer`` command passes the
    testing wing's generator); without it ``--synthesize`` is a :class:`UserError`.
    """
    args = build_parser().parse_args(argv)
    if args.synthesize is not None:
        return _synthesize(args, synthesize)
    if not args.logs:
        raise UserError("give at least one LOG (or --synthesize N --out DIR); see fireflyer failures --help")
    if args.job_nodes is not None and args.job_nodes < 1:
        raise UserError(f"--job-nodes must be >= 1, got {args.job_nodes}")
    logs = read_logs(args.logs, node=args.node, boot_time=args.boot_time, year=args.year)
    analysis = analyse(logs, window_s=args.window, hours_per_node=args.hours)
    cost, source = save_cost(args.save_cost, args.checkpoint_json)
    rep = report(analysis, logs, save_cost_s=cost, save_cost_source=source, job_nodes=args.job_nodes, window_s=args.window)
    if args.plot is not None:
        try:
            # without --boot-time or --year the logs' clocks may not agree: each node then keeps its own
            plot_timeline(analysis, args.plot, aligned=args.boot_time is not None or args.year is not None)
        except OSError as exc:
            raise UserError(f"cannot write plot {args.plot}: {exc.strerror or exc}") from None
    print(json.dumps(rep, indent=2) if args.json else render_text(rep))
    return 0
