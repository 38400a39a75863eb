"""``fireflyer bench alltoall``: ``all_to_all_single`` on hfreduce against gloo, in one run.

For each layout (``NxL``: N emulated nodes of L ranks on this host) it starts the same torch
ranks as ``fireflyer bench allreduce`` (:mod:`fireflyer.bench.allreduce_worker`: hfreduce as
the default group and a gloo group, in the same processes, with torchrun's environment) and
drives them through its control socket: for every size each round runs both systems in turn
(the order rotates between rounds), so both see the same machine. Each op's time is its
slowest rank's, and the figure is the median over rounds x ops; the first op of every round
is checked exact. Sizes are the bytes each rank sends in all (its whole input, split evenly
over the ranks), fp32. It prints hfreduce's speedup over gloo (gloo's time / hfreduce's) and
writes JSON and a log-log PNG of time against size.

algbw = bytes of one rank's input / time; busbw = algbw * (n-1)/n (nccl-tests' all_to_all); GB = 1e9 B.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from typing import Any, Callable

from fireflyer.cliutil import ArgumentParser, doc_summary, parse_size, plural
from fireflyer.errors import UserError
from fireflyer.bench import allreduce_peers
from fireflyer.bench.allreduce import _check_candidate, run_layout, wrong_verdict
from fireflyer.bench.allreduce_report import (
    COLORS,
    Layout,
    LayoutResult,
    _fmt,
    add_busy_flag,
    add_output_flags,
    check_run_flags,
    output_paths,
    format_ms,
    format_size,
    layout_title,
    op_schedule,
    parse_layouts,
    speedup,
    summarize,
)
from fireflyer.bench.harness import busy_host, make_console, median, plot_loglog, progress, slowest_per_op
from fireflyer.bench.skeleton import run_bench

MiB = 1 << 20
SIZES = (64 << 10, 4 * MiB, 64 * MiB)
QUICK_SIZES = (64 << 10, 4 * MiB)
DEFAULT_LAYOUTS = ("1x4", "2x2")
SYSTEMS = ("candidate", "gloo")
"""Report keys, as ``fireflyer bench allreduce`` has them: "candidate" is hfreduce."""
CANDIDATE = "hfreduce"
ITEMSIZE = 4  # fp32


@dataclass(frozen=True, kw_only=True)
class ExchangeConfig:
    """What ``fireflyer bench alltoall`` runs; the fields :func:`fireflyer.bench.allreduce.run_layout` reads
    (``candidate``, ``systems``, ``peers``, ``link_mbit``, ``timeout_s``) mean what they do there."""

    layouts: tuple[Layout, ...]
    schedule: tuple[tuple[int, int, int], ...]
    """(bytes each rank sends, timed ops per round, untimed ops per round) per size; the first untimed op is checked."""
    rounds: int = 2
    """Rounds per size; both systems run once per round, in an order that rotates."""
    candidate: str = CANDIDATE
    systems: tuple[str, ...] = SYSTEMS
    link_mbit: float = 1000.0
    """Shaped layouts only: the link rate, Mbit/s each way."""
    timeout_s: float = 120.0
    """Per-collective timeout in the ranks; the parent gives up on a round after 1.5x this."""
    json_path: str = "benchmarks/results/alltoall.json"
    png_path: str = "benchmarks/results/alltoall.png"
    busy: int = 0
    """CPU-bound processes run beside the ranks for the whole run (``--busy``)."""

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise UserError(f"rounds must be >= 1, got {self.rounds}")
        if not self.layouts or not self.schedule:
            raise UserError("alltoall needs at least one layout and one size")
        if not self.timeout_s > 0:
            raise UserError(f"timeout must be positive seconds, got {self.timeout_s}")

    @property
    def peers(self) -> tuple[str, ...]:
        return ()


def build_config(argv: list[str]) -> ExchangeConfig:
    p = ArgumentParser(prog="fireflyer bench alltoall", description=doc_summary(__doc__))
    p.add_argument("--sizes", default=None, help="comma list of bytes each rank sends in all "
                   "(default 64K,4M,64M; --quick 64K,4M); a multiple of 4 x the world size")
    p.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help="comma list of NODESxRANKS, e.g. 1x4,2x2")
    p.add_argument("--rounds", type=int, default=None, help="rounds per size, systems alternating (default 2; --quick 1)")
    p.add_argument("--iters", type=int, default=None, help="timed ops per round (default as bench allreduce: 150 up "
                   "to 256K, 50 up to 4M, fewer above)")
    p.add_argument("--warmup", type=int, default=None, help="untimed ops per round, the first checked (default 2)")
    p.add_argument("--link-mbit", type=float, default=1000.0, help="shaped layouts: link rate, Mbit/s each way")
    p.add_argument("--timeout", type=float, default=ExchangeConfig.timeout_s,
                   help="seconds before a stuck collective fails")
    add_output_flags(p, ExchangeConfig.json_path, ExchangeConfig.png_path)
    add_busy_flag(p)
    p.add_argument("--quick", action="store_true", help="64K,4M, 1 round of 5 ops: a smoke run")
    a = p.parse_args(argv)
    check_run_flags(a)
    json_path, png_path = output_paths(a, ExchangeConfig.json_path, ExchangeConfig.png_path)
    layouts = parse_layouts(a.layouts)
    if a.sizes is not None:
        sizes = sorted({parse_size(t) for t in a.sizes.split(",") if t.strip()})
        if not sizes:
            raise UserError("--sizes is empty")
    else:
        sizes = list(QUICK_SIZES if a.quick else SIZES)
    for nbytes in sizes:
        for lay in layouts:
            if nbytes < ITEMSIZE * lay.world or nbytes % (ITEMSIZE * lay.world):
                raise UserError(f"size {format_size(nbytes)} does not split evenly into fp32 chunks for the "
                                f"{lay.world} ranks of {lay.name}; give a multiple of {ITEMSIZE * lay.world} bytes")
    schedule = op_schedule(sizes, a.iters, a.warmup, a.quick)
    return ExchangeConfig(layouts=layouts, schedule=schedule, rounds=a.rounds or (1 if a.quick else 2),
                          link_mbit=a.link_mbit, timeout_s=a.timeout, json_path=json_path, png_path=png_path, busy=a.busy)


# -- the figures (unit-tested) --------------------------------------------------------------


def build_row(layout: str, world: int, nbytes: int, measured: dict[str, tuple[list[float], int]]) -> dict[str, Any]:
    """A table row from each system's slowest-rank op times and wrong counts: medians, algbw and
    busbw, and hfreduce's speedup over gloo (gloo's time / hfreduce's; > 1: hfreduce is faster)."""
    row: dict[str, Any] = {"layout": layout, "dtype": "fp32", "bytes": nbytes, "count": nbytes // ITEMSIZE}
    for system, (samples, wrong) in measured.items():
        row[system] = summarize(samples, wrong, nbytes, world, bus_factor=(world - 1) / world)
    cand, gloo = row.get("candidate"), row.get("gloo")
    row["iters"] = cand["ops"] if cand else 0
    row["speedup"] = {"gloo": speedup(gloo["time_s"] if gloo else None, cand["time_s"] if cand else None)}
    return row


def _wrong(row: dict[str, Any]) -> int:
    return sum(row[s]["wrong"] for s in SYSTEMS if row.get(s))


def print_layout(console: Any, res: LayoutResult) -> None:
    """One table per layout: each system's median time and algbw, the speedup, the wrong elements."""
    from rich.table import Table

    title = layout_title(console, res)
    if title is None:
        return
    console.print(f"[italic]{title} - all_to_all_single fp32, median ms of the slowest rank per op[/italic]")
    t = Table(show_edge=False, pad_edge=False)
    for head in ("\nsize", f"{CANDIDATE}\nms", "gloo\nms", "x\ngloo", f"{CANDIDATE}\nalgbw GB/s",
                 "gloo\nalgbw GB/s", "\nops", "\n#wrong"):
        t.add_column(head, justify="right")
    for row in res.rows:
        cand, gloo = row.get("candidate"), row.get("gloo")
        wrong = _wrong(row)
        t.add_row(format_size(row["bytes"]), format_ms(cand["time_s"] if cand else None),
                  format_ms(gloo["time_s"] if gloo else None), _fmt(row["speedup"]["gloo"], ".2f"),
                  _fmt(cand["algbw"] if cand else None, ".2f"), _fmt(gloo["algbw"] if gloo else None, ".2f"),
                  str(row["iters"]), str(wrong) if not wrong else f"[red]{wrong}[/red]")
    console.print(t)
    console.print(f"  size = the bytes each rank sends in all (its whole input, split evenly); x gloo = {CANDIDATE}'s "
                  f"speedup over gloo (its time / {CANDIDATE}'s); the first op of every round is checked exact",
                  soft_wrap=True)
    for note in dict.fromkeys(res.notes.values()):
        console.print(f"  [yellow]{note}[/yellow]", soft_wrap=True)
    console.print()


def write_png(path: str, results: list[LayoutResult]) -> None:
    """Time against size, log-log: one panel per layout, both systems."""
    panels = []
    for res in (r for r in results if not r.skipped):
        lines = []
        for system, label in (("candidate", CANDIDATE), ("gloo", "gloo")):
            pts = [(r["bytes"], r[system]["time_s"]) for r in res.rows
                   if r.get(system) and r[system]["time_s"] == r[system]["time_s"]]
            if pts:
                lines.append((label, pts, {"marker": "o", "ms": 3, "color": COLORS[system]}))
        panels.append({"title": f"{res.layout} fp32", "lines": lines, "sizes": sorted(r["bytes"] for r in res.rows)})
    plot_loglog(path, panels, "all_to_all_single, median of the slowest rank per op",
                "time per all_to_all_single (ms)", max(1, min(2, len(panels))))


def doc_fields(cfg: ExchangeConfig, results: list[LayoutResult]) -> dict[str, Any]:
    """The result document's fields after its head."""
    return {
        "collective": "all_to_all_single",
        "candidate": CANDIDATE,
        "config": {"dtype": "fp32", "schedule": cfg.schedule, "rounds": cfg.rounds, "systems": cfg.systems,
                   "timeout_s": cfg.timeout_s, "busy": cfg.busy,
                   "timing": "each op's time is its slowest rank's; figures are medians over rounds x ops",
                   "bytes": "what each rank sends in all (its whole input), split evenly over the ranks"},
        "layouts": [{k: v for k, v in asdict(r).items()
                     if k in ("layout", "nodes", "local", "world", "link_mbit", "skipped", "notes")} for r in results],
        "speedups": {r.layout: {str(row["bytes"]): row["speedup"]["gloo"] for row in r.rows} for r in results},
        "rows": [row for r in results for row in r.rows],
    }


# -- running ---------------------------------------------------------------------------------


def _measure(cfg: ExchangeConfig, lay: Layout, sets: dict[str, allreduce_peers.ProcessSet], res: LayoutResult,
             progress: Callable[[str], None]) -> None:
    """Every size in alternating rounds, on the torch ranks' ``exchange`` command."""
    torch_set = sets["torch"]
    call_s = 1.5 * cfg.timeout_s + 10
    systems = list(cfg.systems)
    for si, (nbytes, ops, warmup) in enumerate(cfg.schedule):
        samples: dict[str, list[float]] = {s: [] for s in systems}
        wrong = dict.fromkeys(systems, 0)
        cmd = {"cmd": "exchange", "bytes": nbytes, "ops": ops, "warmup": warmup, "size_index": si}
        for rnd in range(cfg.rounds):
            k = rnd % len(systems)
            for system in systems[k:] + systems[:k]:
                replies = torch_set.call({**cmd, "system": system}, call_s)
                samples[system] += slowest_per_op([r["times"] for r in replies])
                wrong[system] += sum(r["wrong"] for r in replies)
        res.rows.append(build_row(lay.name, lay.world, nbytes, {s: (samples[s], wrong[s]) for s in systems}))
        progress(f"{lay.name} {format_size(nbytes)}: " + ", ".join(
            f"{CANDIDATE if s == 'candidate' else s} {format_ms(median(samples[s]))} ms" for s in systems))


def measure(cfg: ExchangeConfig) -> list[LayoutResult]:
    """Every layout's result, each layout's table printed as it is done."""
    _check_candidate(CANDIDATE)
    console, say = make_console(), progress()
    results = []
    with busy_host(cfg.busy) as hogs:
        if hogs:
            console.print(f"a busy host: {plural(len(hogs), 'CPU-bound process', 'CPU-bound processes')} "
                          f"beside the ranks (--busy {cfg.busy})")
        for lay in cfg.layouts:
            res = run_layout(cfg, lay, {}, say, measure=_measure)
            print_layout(console, res)
            results.append(res)
    return results


def main(argv: list[str]) -> int:
    """Run the benchmark; returns 0, or 1 when any op's result was wrong."""
    return run_bench(
        argv, part="alltoall", configure=build_config, measure=measure, fields=doc_fields,
        plot=lambda path, cfg, results: write_png(path, results), paths=lambda cfg: (cfg.json_path, cfg.png_path),
        verdict=lambda cfg, results: wrong_verdict(sum(_wrong(row) for r in results for row in r.rows),
                                                   "#wrong column"))


if __name__ == "__main__":  # python -m fireflyer.bench.exchange [options], as `fireflyer bench alltoall`
    sys.exit(main(sys.argv[1:]))
