"""Numbers and output of ``fireflyer bench allreduce``: the table math, the nccl-tests style
report, JSON and the PNG. Pure functions first (unit-tested), writers after."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from fireflyer.bench.harness import (  # noqa: F401 - re-exported: the allreduce bench's callers and tests
    atomic_write,
    busy_path,
    check_busy,
    format_size,
    make_console,
    median,
    plot_loglog,
    slowest_per_op,
    write_json,
)
from fireflyer.cliutil import plural
from fireflyer.cliutil import parse_size  # noqa: F401 - re-exported: the allreduce bench reads its sizes with it
from fireflyer.errors import UserError
from fireflyer.fabric import traffic
from fireflyer.hfreduce.config import HFReduceConfig, default_chunk_bytes

MiB = 1 << 20
HEADLINE_BYTES = 64 * MiB


# -- what one run measures: layouts and their results ------------------------------

DEFAULT_LAYOUTS = ("1x4", "2x2", "2x2-shaped")


@dataclass(frozen=True)
class Layout:
    nodes: int
    local: int
    shaped: bool

    @property
    def name(self) -> str:
        return f"{self.nodes}x{self.local}" + ("-shaped" if self.shaped else "")

    @property
    def world(self) -> int:
        return self.nodes * self.local


def parse_layout(text: str) -> Layout:
    m = re.fullmatch(r"(\d+)x(\d+)(-shaped)?", text.strip())
    if not m:
        raise UserError(f"bad layout {text!r}; write NODESxRANKS or NODESxRANKS-shaped, e.g. {','.join(DEFAULT_LAYOUTS)}")
    lay = Layout(int(m.group(1)), int(m.group(2)), bool(m.group(3)))
    if lay.nodes < 1 or lay.local < 1 or lay.world < 2:
        raise UserError(f"layout {text!r} needs at least 2 ranks")
    if lay.shaped and lay.nodes < 2:
        raise UserError(f"layout {text!r}: a shaped link needs at least 2 nodes")
    return lay


@dataclass
class LayoutResult:
    layout: str
    nodes: int
    local: int
    world: int
    link_mbit: float | None = None
    skipped: str | None = None
    copy_bw: float | None = None
    """Aggregate copy bandwidth of all ranks at once, bytes read+written per second."""
    dispatch_floor: dict[str, Any] | None = None
    notes: dict[str, str] = field(default_factory=dict)
    """Per system: why it was skipped here, or what it measures on this layout."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    roofline: dict[str, Any] = field(default_factory=dict)


# -- small pure functions (unit-tested) ----------------------------------------

def busbw_factor(world_size: int) -> float:
    """nccl-tests' allreduce bus-bandwidth factor 2(n-1)/n."""
    if world_size < 1:
        raise UserError(f"world_size must be >= 1, got {world_size}")
    return 2.0 * (world_size - 1) / world_size


def algbw_gbps(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 B/s) of one rank's ``nbytes`` buffer."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def ratio(a: float, b: float) -> float:
    """a / b, or NaN when b is zero or missing."""
    return a / b if b and b == b else float("nan")


def roofline_seconds(mem_bytes: float, copy_bw: float, link_bytes: float = 0.0,
                     link_bytes_per_s: float | None = None) -> float:
    """Lower bound on one allreduce: memory traffic at copy bandwidth, or link traffic at link rate."""
    t = mem_bytes / copy_bw
    if link_bytes_per_s:
        t = max(t, link_bytes / link_bytes_per_s)
    return t


def pct_of_roofline(roofline_s: float, measured_s: float) -> float:
    return 100.0 * roofline_s / measured_s if measured_s > 0 else float("nan")


def pct_of_link(algbw: float, link_mbit: float) -> float:
    """Algorithm bandwidth (GB/s) as a percentage of a link of ``link_mbit`` Mbit/s."""
    return 100.0 * algbw * 1e9 / (link_mbit * 1e6 / 8)


def aggregate_copy_bw(copies: list[dict[str, Any]]) -> float:
    """Best trial of all ranks copying at once: bytes summed over ranks / slowest rank's seconds."""
    trials: dict[int, list[dict[str, Any]]] = {}
    for e in copies:
        trials.setdefault(e.get("trial", 0), []).append(e)
    return max(sum(e["bytes"] for e in t) / max(e["seconds"] for e in t) for t in trials.values())


def power2_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= 2
    return sizes


def default_iters(nbytes: int) -> int:
    """Fewer iterations for big buffers, so the default run stays within a few minutes."""
    return max(2, min(20, (256 * MiB) // max(nbytes, 1)))


TRAFFIC_MODEL = "fireflyer.fabric.traffic"
"""The roofline's model of what each path reads and writes (:mod:`fireflyer.fabric.traffic`)."""


def engine_path(nbytes: int, nodes: int, config: HFReduceConfig) -> str:
    """The path hfreduce's engine takes for ``nbytes`` per rank on ``nodes`` nodes under ``config``:
    its one-shot limit, and its chunk where unset resolved as the engine resolves it."""
    return traffic.engine_path(nbytes, nodes, oneshot_bytes=config.oneshot_bytes,
                               chunk_bytes=config.chunk_bytes or default_chunk_bytes(nodes))


def path_traffic(nbytes: int, nodes: int, local: int, itemsize: int, config: HFReduceConfig) -> dict[str, Any]:
    """The path the engine takes for an allreduce of ``nbytes`` per rank on ``nodes`` x ``local``
    ranks under ``config``, and that path's memory traffic per node: ``mem_bytes``,
    ``floor_mem_bytes`` and ``link_bytes`` (bytes), and ``traffic_x`` and ``floor_x``, the same
    divided by the tensor (one-shot on 1x4: 28x against the floor's 8x, which is 2L x)."""
    path = engine_path(nbytes, nodes, config)
    t = traffic.engine_traffic(nbytes, local, nodes, itemsize, path=path)
    return {"path": path, **t, "traffic_x": t["mem_bytes"] / nbytes, "floor_x": t["floor_mem_bytes"] / nbytes}


def thresholds(config: HFReduceConfig) -> dict[str, int]:
    """The sizes that pick the engine's path under ``config``: one-shot up to ``oneshot_bytes``
    (on one node, 0 when off), and the chunk on one node and across several."""
    one, many = (config.chunk_bytes or default_chunk_bytes(n) for n in (1, 2))
    return {"oneshot_bytes": min(config.oneshot_bytes, one), "chunk_one_node": one, "chunk_many_nodes": many}


def format_thresholds(th: dict[str, int]) -> str:
    one_shot = (f"one-shot up to {_binary(th['oneshot_bytes'])} on one node, the pipeline above"
                if th["oneshot_bytes"] else "one-shot off, the pipeline on one node")
    return (f"hfreduce thresholds: {one_shot}; several nodes: the pipeline into the trees; chunk "
            f"{_binary(th['chunk_one_node'])} on one node, {_binary(th['chunk_many_nodes'])} across nodes "
            f"(FIREFLYER_HFREDUCE_ONESHOT_BYTES, FIREFLYER_HFREDUCE_CHUNK_BYTES)")


def _binary(nbytes: int) -> str:
    text = format_size(nbytes)
    return f"{text}iB" if text[-1] in "KMG" else f"{text} B"


TIMES = "\u00d7"


def format_x(x: float | None) -> str:
    """A multiple of the tensor: "28x" written with a times sign, one decimal where it is not whole."""
    if x is None or x != x:
        return "-"
    return f"{x:.0f}{TIMES}" if abs(x - round(x)) < 0.05 else f"{x:.1f}{TIMES}"


# -- the peers' run: rounds, medians, floors (unit-tested) ------------------------------

TABLE_SIZES = tuple(k << 10 for k in (4, 64, 256)) + tuple(m * MiB for m in (1, 4, 16, 64, 256))
"""The sizes of issue 15's table: 4 KiB to 256 MiB."""
SYSTEMS = ("candidate", "gloo", "openmpi", "deepspeed")
PEER_SYSTEMS = SYSTEMS[1:]
COLORS = {"candidate": "tab:red", "gloo": "tab:blue", "openmpi": "tab:green", "deepspeed": "tab:purple"}
LABELS = {"gloo": "gloo", "openmpi": "OpenMPI", "deepspeed": "DeepSpeed SHM"}
SHORT = {"gloo": "gloo", "openmpi": "OpenMPI", "deepspeed": "DS-SHM"}
"""Column headers; the notes under the table say what each is."""


def system_label(system: str, candidate: str, short: bool = False) -> str:
    if system == "candidate":
        return _label(candidate)
    return (SHORT if short else LABELS).get(system, system)


SMALL_OPS = ((256 << 10, 150), (4 * MiB, 50))
"""Timed ops per round up to each size: an op of 4 KiB to 256 KiB takes 30 us to 300 us here, so
the median of 2 rounds x 15 moved from run to run; 2 x 150 (and 2 x 50 up to 4 MiB) holds it."""


def default_ops(nbytes: int) -> int:
    """Timed ops per round, every system alike: 150 up to 256 KiB, 50 up to 4 MiB, 15 at 16 MiB
    (issue 15's 2 rounds x 15), fewer above, so the default run stays under ten minutes."""
    for limit, ops in SMALL_OPS:
        if nbytes <= limit:
            return ops
    return max(3, min(15, (512 * MiB) // max(nbytes, 1)))


def default_warmup(nbytes: int) -> int:
    """Untimed ops per round, the first of them checked: 2, or 1 from 64 MiB."""
    return 1 if nbytes >= 64 * MiB else 2


def add_output_flags(p: Any, json_path: str, png_path: str) -> None:
    """The flags ``bench allreduce`` and ``bench alltoall`` name their two outputs with, ``--json`` and ``--png``,
    on the argument parser ``p``, with their defaults (read them through :func:`output_paths`)."""
    p.add_argument("--json", default=None, metavar="PATH",
                   help=f"where the results go, as JSON (default {json_path}; with --busy N, {busy_path(json_path, 'N')})")
    p.add_argument("--png", default=None, metavar="PATH",
                   help=f"where the time-against-size plot goes (default {png_path}; with --busy N, "
                        f"{busy_path(png_path, 'N')})")


def output_paths(a: Any, json_path: str, png_path: str) -> tuple[str, str]:
    """The JSON and PNG paths the flags name, or the defaults (``-busyN`` added on a busy run)."""
    return a.json or busy_path(json_path, a.busy), a.png or busy_path(png_path, a.busy)


def add_busy_flag(p: Any) -> None:
    """``--busy N``, which ``bench allreduce`` and ``bench alltoall`` share."""
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="run N CPU-bound processes beside the ranks for the whole run (a busy host; default 0). "
                        "The default outputs then get a -busyN suffix")


def check_run_flags(a: Any, also: tuple[str, ...] = ()) -> None:
    """The flags ``bench allreduce`` and ``bench alltoall`` share: ``--iters`` >= 1, ``--warmup`` >= 0,
    ``--rounds`` (and the counts ``also`` names, as ``--floor-ops``) >= 1, ``--link-mbit`` and ``--timeout`` > 0."""
    if a.iters is not None and a.iters < 1 or a.warmup is not None and a.warmup < 0:
        raise UserError("--iters must be >= 1 and --warmup >= 0")
    if a.rounds is not None and a.rounds < 1 or any(getattr(a, f[2:].replace("-", "_")) < 1 for f in also):
        raise UserError(" and ".join(("--rounds", *also)) + " must be >= 1")
    if not a.link_mbit > 0 or not a.timeout > 0:
        raise UserError("--link-mbit and --timeout must be positive")
    check_busy(a.busy)


def parse_layouts(text: str) -> tuple[Layout, ...]:
    """``--layouts``: a comma list of :func:`parse_layout`'s names, at least one."""
    layouts = tuple(parse_layout(t) for t in text.split(",") if t.strip())
    if not layouts:
        raise UserError("--layouts is empty")
    return layouts


def op_schedule(sizes: list[int], iters: int | None, warmup: int | None, quick: bool) -> tuple[tuple[int, int, int], ...]:
    """(bytes, timed ops per round, untimed ops per round) per size: ``--iters`` and ``--warmup`` where given,
    else 5 and 1 for ``--quick``, else :func:`default_ops` and :func:`default_warmup`."""
    return tuple((s, iters or (5 if quick else default_ops(s)),
                  warmup if warmup is not None else (1 if quick else default_warmup(s))) for s in sizes)


def memory_floor_bytes(nbytes: int, local: int, nodes: int = 1) -> int:
    """Each rank's input read once and output written once: 2L x the tensor per node, and
    every emulated node shares this host's memory."""
    return 2 * local * nodes * nbytes


def memory_floor_seconds(nbytes: int, local: int, nodes: int, copy_bw: float | None) -> float:
    """The memory floor at ``copy_bw`` (bytes read + written per second, all cores at once)."""
    return memory_floor_bytes(nbytes, local, nodes) / copy_bw if copy_bw else float("nan")


def speedup(peer_s: float | None, candidate_s: float | None) -> float:
    """How many times faster the candidate is than a peer (peer time / candidate time)."""
    if not peer_s or not candidate_s or peer_s != peer_s or candidate_s != candidate_s:
        return float("nan")
    return peer_s / candidate_s


def summarize(samples: list[float], wrong: int, nbytes: int, world: int,
              bus_factor: float | None = None) -> dict[str, Any]:
    """One system at one size: the median of its slowest-rank op times, and what follows.

    ``bus_factor``: busbw / algbw (default allreduce's 2(n-1)/n; all_to_all's is (n-1)/n)."""
    t = median(samples)
    alg = algbw_gbps(nbytes, t)
    factor = busbw_factor(world) if bus_factor is None else bus_factor
    return {"time_s": t, "min_s": min(samples) if samples else float("nan"),
            "mean_s": sum(samples) / len(samples) if samples else float("nan"), "ops": len(samples),
            "algbw": alg, "busbw": alg * factor, "wrong": wrong}


def build_row(*, layout: str, nodes: int, local: int, dtype: str, itemsize: int, nbytes: int,
              measured: dict[str, tuple[list[float], int]], na: dict[str, str], copy_bw: float | None,
              traffic: dict[str, float] | None = None, link_mbit: float | None = None) -> dict[str, Any]:
    """A table row from every system's slowest-rank op times and wrong counts.

    ``na``: the systems that could not run this dtype here, with why. Ratios are the
    candidate's speedup over each peer (peer time / candidate time; > 1: the candidate is
    faster); ``ratio`` is the candidate's algbw over gloo's, as before. ``traffic``: the
    candidate's path and memory traffic at this size (:func:`path_traffic`), for the
    ``path``, ``traffic_x`` and ``floor_x`` columns and the roofline."""
    world = nodes * local
    row: dict[str, Any] = {"layout": layout, "dtype": dtype, "bytes": nbytes, "count": nbytes // itemsize,
                           "na": dict(na)}
    for system, (samples, wrong) in measured.items():
        row[system] = summarize(samples, wrong, nbytes, world)
    for system in na:
        row[system] = None
    cand = row.get("candidate")
    cand_s = cand["time_s"] if cand else None
    row["iters"] = cand["ops"] if cand else max((m[1]["ops"] for m in _measured(row)), default=0)
    row["floor_s"] = memory_floor_seconds(nbytes, local, nodes, copy_bw)
    for system, m in _measured(row):
        m["pct_floor"] = pct_of_roofline(row["floor_s"], m["time_s"])
    row["pct_floor"] = cand["pct_floor"] if cand else float("nan")
    row["speedup"] = {p: speedup(row[p]["time_s"] if row.get(p) else None, cand_s) for p in PEER_SYSTEMS
                      if p in row}
    row["ratio"] = ratio(cand["algbw"], row["gloo"]["algbw"]) if cand and row.get("gloo") else float("nan")
    if traffic is not None:
        if "path" in traffic:
            row.update(path=traffic["path"], traffic_x=traffic["traffic_x"], floor_x=traffic["floor_x"])
        row["traffic"] = {k: traffic[k] for k in ("mem_bytes", "floor_mem_bytes", "link_bytes") if k in traffic}
    if traffic is not None and copy_bw:
        link_rate = link_mbit * 1e6 / 8 if link_mbit else None
        host_mem = traffic["mem_bytes"] * nodes  # every emulated node shares this host's memory
        row["roofline_s"] = roofline_seconds(host_mem, copy_bw, traffic["link_bytes"], link_rate)
        row["pct_roofline"] = pct_of_roofline(row["roofline_s"], cand_s) if cand_s else float("nan")
    if link_mbit:
        for system, m in _measured(row):
            m["pct_link"] = pct_of_link(m["algbw"], link_mbit)
        row["pct_link"] = cand["pct_link"] if cand else float("nan")
        if row.get("gloo"):
            row["gloo_pct_link"] = row["gloo"]["pct_link"]
    return row


def _measured(row: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(s, row[s]) for s in SYSTEMS if isinstance(row.get(s), dict)]


def dispatch_floor(per_rank: list[list[float]], doors: list[dict[str, list[float]]] | None = None) -> dict[str, Any]:
    """The median of the slowest rank's 4-byte ``dist.all_reduce`` on the do-nothing backend; with ``doors``
    (per rank, door -> its times on a one-rank hfreduce group), the same per door."""
    ops = slowest_per_op(per_rank)
    out = {"time_s": median(ops), "ops": len(ops), "backend": "a Python backend whose allreduce does nothing"}
    names = sorted({d for rank in doors or [] for d in rank})
    if names and all(set(rank) == set(names) for rank in doors):
        out["doors_s"] = {d: median(slowest_per_op([rank[d] for rank in doors])) for d in names}
    return out


def wrong_total(rows: list[dict[str, Any]]) -> int:
    return sum(m["wrong"] for row in rows for _, m in _measured(row))


def format_ms(seconds: float | None) -> str:
    """Milliseconds to 3 significant figures (0.0612, 1.08, 24.0, 382)."""
    if seconds is None or seconds != seconds:
        return "-"
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.2f}"
    return f"{ms:.3g}"


# -- report --------------------------------------------------------------------


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)


def _label(candidate: str) -> str:
    return candidate if candidate != "gloo" else "gloo(cand)"


def _present(res: LayoutResult) -> list[str]:
    return [s for s in SYSTEMS if any(s in row for row in res.rows)]


def layout_title(console: Any, res: Any) -> str | None:
    """A layout's table title (nodes, ranks, the shaped link); None, after saying why, when it was skipped."""
    title = f"{res.layout}: {plural(res.nodes, 'node')} x {plural(res.local, 'rank')}, world {res.world}"
    if res.link_mbit:
        title += f", link {res.link_mbit:g} Mbit/s each way"
    if res.skipped:
        console.print(f"[yellow]{title}: skipped: {res.skipped}[/yellow]")
        return None
    return title


def print_layout(console: Any, cfg: Any, res: LayoutResult) -> None:
    """One table per layout (``cfg``: the run's :class:`~fireflyer.bench.allreduce.BenchConfig`): each system's median time, the memory floor, the candidate's
    share of it and its speedup over each peer; then the floors and the peers' notes."""
    from rich.table import Table

    title = layout_title(console, res)
    if title is None:
        return
    systems = _present(res)
    cand = _label(cfg.candidate)
    t = Table(title=title + " - median ms of the slowest rank per op", title_justify="left", show_edge=False,
              pad_edge=False)
    for col in ("size", "type"):
        t.add_column(f"\n{col}", justify="right")
    for s in systems:
        t.add_column(f"{system_label(s, cfg.candidate, short=True)}\nms", justify="right")
    t.add_column("floor\nms", justify="right")
    paths = any("path" in row for row in res.rows)
    if "candidate" in systems:
        t.add_column("%\nfloor", justify="right")
        if paths:
            t.add_column("\npath", justify="left", no_wrap=True)
            t.add_column(f"traffic\n{TIMES}", justify="right")
            t.add_column(f"floor\n{TIMES}", justify="right")
        for p in systems:
            if p != "candidate":
                t.add_column(f"x\n{system_label(p, cfg.candidate, short=True)}", justify="right")
    if res.link_mbit:
        t.add_column("% of\nlink", justify="right")
    t.add_column("\n#wrong", justify="right")
    for row in res.rows:
        cells = [format_size(row["bytes"]), row["dtype"]]
        cells += [format_ms(row[s]["time_s"]) if row.get(s) else ("n/a" if s in row["na"] else "-")
                  for s in systems]
        cells.append(format_ms(row["floor_s"]))
        if "candidate" in systems:
            pct = row["pct_floor"]
            cells.append(_fmt(pct, ".0f" if pct == pct and pct >= 10 else ".2g"))
            if paths:
                cells += [row.get("path", "-"), format_x(row.get("traffic_x")), format_x(row.get("floor_x"))]
            cells += [_fmt(row["speedup"].get(p), ".2f") for p in systems if p != "candidate"]
        if res.link_mbit:
            cells.append(_fmt(row.get("pct_link"), ".1f"))
        wrong = sum(m["wrong"] for _, m in _measured(row))
        cells.append(str(wrong) if not wrong else f"[red]{wrong}[/red]")
        t.add_row(*cells)
    console.print(t)
    console.print(f"  x PEER = {cand}'s speedup over PEER (its time / {cand}'s); DS-SHM = DeepSpeed's CPU SHM "
                  f"allreduce; every op's result is checked exact against the expected sum", soft_wrap=True)
    console.print(f"  floor = the memory floor: each input read once and each output written once "
                  f"({2 * res.local}x the tensor per node x {plural(res.nodes, 'node')} on this host) at the copy bandwidth "
                  f"below; % floor = floor / {cand}'s time", soft_wrap=True)
    if paths and "candidate" in systems:
        console.print(f"  path = the path {cand} takes at that size; traffic{TIMES} = the bytes it reads and writes "
                      f"per node on it / the tensor, floor{TIMES} = the floor's ({2 * res.local}{TIMES}); the "
                      f"roofline uses the path's traffic", soft_wrap=True)
    na = {(s, note) for row in res.rows for s, note in row["na"].items()}
    for s, note in sorted(na):
        console.print(f"  {system_label(s, cfg.candidate)} {note}", soft_wrap=True)
    rf = res.roofline
    if rf.get("copy_bw"):
        console.print(f"  copy bandwidth, {plural(rf['copy_ranks'], 'core')} copying at once: {rf['copy_bw'] / 1e9:.2f} GB/s "
                      f"(read+written); traffic model: {rf['model']}", soft_wrap=True)
    if res.dispatch_floor:
        console.print(f"  dispatch floor: dist.all_reduce of 4 bytes on a Python backend that does nothing: "
                      f"[bold]{res.dispatch_floor['time_s'] * 1e6:.1f} us[/bold] (torch's plugin boundary; "
                      f"median of {res.dispatch_floor['ops']} ops, slowest rank)", soft_wrap=True)
        doors = res.dispatch_floor.get("doors_s")
        if doors:
            console.print("  the same on a one-rank hfreduce group, per door: "
                          + ", ".join(f"{d} [bold]{t * 1e6:.1f} us[/bold]" for d, t in doors.items()), soft_wrap=True)
    if "roofline_s" in rf:
        tr = rf["traffic"]
        console.print(f"  roofline at {format_size(rf['headline_bytes'])} {rf['headline_dtype']}"
                      + (f" ({rf['path']})" if rf.get("path") else "") + ": "
                      f"{tr['mem_bytes'] / 1e6:.0f} MB memory per node x {plural(res.nodes, 'node')} on this host"
                      + (f", {tr['link_bytes'] / 1e6:.0f} MB per link direction" if res.link_mbit else "")
                      + f" -> {rf['roofline_s'] * 1e3:.2f} ms; {cand} took {rf['measured_s'] * 1e3:.2f} ms "
                      f"= [bold]{rf['pct_roofline']:.0f}% of roofline[/bold]", soft_wrap=True)
        if res.link_mbit and rf.get("pct_link") is not None:
            console.print(f"  {cand} algbw at {format_size(rf['headline_bytes'])} {rf['headline_dtype']} = "
                          f"[bold]{rf['pct_link']:.0f}% of link rate[/bold] ({res.link_mbit:g} Mbit/s)")
    for note in dict.fromkeys(res.notes.values()):  # each note names its system; one line each
        console.print(f"  [yellow]{note}[/yellow]", soft_wrap=True)
    console.print()


def plot_series(res: LayoutResult, dtype: str) -> dict[str, list[tuple[int, float]]]:
    """(bytes, seconds) per system of one layout and dtype, plus the memory floor: what the PNG draws."""
    rows = [r for r in res.rows if r["dtype"] == dtype]
    out: dict[str, list[tuple[int, float]]] = {}
    for s in SYSTEMS:
        pts = [(r["bytes"], r[s]["time_s"]) for r in rows if r.get(s) and r[s]["time_s"] == r[s]["time_s"]]
        if pts:
            out[s] = pts
    floor = [(r["bytes"], r["floor_s"]) for r in rows if r["floor_s"] == r["floor_s"]]
    if floor:
        out["memory floor"] = floor
    return out


def write_png(path: str, cfg: Any, results: list[LayoutResult]) -> None:
    """Time against size, log-log: one panel per layout and dtype, every system, the memory
    floor and the dispatch floor."""
    panels = []
    for res in (r for r in results if not r.skipped):
        for dtype in cfg.dtypes:
            lines = []
            for name, pts in plot_series(res, dtype).items():
                if name == "memory floor":
                    lines.append(("memory floor", pts, {"ls": "--", "color": "gray", "lw": 1}))
                else:
                    lines.append((system_label(name, cfg.candidate), pts, {"marker": "o", "ms": 3,
                                                                           "color": COLORS[name]}))
            floor = res.dispatch_floor["time_s"] if res.dispatch_floor else float("nan")
            panels.append({"title": f"{res.layout} {dtype}", "lines": lines,
                           "sizes": sorted({r["bytes"] for r in res.rows if r["dtype"] == dtype}),
                           "hlines": [("dispatch floor", floor)] if floor == floor else []})
    plot_loglog(path, panels, "allreduce, median of the slowest rank per op", "time per allreduce (ms)",
                max(1, len(cfg.dtypes)))
