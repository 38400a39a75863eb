"""Numbers and output of ``fireflyer bench allreduce``: the table math, the nccl-tests style
report, JSON and the PNG. Pure functions first (unit-tested), writers after."""

from __future__ import annotations

import json
import os
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
        from fireflyer.hfreduce.engine import memory_traffic  # type: ignore[attr-defined]
    except Exception as exc:  # the engine is absent or not importable yet
        return fallback_memory_traffic, f"fallback ({type(exc).__name__}: engine.memory_traffic unavailable)"
    return memory_traffic, "fireflyer.hfreduce.engine.memory_traffic"



# -- report --------------------------------------------------------------------


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)


def _label(candidate: str) -> str:
    return candidate if candidate != "gloo" else "gloo(cand)"


def make_console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(width=max(132, Console().width), highlight=False, stderr=stderr)


def print_layout(console: Any, cfg: BenchConfig, res: LayoutResult) -> None:
    """nccl-tests style table of one layout, then its roofline and link lines."""
    from rich.table import Table

    title = f"{res.layout}: {res.nodes} node(s) x {res.local} ranks, world {res.world}"
    if res.link_mbit:
        title += f", link {res.link_mbit:g} Mbit/s each way"
    if res.skipped:
        console.print(f"[yellow]{title}: skipped: {res.skipped}[/yellow]")
        return
    cand = _label(cfg.candidate)
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for col in ("size(B)", "count", "type"):
        t.add_column(f"\n{col}", justify="right")
    for name in (cand, "gloo"):
        for i, col in enumerate(("time(us)", "algbw", "busbw", "#wrong")):
            t.add_column(f"{name if i == 0 else ''}\n{col}", justify="right")
    t.add_column("ratio\nalgbw", justify="right")
    if res.link_mbit:
        t.add_column("% of\nlink", justify="right")
    for row in res.rows:
        cells = [str(row["bytes"]), str(row["count"]), row["dtype"]]
        for b in ("candidate", "gloo"):
            m = row[b]
            wrong = str(m["wrong"]) if not m["wrong"] else f"[red]{m['wrong']}[/red]"
            cells += [_fmt(m["time_s"] * 1e6, ".1f"), _fmt(m["algbw"], ".3f"), _fmt(m["busbw"], ".3f"), wrong]
        cells.append(_fmt(row["ratio"], ".2f"))
        if res.link_mbit:
            cells.append(_fmt(row.get("pct_link"), ".1f"))
        t.add_row(*cells)
    console.print(t)
    console.print(f"  GB/s = 1e9 B/s; ratio = {cand} algbw / gloo algbw"
                  + (f"; % of link = {cand} algbw / link rate" if res.link_mbit else ""))
    rf = res.roofline
    console.print(f"  copy bandwidth, {rf['copy_ranks']} cores copying at once: {rf['copy_bw'] / 1e9:.2f} GB/s "
                  f"(read+written); traffic model: {rf['model']}")
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


def write_png(path: str, cfg: BenchConfig, results: list[LayoutResult]) -> None:
    """algbw against size, one panel per layout, candidate against gloo, log-x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results if not r.skipped]
    fig, axes = plt.subplots(1, max(1, len(shown)), figsize=(5 * max(1, len(shown)), 4), squeeze=False)
    for ax, res in zip(axes[0], shown):
        for b, color in (("candidate", "tab:red"), ("gloo", "tab:blue")):
            for dtype, style in zip(cfg.dtypes, ("-", "--", ":")):
                rows = [r for r in res.rows if r["dtype"] == dtype]
                label = f"{cfg.candidate if b == 'candidate' else 'gloo'} {dtype}"
                ax.plot([r["bytes"] for r in rows], [r[b]["algbw"] for r in rows], style, color=color,
                        marker="o", ms=3, label=label)
        if res.link_mbit:
            ax.axhline(res.link_mbit * 1e6 / 8 / 1e9, color="gray", lw=0.8, ls=":", label="link rate")
        ax.set_xscale("log", base=2)
        ax.set_title(res.layout)
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("algbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"allreduce: {cfg.candidate} vs gloo")
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


