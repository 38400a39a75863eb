"""``fireflyer simulate goodput``: goodput of checkpoint-restart and of fault-tolerant training against GPU count.

Model a job of 1,000 to 100,000 GPUs failing at Fire-Flyer 2's rates (paper Tables VI-VII) or a given MTBF::

    fireflyer simulate goodput [--gpus 1000,2000,...] [--mtbf-gpu-hours H | --mtbf-node-hours H [--gpus-per-node 8]]
        [--hardware-only] [--restart-s S] [--checkpoint-write-s S] [--checkpoint-interval-s S]
        [--ft-stall-s S] [--rejoin-s S] [--measured FILE] [--replica-gpus G] [--json] [--plot PNG]

Check the model against FT-HSDP's published 44% -> 80% at O(100K) GPUs::

    fireflyer simulate goodput --reproduce ft-hsdp [--gpus ...] [--json] [--plot PNG]

This module is the I/O edge: it reads ``--measured`` (``fireflyer bench recovery``'s JSON), prints
and plots. The model is :mod:`fireflyer.validator.goodput`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from fireflyer.cliutil import ArgumentParser
from fireflyer.errors import UserError
from fireflyer.fsutil import atomic_write
from fireflyer.validator import goodput as gp

REPRODUCTIONS = {"ft-hsdp": gp.FT_HSDP}
DEFAULT_GPUS_PER_NODE = 8
_MEASURED_KEYS = {"stall_s": "ft_stall_s", "rejoin_s": "rejoin_s"}  # bench recovery's key -> Recovery's field
_RECOVERY_FLAGS = {"ft_stall_s": "--ft-stall-s", "rejoin_s": "--rejoin-s", "restart_s": "--restart-s",
                   "checkpoint_write_s": "--checkpoint-write-s", "checkpoint_interval_s": "--checkpoint-interval-s"}


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="fireflyer simulate goodput",
        description="Goodput (useful time / wall time) of checkpoint-restart and of fault-tolerant training against "
        "GPU count, failing at Fire-Flyer 2's rates (paper Tables VI-VII) or a given MTBF.",
    )
    p.add_argument("--gpus", default=",".join(str(n) for n in gp.DEFAULT_GPUS),
                   help=f"GPU counts, comma-separated, each 1..{gp.MAX_GPUS:,} (default "
                        f"{','.join(str(n) for n in gp.DEFAULT_GPUS)})")
    g = p.add_argument_group("failures (default: Fire-Flyer 2's Tables VI-VII)")
    mtbf = g.add_mutually_exclusive_group()
    mtbf.add_argument("--mtbf-gpu-hours", type=_positive, metavar="H", help="mean time between failures of one GPU")
    mtbf.add_argument("--mtbf-node-hours", type=_positive, metavar="H", help="mean time between failures of one node")
    g.add_argument("--gpus-per-node", type=int, metavar="N", help="GPUs per node, for --mtbf-node-hours (default 8)")
    g.add_argument("--hardware-only", action="store_true",
                   help="leave out the Xids applications trigger (13, 31) from the paper's rates")
    r = p.add_argument_group("recovery, in seconds (defaults measured on this host; see the docs)")
    r.add_argument("--restart-s", type=_non_negative, metavar="S",
                   help=f"checkpoint-restart: failure to training again (default {gp.DEFAULT_RESTART_S:g})")
    r.add_argument("--checkpoint-write-s", type=_non_negative, metavar="S",
                   help="checkpoint-restart: training stall per save, Young's C "
                        f"(default {gp.DEFAULT_CHECKPOINT_WRITE_S:g})")
    r.add_argument("--checkpoint-interval-s", type=_positive, metavar="S",
                   help="checkpoint-restart: seconds between saves (default Young's sqrt(2*C*MTBF) at each size; "
                        "the paper saves every 300)")
    r.add_argument("--ft-stall-s", type=_non_negative, metavar="S",
                   help=f"fault-tolerant: the whole job's stall per failure (default {gp.DEFAULT_FT_STALL_S:g})")
    r.add_argument("--rejoin-s", type=_non_negative, metavar="S",
                   help="fault-tolerant: a failed replica's time out, replaced and healing "
                        f"(default {gp.DEFAULT_REJOIN_S:g})")
    r.add_argument("--measured", type=Path, metavar="FILE",
                   help="JSON object with stall_s and rejoin_s (fireflyer bench recovery's); the flags above win")
    p.add_argument("--replica-gpus", type=int, metavar="G",
                   help="GPUs per data-parallel replica: count the throughput lost while failed replicas heal "
                        "(default: leave it out)")
    p.add_argument("--reproduce", choices=sorted(REPRODUCTIONS),
                   help="derive the MTBF from FT-HSDP's published 44%% point and check the model's 80%% point")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--plot", type=Path, metavar="PNG", help="write goodput against GPU count, both designs, to this PNG")
    return p


def _number(text: str, *, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise argparse.ArgumentTypeError(f"expected a number {'>' if positive else '>='} 0, got {text!r}")
    return value


def _non_negative(text: str) -> float:
    return _number(text, positive=False)


def _positive(text: str) -> float:
    return _number(text, positive=True)


def parse_gpus(text: str) -> list[int]:
    """``"1000,10_000,100000"`` as GPU counts, each in 1..1,000,000."""
    out = []
    for part in text.split(","):
        part = part.strip().replace("_", "")
        if not part:
            continue
        if not part.lstrip("-").isdigit():
            raise UserError(f"--gpus takes whole numbers separated by commas, got {part!r}")
        out.append(int(part))
    try:
        return gp.check_gpus(out)
    except UserError as exc:
        raise UserError(f"--gpus: {exc}") from None


# ---------------------------------------------------------------- inputs

def read_measured(path: Path) -> dict[str, float]:
    """``stall_s`` and ``rejoin_s`` from ``fireflyer bench recovery``'s JSON, as
    :class:`~fireflyer.validator.goodput.Recovery` fields (``ft_stall_s``, ``rejoin_s``)."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"--measured {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UserError(f"--measured {path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"--measured {path}: expected a JSON object with stall_s and rejoin_s, got {type(data).__name__}")
    out = {}
    for key, name in _MEASURED_KEYS.items():
        if key not in data:
            raise UserError(f"--measured {path}: no {key} (seconds); expected a JSON object with stall_s and rejoin_s")
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise UserError(f"--measured {path}: {key} must be a number of seconds >= 0, got {value!r}")
        out[name] = float(value)
    return out


def recovery(args: argparse.Namespace) -> tuple[gp.Recovery, dict[str, str]]:
    """The recovery costs and where each came from: its flag, ``--measured``, or the default measured here."""
    values: dict[str, Any] = {}
    sources = {name: "default" for name in _RECOVERY_FLAGS}
    if args.measured is not None:
        for name, value in read_measured(args.measured).items():
            values[name], sources[name] = value, str(args.measured)
    for name, flag in _RECOVERY_FLAGS.items():
        if getattr(args, name) is not None:
            values[name], sources[name] = getattr(args, name), flag
    if args.checkpoint_interval_s is None:
        sources["checkpoint_interval_s"] = "Young"
    return gp.Recovery(**values), sources


def failure_rate(args: argparse.Namespace) -> tuple[float, str, gp.FailureRates | None]:
    """One GPU's MTBF in hours, what it is, and the paper's rates when they are the source."""
    if args.hardware_only and (args.mtbf_gpu_hours is not None or args.mtbf_node_hours is not None):
        raise UserError("--hardware-only picks among the paper's failures; it does not apply to --mtbf-gpu-hours "
                        "or --mtbf-node-hours")
    if args.gpus_per_node is not None and args.mtbf_node_hours is None:
        raise UserError("--gpus-per-node converts --mtbf-node-hours; give both, or neither")
    if args.mtbf_gpu_hours is not None:
        return args.mtbf_gpu_hours, f"--mtbf-gpu-hours: MTBF {args.mtbf_gpu_hours:,.0f} h per GPU", None
    if args.mtbf_node_hours is not None:
        per_node = DEFAULT_GPUS_PER_NODE if args.gpus_per_node is None else args.gpus_per_node
        if not 1 <= per_node <= 1024:
            raise UserError(f"--gpus-per-node must be in 1..1024, got {per_node}")
        h = gp.gpu_mtbf_from_node(args.mtbf_node_hours, per_node)
        return h, (f"--mtbf-node-hours: MTBF {args.mtbf_node_hours:,.0f} h per node of {per_node} GPUs "
                   f"= {h:,.0f} h per GPU"), None
    rates = gp.paper_rates(hardware_only=args.hardware_only)
    return rates.gpu_mtbf_hours, (f"{rates.source}: {rates.total:,.0f} a year on {rates.gpus:,} GPUs = MTBF "
                                  f"{rates.gpu_mtbf_hours:,.0f} h per GPU"), rates


# ---------------------------------------------------------------- output

def _fmt_s(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:,.1f} h"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def render_rows(rows: list[gp.GoodputRow]) -> str:
    head = (f"{'GPUs':>9} {'job MTBF':>10} {'failures/day':>13} {'saves every':>12} {'lost/failure':>13} "
            f"{'ckpt-restart':>13} {'fault-tolerant':>15}")
    out = [head]
    for r in rows:
        every = _fmt_s(r.checkpoint_interval_s) if r.checkpoint_interval_s else "-"  # 0: saved within the stall
        out.append(f"{r.gpus:>9,} {_fmt_s(r.job_mtbf_s):>10} {r.failures_per_day:>13,.1f} "
                   f"{every:>12} {_fmt_s(r.lost_per_failure_s):>13} "
                   f"{_pct(r.checkpoint_restart):>13} {_pct(r.fault_tolerant):>15}")
    return "\n".join(out)


def _source(name: str, sources: dict[str, str]) -> str:
    return "" if sources[name] == "default" else f" ({sources[name]})"


def render_inputs(rec: gp.Recovery, sources: dict[str, str], failures: str, rates: gp.FailureRates | None,
                  replica_gpus: int | None) -> list[str]:
    out = [f"failures: {failures}"]
    if rates is not None:
        out.append("  per year: " + ", ".join(f"{k} {v:,.0f}" for k, v in rates.per_year.items()))
    interval = ("every sqrt(2*C*MTBF) (Young)" if rec.checkpoint_interval_s is None
                else f"every {rec.checkpoint_interval_s:g} s{_source('checkpoint_interval_s', sources)}")
    out.append(f"checkpoint-restart: restart {rec.restart_s:g} s{_source('restart_s', sources)}, save stall "
               f"{rec.checkpoint_write_s:g} s{_source('checkpoint_write_s', sources)}, saves {interval}; "
               "a failure loses half an interval and the restart")
    healing = (f"replicas of {replica_gpus:,} GPUs out {rec.rejoin_s:g} s{_source('rejoin_s', sources)} "
               "each while they heal" if replica_gpus is not None
               else "the throughput of replicas out healing left out (give --replica-gpus)")
    out.append(f"fault-tolerant: stall {rec.ft_stall_s:g} s{_source('ft_stall_s', sources)} per failure; {healing}")
    defaults = [_RECOVERY_FLAGS[n] for n in ("restart_s", "checkpoint_write_s", "ft_stall_s", "rejoin_s")
                if sources[n] == "default" and (n != "rejoin_s" or replica_gpus is not None)]
    if defaults:
        out.append(f"note: {', '.join(defaults)} are defaults measured on this 2-core host with a small job; at "
                   "100K GPUs a failure stalls a job for minutes (FT-HSDP: 10 min synchronous, 3 min fault-tolerant), "
                   "see --reproduce ft-hsdp")
    return out


def render_reproduction(rep: gp.Reproduction, paper_mtbf_hours: float) -> str:
    p = rep.published
    s, s_ft = p.stall_s / 60, p.ft_stall_s / 60
    out = [
        f"{p.source}: at O(100K) GPUs a failure stalls synchronous training {s:g} min, {100 * p.goodput:.0f}% "
        f"effective training time; FT-HSDP's {s_ft:g}-min stall gives {100 * p.ft_goodput:.0f}%.",
        f"published: {p.gpus:,} GPUs (O(100K)), stalls {p.stall_s:g} s and {p.ft_stall_s:g} s per failure, "
        f"goodput {100 * p.goodput:.0f}% and {100 * p.ft_goodput:.0f}%; not published: the failure rate",
        f"derived from the {100 * p.goodput:.0f}% point alone (the stall taken as the whole cost of a failure): job MTBF "
        f"{_fmt_s(rep.job_mtbf_s)}, = {rep.gpu_mtbf_hours:,.0f} h per GPU at {p.gpus:,} GPUs "
        f"(Fire-Flyer 2's Tables VI-VII: {paper_mtbf_hours:,.0f} h)",
        "",
        f"{'':<34}{'published':>10}{'model':>8}{'error':>8}",
        f"{f'checkpoint-restart, {s:g} min stall':<34}{_pct(p.goodput):>10}{_pct(rep.goodput):>8}"
        f"{100 * rep.error:>+7.1f}%  fitted: the MTBF is derived from it",
        f"{f'fault-tolerant, {s_ft:g} min stall':<34}{_pct(p.ft_goodput):>10}{_pct(rep.ft_goodput):>8}"
        f"{100 * rep.ft_error:>+7.1f}%  predicted at that MTBF: the check",
        "",
        "simpler stall models, fitted to the same point, predict the fault-tolerant one as: " + ", ".join(
            f"{form} {_pct(v)} ({100 * (v / p.ft_goodput - 1):+.1f}%)" for form, v in rep.first_order.items()),
    ]
    return "\n".join(out)


def plot_goodput(rows: list[gp.GoodputRow], path: Path, *, title: str,
                 published: gp.Published | None = None) -> None:
    """Goodput of both designs against GPU count (log axis), written atomically; FT-HSDP's points if given."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = [r.gpus for r in rows]
    ax.plot(xs, [100 * r.checkpoint_restart for r in rows], "o-", color="tab:red", label="checkpoint-restart")
    ft = [(r.gpus, 100 * r.fault_tolerant) for r in rows if r.fault_tolerant is not None]
    if ft:
        ax.plot(*zip(*ft), "s-", color="tab:blue", label="fault-tolerant")
    if published is not None:
        ax.plot([published.gpus], [100 * published.goodput], "x", color="black", markersize=10, mew=2,
                label="FT-HSDP published")
        ax.plot([published.gpus], [100 * published.ft_goodput], "x", color="black", markersize=10, mew=2)
    ax.set_xscale("log")
    ax.set_ylim(0, 102)
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("goodput: useful time / wall time (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    try:
        atomic_write(str(path), lambda f: fig.savefig(f, format="png", dpi=110))
    except OSError as exc:
        raise UserError(f"cannot write plot {path}: {exc.strerror or exc}") from None


# ---------------------------------------------------------------- main

def _reproduce(args: argparse.Namespace, gpus: list[int]) -> int:
    given = [flag for name, flag in {**_RECOVERY_FLAGS, "measured": "--measured", "mtbf_gpu_hours": "--mtbf-gpu-hours",
                                     "mtbf_node_hours": "--mtbf-node-hours", "gpus_per_node": "--gpus-per-node",
                                     "replica_gpus": "--replica-gpus"}.items()
             if getattr(args, name) is not None] + (["--hardware-only"] if args.hardware_only else [])
    if given:
        raise UserError(f"--reproduce {args.reproduce} uses the paper's published inputs; drop {', '.join(given)}")
    rep = gp.reproduce(REPRODUCTIONS[args.reproduce])
    rows = gp.simulate(gpus, gp.GoodputConfig(gpu_mtbf_hours=rep.gpu_mtbf_hours, recovery=rep.recovery()))
    paper = gp.paper_rates().gpu_mtbf_hours
    if args.plot is not None:
        plot_goodput(rows, args.plot, published=rep.published,
                     title=f"FT-HSDP's stalls ({rep.published.stall_s / 60:g} and {rep.published.ft_stall_s / 60:g} min), "
                           f"MTBF derived from its {100 * rep.published.goodput:.0f}%: {rep.gpu_mtbf_hours:,.0f} h per GPU")
    if args.json:
        print(json.dumps({"reproduction": rep.to_dict(), "rows": [r.to_dict() for r in rows]}, indent=2))
    else:
        print(render_reproduction(rep, paper))
        print()
        print(f"the same inputs across job sizes (MTBF {rep.gpu_mtbf_hours:,.0f} h per GPU, stalls "
              f"{rep.published.stall_s:g} s and {rep.published.ft_stall_s:g} s):")
        print(render_rows(rows))
    if args.plot is not None:
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def main(argv: list[str]) -> int:
    """Run ``fireflyer simulate goodput``; bad input raises :class:`UserError`, which the CLI prints as one line."""
    args = build_parser().parse_args(argv)
    gpus = parse_gpus(args.gpus)
    if args.reproduce is not None:
        return _reproduce(args, gpus)
    mtbf, failures, rates = failure_rate(args)
    rec, sources = recovery(args)
    if args.replica_gpus is not None and not 1 <= args.replica_gpus <= gp.MAX_GPUS:
        raise UserError(f"--replica-gpus must be in 1..{gp.MAX_GPUS:,}, got {args.replica_gpus}")
    rows = gp.simulate(gpus, gp.GoodputConfig(gpu_mtbf_hours=mtbf, recovery=rec, replica_gpus=args.replica_gpus))
    if args.plot is not None:
        plot_goodput(rows, args.plot, title=f"MTBF {mtbf:,.0f} h per GPU; restart {rec.restart_s:g} s, "
                                            f"fault-tolerant stall {rec.ft_stall_s:g} s")
    if args.json:
        print(json.dumps({
            "failures": {"gpu_mtbf_hours": mtbf, "source": failures, "paper": rates.to_dict() if rates else None},
            "recovery": {**{n: getattr(rec, n) for n in _RECOVERY_FLAGS}, "sources": sources},
            "replica_gpus": args.replica_gpus, "rows": [r.to_dict() for r in rows],
        }, indent=2))
    else:
        _print_study(rows, rec, sources, failures, rates, args.replica_gpus)
    if args.plot is not None:
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _print_study(rows: list[gp.GoodputRow], rec: gp.Recovery, sources: dict[str, str], failures: str,
                 rates: gp.FailureRates | None, replica_gpus: int | None) -> None:
    print("goodput (useful time / wall time) against job size: checkpoint-restart vs fault-tolerant training")
    print("\n".join(render_inputs(rec, sources, failures, rates, replica_gpus)))
    print()
    print(render_rows(rows))
    if replica_gpus is not None and any(r.fault_tolerant is None for r in rows):
        print(f"-: fewer than 2 replicas of {replica_gpus:,} GPUs, no fault-tolerant training")
