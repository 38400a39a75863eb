"""Numbers and output of ``fireflyer bench allreduce``: the table math, the nccl-tests style
report, JSON and the PNG. Pure functions first (unit-tested), writers after."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any, Callable

from fireflyer import fsutil
from fireflyer.errors import UserError

if TYPE_CHECKING:
    from fireflyer.hfreduce.bench import BenchConfig, LayoutResult

MiB = 1 << 20
HEADLINE_BYTES = 64 * MiB


# -- small pure functions (unit-tested) ----------------------------------------

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``"1048576"``, ``"512K"``, ``"64M"``, ``"64MiB"``, ``"1G"`` (binary units)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise UserError(f"cannot read size {text!r}; write bytes or a number with K, M or G (e.g. 64M)")
    value = float(m.group(1)) * 1024 ** "bkmgt".index((m.group(2) or "b").lower())
    if value != int(value):
        raise UserError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def format_size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", MiB), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def busbw_factor(world_size: int) -> float:
    """nccl-tests' allreduce bus-bandwidth factor 2(n-1)/n."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
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


def fallback_memory_traffic(nbytes: int, local_size: int, num_nodes: int, dtype_itemsize: int) -> dict[str, float]:
    """Our own estimate while ``engine.memory_traffic`` does not exist.

    Per node: each rank's input read once and output written once is the floor;
    the engine's shared-memory reduce moves about 5S per rank plus S for the node's
    reduced buffer. On the NIC, a double binary tree moves S per direction with two
    nodes and about 2S beyond.
    """
    s, lsz = float(nbytes), local_size
    link = 0.0 if num_nodes == 1 else (s if num_nodes == 2 else 2 * s)
    return {"mem_bytes": lsz * (5 * s + s / lsz), "link_bytes": link, "floor_mem_bytes": 2 * lsz * s}


def traffic_model() -> tuple[Callable[..., dict[str, float]], str]:
    try:
        from fireflyer.hfreduce.traffic import memory_traffic
    except Exception as exc:  # the engine is absent or not importable yet
        return fallback_memory_traffic, f"fallback ({type(exc).__name__}: engine.memory_traffic unavailable)"
    return memory_traffic, "fireflyer.hfreduce.traffic.memory_traffic"



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


def default_ops(nbytes: int) -> int:
    """Timed ops per round: 15 up to 16 MiB (issue 15's 2 rounds x 15), fewer above."""
    return max(3, min(15, (512 * MiB) // max(nbytes, 1)))


def default_warmup(nbytes: int) -> int:
    """Untimed ops per round, the first of them checked: 2, or 1 from 64 MiB."""
    return 1 if nbytes >= 64 * MiB else 2


def median(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def slowest_per_op(per_rank: list[list[float]]) -> list[float]:
    """Each op's time is its slowest rank's: the element-wise max over ranks' per-op seconds."""
    if not per_rank:
        return []
    n = len(per_rank[0])
    if any(len(t) != n for t in per_rank):
        raise ValueError(f"ranks timed different numbers of ops: {[len(t) for t in per_rank]}")
    return [max(col) for col in zip(*per_rank)]


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


def summarize(samples: list[float], wrong: int, nbytes: int, world: int) -> dict[str, Any]:
    """One system at one size: the median of its slowest-rank op times, and what follows."""
    t = median(samples)
    alg = algbw_gbps(nbytes, t)
    return {"time_s": t, "min_s": min(samples) if samples else float("nan"),
            "mean_s": sum(samples) / len(samples) if samples else float("nan"), "ops": len(samples),
            "algbw": alg, "busbw": alg * busbw_factor(world), "wrong": wrong}


def build_row(*, layout: str, nodes: int, local: int, dtype: str, itemsize: int, nbytes: int,
              measured: dict[str, tuple[list[float], int]], na: dict[str, str], copy_bw: float | None,
              traffic: dict[str, float] | None = None, link_mbit: float | None = None) -> dict[str, Any]:
    """A table row from every system's slowest-rank op times and wrong counts.

    ``na``: the systems that could not run this dtype here, with why. Ratios are the
    candidate's speedup over each peer (peer time / candidate time; > 1: the candidate is
    faster); ``ratio`` is the candidate's algbw over gloo's, as before."""
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


def dispatch_floor(per_rank: list[list[float]]) -> dict[str, Any]:
    """The median of the slowest rank's 4-byte ``dist.all_reduce`` on the do-nothing backend."""
    ops = slowest_per_op(per_rank)
    return {"time_s": median(ops), "ops": len(ops), "backend": "a Python backend whose allreduce does nothing"}


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


def make_console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(width=max(132, Console().width), highlight=False, stderr=stderr)


def _present(res: LayoutResult) -> list[str]:
    return [s for s in SYSTEMS if any(s in row for row in res.rows)]


def print_layout(console: Any, cfg: BenchConfig, res: LayoutResult) -> None:
    """One table per layout: each system's median time, the memory floor, the candidate's
    share of it and its speedup over each peer; then the floors and the peers' notes."""
    from rich.table import Table

    title = f"{res.layout}: {res.nodes} node(s) x {res.local} ranks, world {res.world}"
    if res.link_mbit:
        title += f", link {res.link_mbit:g} Mbit/s each way"
    if res.skipped:
        console.print(f"[yellow]{title}: skipped: {res.skipped}[/yellow]")
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
    if "candidate" in systems:
        t.add_column("%\nfloor", justify="right")
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
                  f"({2 * res.local}x the tensor per node x {res.nodes} node(s) on this host) at the copy bandwidth "
                  f"below; % floor = floor / {cand}'s time", soft_wrap=True)
    na = {(s, note) for row in res.rows for s, note in row["na"].items()}
    for s, note in sorted(na):
        console.print(f"  {system_label(s, cfg.candidate)} {note}", soft_wrap=True)
    rf = res.roofline
    if rf.get("copy_bw"):
        console.print(f"  copy bandwidth, {rf['copy_ranks']} cores copying at once: {rf['copy_bw'] / 1e9:.2f} GB/s "
                      f"(read+written); traffic model: {rf['model']}", soft_wrap=True)
    if res.dispatch_floor:
        console.print(f"  dispatch floor: dist.all_reduce of 4 bytes on a Python backend that does nothing: "
                      f"[bold]{res.dispatch_floor['time_s'] * 1e6:.1f} us[/bold] (torch's plugin boundary; "
                      f"median of {res.dispatch_floor['ops']} ops, slowest rank)", soft_wrap=True)
    if "roofline_s" in rf:
        tr = rf["traffic"]
        console.print(f"  roofline at {format_size(rf['headline_bytes'])} {rf['headline_dtype']}: "
                      f"{tr['mem_bytes'] / 1e6:.0f} MB memory per node x {res.nodes} node(s) on this host"
                      + (f", {tr['link_bytes'] / 1e6:.0f} MB per link direction" if res.link_mbit else "")
                      + f" -> {rf['roofline_s'] * 1e3:.2f} ms; {cand} took {rf['measured_s'] * 1e3:.2f} ms "
                      f"= [bold]{rf['pct_roofline']:.0f}% of roofline[/bold]", soft_wrap=True)
        if res.link_mbit and rf.get("pct_link") is not None:
            console.print(f"  {cand} algbw at {format_size(rf['headline_bytes'])} {rf['headline_dtype']} = "
                          f"[bold]{rf['pct_link']:.0f}% of link rate[/bold] ({res.link_mbit:g} Mbit/s)")
    for note in dict.fromkeys(res.notes.values()):  # each note names its system; one line each
        console.print(f"  [yellow]{note}[/yellow]", soft_wrap=True)
    console.print()


def atomic_write(path: str, write: Callable[[Any], None]) -> None:
    """Write via a temporary file, fsync, rename: readers never see a half-written file."""
    fsutil.atomic_write(path, write)


def write_json(path: str, doc: dict[str, Any]) -> None:
    def clean(x: Any) -> Any:  # NaN is not JSON
        if isinstance(x, float) and x != x:
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    atomic_write(path, lambda f: f.write(json.dumps(clean(doc), indent=1).encode() + b"\n"))


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


def write_png(path: str, cfg: BenchConfig, results: list[LayoutResult]) -> None:
    """Time against size, log-log: one panel per layout and dtype, every system, the memory
    floor and the dispatch floor."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results if not r.skipped]
    ncols = max(1, len(cfg.dtypes))
    nrows = max(1, len(shown))
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.2 * nrows), squeeze=False)
    for i, res in enumerate(shown):
        for j, dtype in enumerate(cfg.dtypes):
            ax = axes[i][j]
            for name, pts in plot_series(res, dtype).items():
                xs, ys = [p[0] for p in pts], [p[1] * 1e3 for p in pts]
                if name == "memory floor":
                    ax.plot(xs, ys, ls="--", color="gray", lw=1, label="memory floor")
                else:
                    ax.plot(xs, ys, "-o", ms=3, color=COLORS[name], label=system_label(name, cfg.candidate))
            if res.dispatch_floor and res.dispatch_floor["time_s"] == res.dispatch_floor["time_s"]:
                ax.axhline(res.dispatch_floor["time_s"] * 1e3, color="gray", ls=":", lw=1, label="dispatch floor")
            ax.set_xscale("log", base=2)
            sizes = sorted({r["bytes"] for r in res.rows if r["dtype"] == dtype})
            if sizes:
                ax.set_xticks(sizes, [format_size(b) for b in sizes])
                ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_yscale("log")
            ax.set_title(f"{res.layout} {dtype}")
            ax.set_xlabel("bytes per rank")
            ax.set_ylabel("time per allreduce (ms)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("allreduce, median of the slowest rank per op")
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
