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
from fireflyer.hfreduce.bench_report import (  # noqa: F401 - re-exported for tests and callers
    HEADLINE_BYTES,
    _label,
    aggregate_copy_bw,
    algbw_gbps,
    busbw_factor,
    default_iters,
    format_size,
    make_console,
    parse_size,
    pct_of_link,
    pct_of_roofline,
    power2_sizes,
    print_layout,
    ratio,
    roofline_seconds,
    traffic_model,
    write_json,
    write_png,
)
from fireflyer.hfreduce.transport import free_port

MiB = 1 << 20
DEFAULT_LAYOUTS = ("1x4", "2x2", "2x2-shaped")
DTYPE_ITEMSIZE = {"fp32": 4, "bf16": 2}
POLL_S = 0.1

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
        master, port = (link.addrs[0], 29500) if link else ("127.0.0.1", free_port())
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
