"""``fireflyer bench allreduce``: hfreduce against gloo, side by side, in one run.

For each layout (``NxL``: N emulated nodes of L ranks; ``NxL-shaped``: each node in
its own network namespace behind a tc-shaped link) it starts N*L real worker
processes (:mod:`fireflyer.hfreduce.bench_worker`) with torchrun's environment.
Every worker joins the candidate backend and a gloo group, so both are measured
in the same processes, interleaved per size. The output is an nccl-tests style
table per layout, a roofline against measured copy bandwidth, JSON and a PNG.

algbw = bytes of one rank's buffer / time; busbw = algbw * 2(n-1)/n; GB = 1e9 B.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from fireflyer.cliutil import ArgumentParser
from fireflyer.errors import UserError

MiB = 1 << 20
DEFAULT_LAYOUTS = ("1x4", "2x2", "2x2-shaped")
DTYPE_ITEMSIZE = {"fp32": 4, "bf16": 2}
HEADLINE_BYTES = 64 * MiB
POLL_S = 0.1

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


# -- configuration ---------------------------------------------------------------


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


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    layouts: tuple[Layout, ...]
    dtypes: tuple[str, ...]
    schedule: tuple[tuple[int, int, int], ...]
    """(bytes, iters, warmup) per size."""
    candidate: str = "hfreduce"
    link_mbit: float = 1000.0
    timeout_s: float = 300.0
    """Per-collective timeout in the workers; the parent gives up after 1.5x this without progress."""
    json_path: str = "benchmarks/results/allreduce.json"
    png_path: str = "benchmarks/results/allreduce.png"



def build_config(argv: list[str]) -> BenchConfig:
    p = ArgumentParser(prog="fireflyer bench allreduce", description=__doc__.split("\n\n")[0])
    p.add_argument("--min-bytes", default=None, help="smallest buffer per rank (default 1M; --quick 1M)")
    p.add_argument("--max-bytes", default=None, help="largest buffer per rank (default 256M; --quick 16M)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of: " + ", ".join(DTYPE_ITEMSIZE))
    p.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help="comma list, e.g. 1x4,2x2,2x2-shaped")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per size (default: fewer for big sizes)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations per size")
    p.add_argument("--link-mbit", type=float, default=1000.0, help="shaped link rate, Mbit/s each way")
    p.add_argument("--candidate", default="hfreduce", help="backend measured against gloo (default hfreduce)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck collective fails")
    p.add_argument("--json", default=BenchConfig.json_path, metavar="PATH")
    p.add_argument("--png", default=BenchConfig.png_path, metavar="PATH")
    p.add_argument("--quick", action="store_true", help="1M..16M, 5 iterations: a smoke run")
    a = p.parse_args(argv)
    min_b = parse_size(a.min_bytes or "1M")
    max_b = parse_size(a.max_bytes or ("16M" if a.quick else "256M"))
    dtypes = tuple(d.strip() for d in a.dtypes.split(",") if d.strip())
    for d in dtypes:
        if d not in DTYPE_ITEMSIZE:
            raise UserError(f"unknown dtype {d!r}; choose from {', '.join(DTYPE_ITEMSIZE)}")
    if not dtypes:
        raise UserError("--dtypes is empty; choose from " + ", ".join(DTYPE_ITEMSIZE))
    if min_b < 4 or min_b % 4 or min_b > max_b:
        raise UserError(f"need 4 <= --min-bytes <= --max-bytes and a multiple of 4, got {min_b} and {max_b}")
    if a.iters is not None and a.iters < 1 or a.warmup is not None and a.warmup < 0:
        raise UserError("--iters must be >= 1 and --warmup >= 0")
    if not a.link_mbit > 0 or not a.timeout > 0:
        raise UserError("--link-mbit and --timeout must be positive")
    layouts = tuple(parse_layout(t) for t in a.layouts.split(",") if t.strip())
    if not layouts:
        raise UserError("--layouts is empty")
    schedule = []
    for s in power2_sizes(min_b, max_b):
        iters = a.iters or (5 if a.quick else default_iters(s))
        warmup = a.warmup if a.warmup is not None else (1 if a.quick else max(1, iters // 5))
        schedule.append((s, iters, warmup))
    return BenchConfig(layouts=layouts, dtypes=dtypes, schedule=tuple(schedule), candidate=a.candidate,
                       link_mbit=a.link_mbit, timeout_s=a.timeout, json_path=a.json, png_path=a.png)


# -- running one layout ------------------------------------------------------------


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
    rows: list[dict[str, Any]] = field(default_factory=list)
    roofline: dict[str, Any] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LAYOUT_ENV = ("GLOO_SOCKET_IFNAME", "FIREFLYER_NODE_ID", "FIREFLYER_HFREDUCE_IFADDR")
"""Set per layout; any other FIREFLYER_* setting passes through to the workers."""


def _worker_env(lay: Layout, rank: int, master_addr: str, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAYOUT_ENV and not k.startswith("TORCHELASTIC_")}
    node = rank // lay.local
    env.update(RANK=str(rank), WORLD_SIZE=str(lay.world), LOCAL_RANK=str(rank % lay.local),
               LOCAL_WORLD_SIZE=str(lay.local), GROUP_RANK=str(node), MASTER_ADDR=master_addr,
               MASTER_PORT=str(port), FIREFLYER_NODE_ID=f"node{node}", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    return env


class _Workers:
    """The worker processes of one layout; kills them all on any way out."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _last_line(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:300] if lines else "(empty log)"


def run_layout(cfg: BenchConfig, lay: Layout, progress: Callable[[str], None]) -> LayoutResult:
    from fireflyer.hfreduce import netns

    res = LayoutResult(lay.name, lay.nodes, lay.local, lay.world, cfg.link_mbit if lay.shaped else None)
    if lay.shaped and (reason := netns.netns_unavailable_reason()) is not None:
        res.skipped = reason
        return res
    tmp = tempfile.mkdtemp(prefix=f"ffr-bench-{lay.name}-")
    spec_path = os.path.join(tmp, "spec.json")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump({"events_dir": tmp, "candidate": cfg.candidate, "timeout_s": cfg.timeout_s,
                   "dtypes": list(cfg.dtypes), "schedule": [list(s) for s in cfg.schedule]}, f)
    argv = [sys.executable, "-m", "fireflyer.hfreduce.bench_worker", spec_path]
    workers = _Workers()
    link = netns.ShapedLink(rate_mbit=cfg.link_mbit, nodes=lay.nodes) if lay.shaped else None
    keep_logs = False
    try:
        if link is not None:
            link.open()
        master, port = (link.addrs[0], 29500) if link else ("127.0.0.1", _free_port())
        for rank in range(lay.world):
            env = _worker_env(lay, rank, master, port)
            log = open(os.path.join(tmp, f"rank{rank}.log"), "wb")
            kw: dict[str, Any] = dict(env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
            if link is None:
                env["GLOO_SOCKET_IFNAME"] = "lo"
                workers.procs.append(subprocess.Popen(argv, **kw))
            else:
                node = rank // lay.local
                env.update(GLOO_SOCKET_IFNAME=link.ifname, FIREFLYER_HFREDUCE_IFADDR=link.addrs[node])
                workers.procs.append(link.popen(node, argv, **kw))
            log.close()
        events = _monitor(cfg, lay, workers, tmp, progress)
        _collect(res, cfg, lay, events)
    except RuntimeError:
        keep_logs = True  # the error message points at them
        raise
    finally:
        workers.kill()
        if link is not None:
            link.close()
        if not keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)
    return res


def _monitor(cfg: BenchConfig, lay: Layout, workers: _Workers, tmp: str,
             progress: Callable[[str], None]) -> list[list[dict[str, Any]]]:
    """Read every rank's events until all are done; raise on a failed or stalled worker."""
    events: list[list[dict[str, Any]]] = [[] for _ in range(lay.world)]
    offsets = [0] * lay.world
    last_progress = time.monotonic()
    stall_s = 1.5 * cfg.timeout_s + 10
    while True:
        for r in range(lay.world):
            path = os.path.join(tmp, f"rank{r}.jsonl")
            if not os.path.exists(path):
                continue
            with open(path, "rb") as f:
                f.seek(offsets[r])
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            offsets[r] += len(complete)
            for line in complete.decode().splitlines():
                ev = json.loads(line)
                events[r].append(ev)
                last_progress = time.monotonic()
                if r == 0 and ev["event"] == "row" and ev["backend"] == "gloo":
                    cand = next(e for e in reversed(events[0]) if e["event"] == "row" and e["backend"] != "gloo")
                    progress(f"{lay.name} {ev['dtype']} {format_size(ev['bytes'])}: {_label(cfg.candidate)} "
                             f"{cand['mean_s'] * 1e3:.2f} ms, gloo {ev['mean_s'] * 1e3:.2f} ms (rank 0)")
        codes = [p.poll() for p in workers.procs]
        for r, rc in enumerate(codes):
            if rc not in (None, 0):
                workers.kill()
                raise RuntimeError(f"layout {lay.name}: rank {r} exited with code {rc}: "
                                   f"{_last_line(os.path.join(tmp, f'rank{r}.log'))} (logs in {tmp})")
        if all(rc == 0 for rc in codes):
            if not all(evs and evs[-1]["event"] == "done" for evs in events):
                raise RuntimeError(f"layout {lay.name}: workers exited before finishing (logs in {tmp})")
            return events
        if time.monotonic() - last_progress > stall_s:
            workers.kill()
            raise RuntimeError(f"layout {lay.name}: no progress from the workers in {stall_s:.0f} s; "
                               f"killed them (logs in {tmp})")
        time.sleep(POLL_S)


def _collect(res: LayoutResult, cfg: BenchConfig, lay: Layout, events: list[list[dict[str, Any]]]) -> None:
    res.copy_bw = aggregate_copy_bw([e for evs in events for e in evs if e["event"] == "copy"])
    model, source = traffic_model()
    factor = busbw_factor(lay.world)
    by_key: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for evs in events:
        for e in evs:
            if e["event"] == "row":
                by_key.setdefault((e["dtype"], e["bytes"], e["backend"]), []).append(e)
    for dtype in cfg.dtypes:
        for nbytes, iters, _ in cfg.schedule:
            row: dict[str, Any] = {"layout": lay.name, "dtype": dtype, "bytes": nbytes,
                                   "count": nbytes // DTYPE_ITEMSIZE[dtype], "iters": iters}
            for backend in ("candidate", "gloo"):
                evs = by_key[(dtype, nbytes, backend)]
                t = max(e["mean_s"] for e in evs)
                alg = algbw_gbps(nbytes, t)
                row[backend] = {"time_s": t, "algbw": alg, "busbw": alg * factor,
                                "wrong": sum(e["wrong"] for e in evs)}
            row["ratio"] = ratio(row["candidate"]["algbw"], row["gloo"]["algbw"])
            traffic = model(nbytes, lay.local, lay.nodes, DTYPE_ITEMSIZE[dtype])
            # Every emulated node shares this one host's memory.
            host_mem = traffic["mem_bytes"] * lay.nodes
            link_rate = cfg.link_mbit * 1e6 / 8 if lay.shaped else None
            row["roofline_s"] = roofline_seconds(host_mem, res.copy_bw, traffic["link_bytes"], link_rate)
            row["pct_roofline"] = pct_of_roofline(row["roofline_s"], row["candidate"]["time_s"])
            if lay.shaped:
                row["pct_link"] = pct_of_link(row["candidate"]["algbw"], cfg.link_mbit)
                row["gloo_pct_link"] = pct_of_link(row["gloo"]["algbw"], cfg.link_mbit)
            res.rows.append(row)
    head = headline_row(res.rows)
    res.roofline = {"model": source, "copy_bw": res.copy_bw, "copy_ranks": min(lay.world, os.cpu_count() or 1), "copy_bytes_per_rank": 64 * MiB,
                    "host_mem_note": "memory traffic summed over the emulated nodes sharing this host"}
    if head is not None:
        traffic = model(head["bytes"], lay.local, lay.nodes, DTYPE_ITEMSIZE[head["dtype"]])
        res.roofline.update(headline_bytes=head["bytes"], headline_dtype=head["dtype"], traffic=traffic,
                            roofline_s=head["roofline_s"], measured_s=head["candidate"]["time_s"],
                            pct_roofline=head["pct_roofline"], pct_link=head.get("pct_link"))


def headline_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The 64 MiB fp32 row, else the largest fp32 row below it, else the largest row."""
    if not rows:
        return None
    fp32 = [r for r in rows if r["dtype"] == "fp32" and r["bytes"] <= HEADLINE_BYTES]
    return max(fp32 or rows, key=lambda r: r["bytes"])


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


def _atomic_write(path: str, write: Callable[[Any], None]) -> None:
    """Write via ``path.tmp``, fsync, rename: readers never see a half-written file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: str, doc: dict[str, Any]) -> None:
    def clean(x: Any) -> Any:  # NaN is not JSON
        if isinstance(x, float) and x != x:
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    _atomic_write(path, lambda f: f.write(json.dumps(clean(doc), indent=1).encode() + b"\n"))


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
    _atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


# -- entry point ------------------------------------------------------------------


def _check_candidate(name: str) -> None:
    if name == "gloo":
        return
    import torch.distributed as dist

    try:
        import fireflyer.hfreduce  # noqa: F401
    except Exception as exc:
        raise RuntimeError(f"`import fireflyer.hfreduce` failed ({exc}); try --candidate gloo") from exc
    if name.lower() not in dist.Backend.backend_list:
        raise UserError(f"backend {name!r} is not registered (have: {', '.join(dist.Backend.backend_list)}); "
                        f"until the engine registers it, use --candidate gloo")


def main(argv: list[str]) -> int:
    """Run the benchmark; returns 0, or 1 when any row had wrong results."""
    cfg = build_config(list(argv))
    _check_candidate(cfg.candidate)
    console, errcon = make_console(), make_console(stderr=True)
    results = []
    for lay in cfg.layouts:
        res = run_layout(cfg, lay, lambda msg: errcon.print(f"[dim]  {msg}[/dim]"))
        print_layout(console, cfg, res)
        results.append(res)
    doc = {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": [os.path.basename(sys.argv[0])] + sys.argv[1:],
        "machine": machine_info(),
        "candidate": cfg.candidate,
        "config": {"dtypes": cfg.dtypes, "schedule": cfg.schedule, "link_mbit": cfg.link_mbit},
        "layouts": [{k: v for k, v in asdict(r).items() if k not in ("rows", "roofline")} for r in results],
        "rooflines": {r.layout: r.roofline for r in results if not r.skipped},
        "ratios": {r.layout: {f"{row['dtype']}/{row['bytes']}": row["ratio"] for row in r.rows} for r in results},
        "rows": [row for r in results for row in r.rows],
    }
    write_json(cfg.json_path, doc)
    write_png(cfg.png_path, cfg, results)
    console.print(f"wrote {cfg.json_path} and {cfg.png_path}", highlight=False)
    wrong = sum(row[b]["wrong"] for r in results for row in r.rows for b in ("candidate", "gloo"))
    if wrong:
        console.print(f"[red]{wrong} wrong elements in total; see the #wrong columns[/red]")
        return 1
    return 0


def machine_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"hostname": socket.gethostname(), "platform": platform.platform(),
                            "python": platform.python_version(), "torch": torch.__version__,
                            "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        with open("/proc/meminfo", encoding="utf-8") as f:
            info["mem_total_kib"] = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
    except (OSError, StopIteration, ValueError):
        pass
    return info
