"""``fireflyer bench allreduce --order canonical``: hfreduce's canonical summation order against its fast one.

For each layout (default 1 node x 4 ranks and 2 emulated nodes x 2, started with real torchrun
through :func:`fireflyer.launch.run_local` with ``FIREFLYER_HFREDUCE_ORDER=fast``), every rank
(:mod:`fireflyer.bench.canonical_worker`) holds two hfreduce groups over the same ranks: the
default one, which sums in the layout's own order (fast), and one made with
``HFReduceConfig(order="canonical")``, which sums in the left-balanced pairwise tree over global
ranks, so its bits do not depend on the layout. Rounds alternate the two orders.

It reports, against the targets below:

* ``dist.all_reduce`` (SUM) per layout, dtype and size: each op's time is its slowest rank's, the
  figure the median over ops and rounds; fast ms, canonical ms, canonical/fast (target: at most
  ``TARGET_ALLREDUCE_RATIO`` at 64 MiB) and the canonical algorithm bandwidth. The first canonical
  op of every round is checked bit for bit against one process summing every rank's input in the
  canonical tree: its wrong bytes must be 0, and the command exits 1 when they are not;
* one haiscale DDP step of the main job's GPT (``m`` micro-batches per rank, AdamW inside): the
  fast order's ``no_sync`` accumulation against ``DistributedDataParallel(order="canonical")
  .accumulate`` (target: at most ``TARGET_DDP_RATIO``);
* the roofline: the bytes the engine's path moves through host memory (on one node a
  reduce-scatter into the node's arena, then an allgather out of it; :mod:`fireflyer.fabric.traffic`)
  at the copy bandwidth of every core at once, measured in the same run.

The tables go to the terminal, JSON and a PNG to ``--out`` (``allreduce-canonical.json``, ``.png``).
algbw = bytes of one rank's buffer / time; GB = 1e9 B.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from fireflyer.bench.allreduce_report import (aggregate_copy_bw, algbw_gbps, format_ms, memory_floor_seconds,
                                              path_traffic, pct_of_roofline, ratio, roofline_seconds)
from fireflyer.bench.harness import (MiB, bench_command, document, format_size, loadavg, make_console, median,
                                     plot_loglog, progress, slowest_per_op)
from fireflyer.bench.skeleton import result_paths, run_bench, run_ranks
from fireflyer.cliutil import ArgumentParser, doc_summary, parse_size, plural
from fireflyer.errors import JobFailed, UserError
from fireflyer.hfreduce.plans.canonical import layout_problem
from fireflyer.hfreduce.config import HFReduceConfig
from fireflyer.train.model import ModelShape

NAME = "allreduce-canonical"
"""The results' file name, without the extension."""
ORDERS = ("fast", "canonical")  # the worker's names (fireflyer.bench.canonical_worker.ORDERS), without importing it
DTYPE_ITEMSIZE = {"fp32": 4, "bf16": 2}
DEFAULT_LAYOUTS = ((1, 4), (2, 2))
DEFAULT_SIZES = (64 << 10, 1 * MiB, 16 * MiB, 64 * MiB)
QUICK_LAYOUTS = ((1, 2), (2, 1))
QUICK_SIZES = (64 << 10, 1 * MiB)
HEADLINE_BYTES = 64 * MiB
"""The size the allreduce target is judged at (and the roofline printed for)."""
TARGET_ALLREDUCE_RATIO = 1.3
"""The canonical order's allreduce over the fast order's, at ``HEADLINE_BYTES``, may be at most this."""
TARGET_DDP_RATIO = 1.15
"""The canonical DDP step (``accumulate``) over the fast one may be at most this."""
MAX_WORLD = 16
MAX_BYTES = 256 * MiB
"""Every rank rebuilds every rank's input to check the canonical sum: world x this per rank at most."""
PATHS = {"one-shot": "one shot: every rank copies its input into the arena and sums all of them",
         "pipeline": "reduce-scatter into the node's arena, then allgather out of it",
         "pipeline+trees": "reduce-scatter into each node's arena, node partials summed across nodes, allgather"}


# -- configuration -----------------------------------------------------------------


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise UserError(f"{name} must be {low}..{high}, got {value}")


def layout_name(layout: tuple[int, int]) -> str:
    return f"{layout[0]}x{layout[1]}"


def check_layout(layout: tuple[int, int]) -> None:
    """2 to ``MAX_WORLD`` ranks, laid out as the canonical order allows (hfreduce's own rule:
    :func:`fireflyer.hfreduce.plans.canonical.layout_problem`)."""
    nodes, per = layout
    if nodes < 1 or per < 1 or not 2 <= nodes * per <= MAX_WORLD:
        raise UserError(f"layout {layout_name(layout)} needs 2..{MAX_WORLD} ranks in all, e.g. 1x4 or 2x2")
    problem = layout_problem([list(range(n * per, (n + 1) * per)) for n in range(nodes)])
    if problem is not None:
        raise UserError(f"layout {layout_name(layout)}: the canonical order refuses it: {problem}")


@dataclass(frozen=True, kw_only=True)
class DDPSettings:
    """The DDP part: one step of the main job's GPT with ``micro_batches`` per rank."""

    shape: ModelShape = field(default_factory=lambda: ModelShape(vocab_size=65, context=64, layers=2, d_model=128,
                                                                 heads=4))
    micro_batches: int = 4
    """Per rank; a power of two, as the canonical order needs when ranks share the batch."""
    micro_batch_size: int = 4
    """Sequences per micro-batch."""
    warmup: int = 2
    """Untimed steps per round and order."""
    steps: int = 6
    """Timed steps per round and order."""

    def __post_init__(self) -> None:
        m = self.micro_batches
        if not 1 <= m <= 64 or m & (m - 1):
            raise UserError(f"--micro-batches must be a power of two from 1 to 64, got {m}")
        _check_range("--micro-batch-size", self.micro_batch_size, 1, 1024)
        _check_range("--ddp-warmup", self.warmup, 0, 100)
        _check_range("--ddp-steps", self.steps, 1, 1000)


@dataclass(frozen=True, kw_only=True)
class CanonicalBenchConfig:
    layouts: tuple[tuple[int, int], ...] = DEFAULT_LAYOUTS
    """NODES x RANKS per node, each run as its own job."""
    sizes: tuple[int, ...] = DEFAULT_SIZES
    """Bytes per rank of each allreduce."""
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    warmup: int = 2
    """Untimed allreduces per round, order, dtype and size; the first of them is checked."""
    iters: int = 10
    """Timed allreduces per round, order, dtype and size."""
    rounds: int = 2
    """Rounds; the orders alternate which goes first."""
    ddp: DDPSettings = field(default_factory=DDPSettings)
    timeout_s: float = 900.0
    """Seconds before a layout's ranks are killed (each collective's timeout is at most 300 s of it)."""
    out_dir: str = "benchmarks/results"

    def __post_init__(self) -> None:
        if not self.layouts:
            raise UserError("--layouts is empty; give NODESxRANKS, e.g. 1x4,2x2")
        for layout in self.layouts:
            check_layout(layout)
        if not self.sizes:
            raise UserError("--sizes is empty; give sizes per rank, e.g. 64K,1M,16M,64M")
        for s in self.sizes:
            if not 4 <= s <= MAX_BYTES or s % 4:
                raise UserError(f"size {format_size(s)} must be a multiple of 4 bytes from 4 to "
                                f"{format_size(MAX_BYTES)}")
        if not self.dtypes or any(d not in DTYPE_ITEMSIZE for d in self.dtypes) or len(set(self.dtypes)) < len(
                self.dtypes):
            raise UserError(f"--dtypes must be some of {', '.join(DTYPE_ITEMSIZE)}, each once; got "
                            f"{','.join(self.dtypes) or 'none'}")
        _check_range("--warmup", self.warmup, 0, 1000)
        _check_range("--iters", self.iters, 1, 10000)
        _check_range("--rounds", self.rounds, 1, 100)
        if not 0 < self.timeout_s <= 86400:
            raise UserError(f"--timeout must be positive seconds (at most a day), got {self.timeout_s}")


def parse_layouts(text: str) -> tuple[tuple[int, int], ...]:
    """``1x4,2x2`` as (nodes, ranks per node) pairs; the config checks each against the canonical rule."""
    layouts = []
    for word in (w.strip() for w in text.split(",")):
        m = re.fullmatch(r"(\d+)x(\d+)", word.lower())
        if not m:
            raise UserError(f"layout {word!r} is not NODESxRANKS, e.g. 1x4 or 2x2")
        layouts.append((int(m.group(1)), int(m.group(2))))
    return tuple(layouts)


def _words(text: str) -> list[str]:
    return [w.strip() for w in text.split(",") if w.strip()]


def build_config(argv: list[str]) -> CanonicalBenchConfig:
    p = ArgumentParser(prog="fireflyer bench allreduce --order canonical", description=doc_summary(__doc__))
    p.add_argument("--layouts", default=None, help="comma list of NODESxRANKS (default 1x4,2x2; --quick 1x2,2x1)")
    p.add_argument("--sizes", default=None, help="comma list of bytes per rank (default 64K,1M,16M,64M; --quick 64K,1M)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of: " + ", ".join(DTYPE_ITEMSIZE))
    p.add_argument("--warmup", type=int, default=None, help="untimed ops per round, the first checked (default 2)")
    p.add_argument("--iters", type=int, default=None, help="timed ops per round (default 10; --quick 3)")
    p.add_argument("--rounds", type=int, default=None, help="rounds, the orders alternating (default 2; --quick 1)")
    p.add_argument("--layers", type=int, default=2, help="DDP part: the GPT's layers (default 2, the main job's)")
    p.add_argument("--d-model", type=int, default=128, help="DDP part: the GPT's width (default 128)")
    p.add_argument("--heads", type=int, default=4, help="DDP part: attention heads (default 4)")
    p.add_argument("--context", type=int, default=64, help="DDP part: tokens per sequence (default 64)")
    p.add_argument("--vocab", type=int, default=65, help="DDP part: token ids (default 65)")
    p.add_argument("--micro-batches", type=int, default=4, help="per rank, a power of two (default 4)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch (default 4)")
    p.add_argument("--ddp-warmup", type=int, default=2, help="untimed DDP steps per round and order (default 2)")
    p.add_argument("--ddp-steps", type=int, default=6, help="timed DDP steps per round and order (default 6)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a layout's ranks are killed")
    p.add_argument("--out", default="benchmarks/results", metavar="DIR", help=f"where {NAME}.json and .png go")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 1x2,2x1, 64K,1M, 1 round of 3 ops; a 1-layer GPT of width 32, 2 micro-batches of 2")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.d_model, a.heads, a.context = 1, 32, 2, 16
        a.micro_batches, a.micro_batch_size, a.ddp_warmup, a.ddp_steps = 2, 2, 1, 2
    try:
        shape = ModelShape(vocab_size=a.vocab, context=a.context, layers=a.layers, d_model=a.d_model, heads=a.heads)
    except (UserError, ValueError) as exc:
        raise UserError(f"model flags: {exc}") from exc
    ddp = DDPSettings(shape=shape, micro_batches=a.micro_batches, micro_batch_size=a.micro_batch_size,
                      warmup=a.ddp_warmup, steps=a.ddp_steps)
    layouts = parse_layouts(a.layouts) if a.layouts is not None else (QUICK_LAYOUTS if a.quick else DEFAULT_LAYOUTS)
    sizes = (tuple(sorted({parse_size(w, example="64M") for w in _words(a.sizes)})) if a.sizes is not None
             else (QUICK_SIZES if a.quick else DEFAULT_SIZES))
    return CanonicalBenchConfig(layouts=layouts, sizes=sizes, dtypes=tuple(_words(a.dtypes)),
                                warmup=a.warmup if a.warmup is not None else (1 if a.quick else 2),
                                iters=a.iters if a.iters is not None else (3 if a.quick else 10),
                                rounds=a.rounds if a.rounds is not None else (1 if a.quick else 2),
                                ddp=ddp, timeout_s=a.timeout, out_dir=a.out)


# -- running and collecting ----------------------------------------------------------


def worker_spec(cfg: CanonicalBenchConfig) -> dict[str, Any]:
    """What every rank of a layout reads (:mod:`fireflyer.bench.canonical_worker`)."""
    return {"sizes": list(cfg.sizes), "dtypes": list(cfg.dtypes), "warmup": cfg.warmup,
            "iters": cfg.iters, "rounds": cfg.rounds, "timeout_s": min(300.0, cfg.timeout_s),
            "ddp": {"shape": asdict(cfg.ddp.shape), "micro_batches": cfg.ddp.micro_batches,
                    "micro_batch_size": cfg.ddp.micro_batch_size, "warmup": cfg.ddp.warmup, "steps": cfg.ddp.steps}}


def run_layout(cfg: CanonicalBenchConfig, layout: tuple[int, int]) -> list[dict[str, Any]]:
    """Every rank's results on one layout; a failed or silent rank is a one-line :class:`JobFailed`."""
    return run_ranks("fireflyer.bench.canonical_worker", worker_spec(cfg), layout, timeout_s=cfg.timeout_s,
                     env={"FIREFLYER_HFREDUCE_ORDER": "fast"})


def _slowest_median(per_rank: list[list[float]]) -> float:
    """Each op's time is its slowest rank's; the median of those."""
    return median(slowest_per_op(per_rank))


def engine_config() -> HFReduceConfig:
    """The engine's settings as the ranks read them (this environment, the fast order): the paths they take."""
    return HFReduceConfig.from_env(order="fast")


def summarise_allreduce(layout: tuple[int, int], ranks: list[dict[str, Any]], copy_bw: float | None,
                        engine: HFReduceConfig) -> list[dict[str, Any]]:
    """One row per dtype and size: both orders' times, the ratio, bandwidth, the roofline and the check."""
    nodes, per = layout
    rows = []
    for i, first in enumerate(ranks[0]["allreduce"]):
        mine = [r["allreduce"][i] for r in ranks]
        if any((m["dtype"], m["bytes"]) != (first["dtype"], first["bytes"]) for m in mine):
            raise JobFailed(f"layout {layout_name(layout)}: the ranks measured different sizes at row {i}")
        nbytes, dtype = first["bytes"], first["dtype"]
        t = {o: _slowest_median([m["times"][o] for m in mine]) for o in ORDERS}
        traffic = path_traffic(nbytes, nodes, per, DTYPE_ITEMSIZE[dtype], engine)
        roof = roofline_seconds(traffic["mem_bytes"] * nodes, copy_bw) if copy_bw else float("nan")
        rows.append({
            "layout": layout_name(layout), "dtype": dtype, "bytes": nbytes, "ops": len(first["times"]["canonical"]),
            "fast_s": t["fast"], "canonical_s": t["canonical"], "ratio": ratio(t["canonical"], t["fast"]),
            "fast_algbw_gbps": algbw_gbps(nbytes, t["fast"]), "canonical_algbw_gbps": algbw_gbps(nbytes, t["canonical"]),
            "path": traffic["path"], "mem_bytes_per_node": traffic["mem_bytes"], "roofline_s": roof,
            "pct_roofline": {o: pct_of_roofline(roof, t[o]) for o in ORDERS},
            "floor_s": memory_floor_seconds(nbytes, per, nodes, copy_bw),
            "wrong_bytes": sum(m["wrong_bytes"] for m in mine),
            "fast_differs_bytes": sum(m["fast_differs_bytes"] for m in mine),
            "checked_ops": first["checked"] * len(mine),
        })
    return rows


def summarise_ddp(layout: tuple[int, int], ranks: list[dict[str, Any]], ddp: DDPSettings) -> dict[str, Any]:
    """The DDP step per order (slowest rank per step, median over steps) and their ratio."""
    t = {o: _slowest_median([r["ddp"]["times"][o] for r in ranks]) for o in ORDERS}
    world = layout[0] * layout[1]
    return {"layout": layout_name(layout), "fast_s": t["fast"], "canonical_s": t["canonical"],
            "ratio": ratio(t["canonical"], t["fast"]), "params": ranks[0]["ddp"]["params"],
            "steps": len(ranks[0]["ddp"]["times"]["canonical"]), "micro_batches": ddp.micro_batches,
            "micro_batch_size": ddp.micro_batch_size, "global_micro_batches": ddp.micro_batches * world}


def summarise_layout(cfg: CanonicalBenchConfig, layout: tuple[int, int], ranks: list[dict[str, Any]],
                     engine: HFReduceConfig) -> dict[str, Any]:
    copies = [c for r in ranks for c in r.get("copies", [])]
    copy_bw = aggregate_copy_bw(copies) if copies else None
    rows = summarise_allreduce(layout, ranks, copy_bw, engine)
    return {"layout": layout_name(layout), "nodes": layout[0], "local": layout[1], "world": len(ranks),
            "threads_per_rank": ranks[0]["threads"], "copy_bw": copy_bw,
            "copy_ranks": min(len(ranks), os.cpu_count() or 1), "rows": rows,
            "ddp": summarise_ddp(layout, ranks, cfg.ddp)}


def headline_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``HEADLINE_BYTES`` fp32 row, else the largest fp32 row below it, else the largest row."""
    if not rows:
        return None
    fp32 = [r for r in rows if r["dtype"] == "fp32" and r["bytes"] <= HEADLINE_BYTES]
    return max(fp32 or rows, key=lambda r: r["bytes"])


def verdicts(layouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every target, met or missed: the allreduce ratio at ``HEADLINE_BYTES`` per layout and dtype
    (absent where that size was not run), and the DDP step ratio per layout."""
    out = []
    for lay in layouts:
        for row in (r for r in lay["rows"] if r["bytes"] == HEADLINE_BYTES):
            out.append({"target": "allreduce", "layout": lay["layout"], "dtype": row["dtype"], "bytes": row["bytes"],
                        "ratio": row["ratio"], "at_most": TARGET_ALLREDUCE_RATIO,
                        "met": row["ratio"] <= TARGET_ALLREDUCE_RATIO})
        d = lay["ddp"]
        out.append({"target": "ddp_step", "layout": lay["layout"], "ratio": d["ratio"], "at_most": TARGET_DDP_RATIO,
                    "met": d["ratio"] <= TARGET_DDP_RATIO})
    return out


def wrong_total(layouts: list[dict[str, Any]]) -> int:
    return sum(r["wrong_bytes"] for lay in layouts for r in lay["rows"])


# -- report ------------------------------------------------------------------------


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)


def _verdict(met: bool) -> str:
    return "[green]PASS[/green]" if met else "[red]MISS[/red]"


def _wrong_cell(n: int) -> str:
    return "0" if not n else f"[bold red]{n} WRONG[/bold red]"


def print_layout(console: Any, cfg: CanonicalBenchConfig, lay: dict[str, Any]) -> None:
    """The allreduce table of one layout, then its roofline line."""
    from rich.table import Table

    t = Table(title=f"{lay['layout']}: {plural(lay['nodes'], 'node')} x {plural(lay['local'], 'rank')}, allreduce (SUM)",
              title_justify="left", show_edge=False, pad_edge=False)
    for col in ("\nsize", "\ntype", "fast\nms", "canonical\nms", "canon/\nfast", "canon\nGB/s", "\npath",
                "roofline\nms", "canon %\nroofline", "fast bytes\n!= canon", "canon\nwrong B"):
        t.add_column(col, justify="left" if col == "\npath" else "right", no_wrap=col == "\npath")
    for r in lay["rows"]:
        pct = r["pct_roofline"]["canonical"]
        t.add_row(format_size(r["bytes"]), r["dtype"], format_ms(r["fast_s"]), format_ms(r["canonical_s"]),
                  _f(r["ratio"], ".2f"), _f(r["canonical_algbw_gbps"], ".2f"), r["path"], format_ms(r["roofline_s"]),
                  _f(pct, ".0f" if pct == pct and pct >= 10 else ".2g"), str(r["fast_differs_bytes"]),
                  _wrong_cell(r["wrong_bytes"]))
    console.print(t)
    console.print(f"  ms: median over {plural(cfg.rounds, 'round')} x {plural(cfg.iters, 'op')} per order of each op's slowest rank; "
                  f"canon GB/s: the canonical order's algbw (bytes per rank / time)", soft_wrap=True)
    console.print("  canon wrong B = bytes of the canonical results that differ from one process summing every "
                  "rank's input in the canonical tree (must be 0); fast bytes != canon = the same for the fast order, "
                  "which sums in the layout's order (not an error: it shows the order matters)", soft_wrap=True)
    print_roofline(console, lay)


def print_roofline(console: Any, lay: dict[str, Any]) -> None:
    head = headline_row(lay["rows"])
    if head is None or not lay["copy_bw"]:
        return
    console.print(f"  roofline at {format_size(head['bytes'])} {head['dtype']} ({head['path']}: "
                  f"{PATHS.get(head['path'], head['path'])}): {head['mem_bytes_per_node'] / 1e6:.0f} MB through memory "
                  f"per node x {plural(lay['nodes'], 'node')} on this host at {lay['copy_bw'] / 1e9:.2f} GB/s "
                  f"({plural(lay['copy_ranks'], 'core')} copying at once) -> {format_ms(head['roofline_s'])} ms; fast took "
                  f"{format_ms(head['fast_s'])} ms = {head['pct_roofline']['fast']:.0f}%, canonical "
                  f"{format_ms(head['canonical_s'])} ms = {head['pct_roofline']['canonical']:.0f}% of roofline "
                  f"(the canonical order moves the same bytes, only adding the slots in another order)",
                  soft_wrap=True)
    if max(head["pct_roofline"].values()) > 100:
        console.print("  above 100%: the copy rate measured here (torch's copy_, one thread per rank) is below what "
                      "the engine's own copies and kernels reach on this host, so this roofline bounds nothing; "
                      "the figure to read is canonical against fast, measured together", soft_wrap=True)


def print_ddp(console: Any, cfg: CanonicalBenchConfig, layouts: list[dict[str, Any]]) -> None:
    from rich.table import Table

    s = cfg.ddp.shape
    t = Table(title="DDP step (haiscale)", title_justify="left", show_edge=False, pad_edge=False)
    for col in ("layout", "fast ms\n(no_sync)", "canonical ms\n(accumulate)", "canon/\nfast"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    for lay in layouts:
        d = lay["ddp"]
        t.add_row(d["layout"], format_ms(d["fast_s"]), format_ms(d["canonical_s"]), _f(d["ratio"], ".2f"))
    console.print(t)
    console.print(f"  one step of a GPT of {layouts[0]['ddp']['params']:,} parameters ({plural(s.layers, 'layer')}, d_model "
                  f"{s.d_model}, context {s.context}), {plural(cfg.ddp.micro_batches, 'micro-batch', 'micro-batches')} of "
                  f"{plural(cfg.ddp.micro_batch_size, 'sequence')} per rank, AdamW included; ms: median over "
                  f"{plural(cfg.rounds, 'round')} x {plural(cfg.ddp.steps, 'step')} of each step's slowest rank", soft_wrap=True)


def print_verdicts(console: Any, cfg: CanonicalBenchConfig, layouts: list[dict[str, Any]],
                   checks: list[dict[str, Any]]) -> None:
    ar = [v for v in checks if v["target"] == "allreduce"]
    if ar:
        for v in ar:
            console.print(f"  target allreduce canonical/fast <= {TARGET_ALLREDUCE_RATIO}x at "
                          f"{format_size(HEADLINE_BYTES)}: {v['layout']} {v['dtype']} {_f(v['ratio'], '.2f')}x "
                          f"{_verdict(v['met'])}")
    else:
        console.print(f"  target allreduce canonical/fast <= {TARGET_ALLREDUCE_RATIO}x at "
                      f"{format_size(HEADLINE_BYTES)}: not measured (sizes "
                      f"{','.join(format_size(s) for s in cfg.sizes)})")
    for v in (v for v in checks if v["target"] == "ddp_step"):
        console.print(f"  target DDP step canonical/fast <= {TARGET_DDP_RATIO}x: {v['layout']} "
                      f"{_f(v['ratio'], '.2f')}x {_verdict(v['met'])}")
    wrong = wrong_total(layouts)
    if wrong:
        bad = sorted({f"{r['layout']} {r['dtype']} {format_size(r['bytes'])}" for lay in layouts for r in lay["rows"]
                      if r["wrong_bytes"]})
        console.print(f"[bold red]  CANONICAL RESULTS WRONG: {wrong} bytes differ from the canonical tree's sum "
                      f"({'; '.join(bad)})[/bold red]", soft_wrap=True)
    else:
        checked = sum(r["checked_ops"] for lay in layouts for r in lay["rows"])
        console.print(f"  every checked canonical result was bitwise the canonical tree's ({checked} rank-ops)")


def write_png(path: str, cfg: CanonicalBenchConfig, layouts: list[dict[str, Any]]) -> None:
    """Time against size, log-log: one panel per layout and dtype, both orders and the roofline."""
    panels = []
    for lay in layouts:
        for dtype in cfg.dtypes:
            rows = [r for r in lay["rows"] if r["dtype"] == dtype]
            lines = [("fast", [(r["bytes"], r["fast_s"]) for r in rows], {"marker": "o", "ms": 3, "color": "tab:blue"}),
                     ("canonical", [(r["bytes"], r["canonical_s"]) for r in rows],
                      {"marker": "s", "ms": 3, "color": "tab:red"})]
            roof = [(r["bytes"], r["roofline_s"]) for r in rows if r["roofline_s"] == r["roofline_s"]]
            if roof:
                lines.append(("roofline (path's memory traffic)", roof, {"ls": "--", "color": "gray", "lw": 1}))
            panels.append({"title": f"{lay['layout']} {dtype}", "lines": lines, "sizes": [r["bytes"] for r in rows]})
    plot_loglog(path, panels, "allreduce, fast vs canonical order: median of the slowest rank per op",
                "time per allreduce (ms)", max(1, len(cfg.dtypes)))


def doc_fields(cfg: CanonicalBenchConfig, layouts: list[dict[str, Any]]) -> dict[str, Any]:
    """The result document's fields after its head."""
    wrong = wrong_total(layouts)
    return {
        "order": "canonical",
        "config": {"layouts": [layout_name(x) for x in cfg.layouts], "sizes": list(cfg.sizes),
                   "dtypes": list(cfg.dtypes), "warmup": cfg.warmup, "iters": cfg.iters, "rounds": cfg.rounds,
                   "ddp": asdict(cfg.ddp), "engine_env_order": "fast",
                   "timing": "each op's time is its slowest rank's; figures are medians over rounds x ops"},
        "targets": {"allreduce_ratio_at_most": TARGET_ALLREDUCE_RATIO, "allreduce_at_bytes": HEADLINE_BYTES,
                    "ddp_step_ratio_at_most": TARGET_DDP_RATIO},
        "loadavg": loadavg(),
        "layouts": [{k: v for k, v in lay.items() if k not in ("rows", "ddp")} for lay in layouts],
        "rows": [r for lay in layouts for r in lay["rows"]],
        "ddp": [lay["ddp"] for lay in layouts],
        "verdicts": verdicts(layouts),
        "wrong_bytes_total": wrong,
        "ok": wrong == 0,
    }


def measure(cfg: CanonicalBenchConfig) -> list[dict[str, Any]]:
    """Every layout's summary; the tables and the verdicts printed."""
    engine = engine_config()
    console, say = make_console(width=140), progress()
    layouts = []
    for layout in cfg.layouts:
        say(f"{layout_name(layout)}: {plural(cfg.rounds, 'round')} of fast and canonical allreduces "
            f"({plural(len(cfg.dtypes), 'dtype')} x {plural(len(cfg.sizes), 'size')}), then DDP steps ...")
        lay = summarise_layout(cfg, layout, run_layout(cfg, layout), engine)
        print_layout(console, cfg, lay)
        layouts.append(lay)
    print_ddp(console, cfg, layouts)
    print_verdicts(console, cfg, layouts, verdicts(layouts))
    return layouts


def main(argv: list[str]) -> int:
    """Run the benchmark; 0, or 1 when any canonical result was wrong (a missed target is reported, not an error)."""
    return run_bench(argv, part="allreduce", configure=build_config, measure=measure, fields=doc_fields,
                     plot=write_png, paths=lambda cfg: result_paths(cfg.out_dir, NAME),
                     head=lambda argv: document(bench_command("allreduce", ["--order", "canonical", *argv])),
                     verdict=lambda cfg, layouts: 1 if wrong_total(layouts) else 0)
