"""``fireflyer bench allreduce``: hfreduce against gloo, OpenMPI and DeepSpeed's CPU SHM allreduce, in one run.

For each layout (``NxL``: N emulated nodes of L ranks; ``NxL-shaped``: each node in its
own network namespace behind a tc-shaped link) it starts up to three process sets of N*L
ranks: the torch ranks (:mod:`fireflyer.bench.allreduce_worker`: the candidate backend
and gloo, in the same processes, with torchrun's environment), DeepSpeed's ranks, and
OpenMPI's ranks under mpirun (:mod:`fireflyer.bench.allreduce_peers`). The parent drives
them all through one control socket: for every dtype and size, each round runs every
system in turn (the order rotates between rounds), so all are measured under the same
conditions, and an idle set waits in a socket read, taking no core. Each op's time is its
slowest rank's, and the figure is the median over rounds x ops. Every system's result is
checked exact against the expected sum.

It also prints the dispatch floor (``dist.all_reduce`` of 4 bytes on a Python backend
that does nothing: torch's plugin boundary), the memory floor of every size (each input
read once and each output written once, 2L x the tensor per node, at the copy bandwidth
of every core at once, measured in the same run), the candidate's speedup over each peer,
and writes JSON and a log-log PNG of time against size.

algbw = bytes of one rank's buffer / time; busbw = algbw * 2(n-1)/n; GB = 1e9 B.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from fireflyer.cliutil import ArgumentParser, doc_summary, plural
from fireflyer.errors import JobFailed, UserError
from fireflyer.bench import allreduce_peers
from fireflyer.bench.harness import bench_command, busy_host, document, progress
from fireflyer.bench.harness import machine_info  # noqa: F401 - re-exported
from fireflyer.bench.skeleton import run_bench
from fireflyer.bench.allreduce_report import (  # noqa: F401 - re-exported for tests and callers
    DEFAULT_LAYOUTS,
    HEADLINE_BYTES,
    Layout,
    LayoutResult,
    SYSTEMS,
    TABLE_SIZES,
    TRAFFIC_MODEL,
    _label,
    add_busy_flag,
    add_output_flags,
    aggregate_copy_bw,
    algbw_gbps,
    build_row,
    busbw_factor,
    check_run_flags,
    output_paths,
    default_iters,
    default_ops,
    default_warmup,
    dispatch_floor,
    format_ms,
    format_size,
    format_thresholds,
    make_console,
    memory_floor_bytes,
    median,
    memory_floor_seconds,
    op_schedule,
    parse_layout,
    parse_layouts,
    parse_size,
    path_traffic,
    pct_of_link,
    pct_of_roofline,
    power2_sizes,
    print_layout,
    ratio,
    roofline_seconds,
    slowest_per_op,
    system_label,
    thresholds,
    wrong_total,
    write_png,
)
from fireflyer.hfreduce.config import HFReduceConfig

MiB = 1 << 20
DTYPE_ITEMSIZE = {"fp32": 4, "bf16": 2}
QUICK_SIZES = (4 << 10, 1 * MiB, 16 * MiB)
TABLE_WIDTH = 144
"""Columns of the report: 2x2's table, with every peer and the path "pipeline+trees", fits in one line."""
COPY_TRIALS = 3  # allreduce_worker.COPY_TRIALS; not imported, so that --help does not import torch
OWNER = {"candidate": "torch", "gloo": "torch", "openmpi": allreduce_peers.OPENMPI, "deepspeed": allreduce_peers.DEEPSPEED}
"""Which process set hosts each system."""

# -- configuration ---------------------------------------------------------------


def parse_systems(text: str, candidate: str) -> tuple[str, ...]:
    """``hfreduce,gloo,openmpi,deepspeed`` (or ``all``) as the report's system keys, in report order."""
    names = {candidate: "candidate", "candidate": "candidate", "gloo": "gloo", "openmpi": "openmpi",
             "mpi": "openmpi", "deepspeed": "deepspeed", "ds": "deepspeed"}
    if candidate == "gloo":
        names["gloo"] = "gloo"  # the baseline; the candidate is then "candidate"
    chosen: set[str] = set()
    for word in (w.strip().lower() for w in text.split(",")):
        if not word:
            continue
        if word == "all":
            chosen.update(SYSTEMS)
        elif word in names:
            chosen.add(names[word])
        else:
            raise UserError(f"unknown system {word!r}; choose from {candidate}, gloo, openmpi, deepspeed, all")
    if not chosen:
        raise UserError(f"--systems is empty; choose from {candidate}, gloo, openmpi, deepspeed, all")
    return tuple(s for s in SYSTEMS if s in chosen)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    layouts: tuple[Layout, ...]
    dtypes: tuple[str, ...]
    schedule: tuple[tuple[int, int, int], ...]
    """(bytes, timed ops per round, untimed ops per round) per size; the first untimed op is checked."""
    systems: tuple[str, ...] = SYSTEMS
    """Report keys: "candidate", "gloo", "openmpi", "deepspeed"."""
    rounds: int = 2
    """Rounds per size; every system runs once per round, in an order that rotates."""
    candidate: str = "hfreduce"
    link_mbit: float = 1000.0
    timeout_s: float = 300.0
    """Per-collective timeout in the workers; the parent gives up on a round after 1.5x this."""
    floor_ops: int = 2000
    """4-byte ops timed for the dispatch floor."""
    build_timeout_s: float = 900.0
    """Seconds DeepSpeed's op may take to JIT-build before the peer is skipped."""
    json_path: str = "benchmarks/results/allreduce.json"
    png_path: str = "benchmarks/results/allreduce.png"
    busy: int = 0
    """CPU-bound processes run beside the ranks for the whole run (``--busy``)."""
    engine: HFReduceConfig = field(default_factory=HFReduceConfig)
    """The engine's config as the candidate ranks read it (``HFReduceConfig.from_env()`` here: they
    inherit this environment), which decides the path each size takes."""

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise UserError(f"rounds must be >= 1, got {self.rounds}")
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems:
            raise UserError(f"systems must be some of {', '.join(SYSTEMS)}, got {self.systems}")

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(s for s in self.systems if s in allreduce_peers.PEERS)


def _sizes(a: Any) -> list[int]:
    if a.sizes and (a.min_bytes or a.max_bytes):
        raise UserError("give --sizes, or --min-bytes/--max-bytes (powers of two between them), not both")
    if a.min_bytes or a.max_bytes:
        min_b, max_b = parse_size(a.min_bytes or "4K"), parse_size(a.max_bytes or "256M")
        if min_b < 4 or min_b % 4 or min_b > max_b:
            raise UserError(f"need 4 <= --min-bytes <= --max-bytes and a multiple of 4, got {min_b} and {max_b}")
        return power2_sizes(min_b, max_b)
    if a.sizes:
        sizes = sorted({parse_size(t) for t in a.sizes.split(",") if t.strip()})
    else:
        sizes = list(QUICK_SIZES if a.quick else TABLE_SIZES)
    if not sizes or any(s < 4 or s % 4 for s in sizes):
        raise UserError(f"--sizes needs sizes of at least 4 bytes, multiples of 4; got {a.sizes!r}")
    return sizes


def build_config(argv: list[str]) -> BenchConfig:
    import argparse
    import textwrap

    # The raw formatter keeps the epilog's lines (install commands) as written, so the description is wrapped here.
    p = ArgumentParser(prog="fireflyer bench allreduce", description=textwrap.fill(doc_summary(__doc__), 79),
                       epilog=ORDER_HELP + "\n\n" + allreduce_peers.INSTALL_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=None, help="comma list of buffer sizes per rank "
                   "(default 4K,64K,256K,1M,4M,16M,64M,256M; --quick 4K,1M,16M)")
    p.add_argument("--min-bytes", default=None, help="with --max-bytes: every power of two between (default 4K)")
    p.add_argument("--max-bytes", default=None, help="with --min-bytes: every power of two between (default 256M)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of: " + ", ".join(DTYPE_ITEMSIZE))
    p.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help="comma list, e.g. 1x4,2x2,2x2-shaped")
    p.add_argument("--systems", default="all", help="comma list of: CANDIDATE (hfreduce), gloo, openmpi, deepspeed; "
                   "or all (default); an absent peer is skipped with a note")
    p.add_argument("--rounds", type=int, default=None, help="rounds per size, systems alternating (default 2; --quick 1)")
    p.add_argument("--iters", type=int, default=None, help="timed ops per round (default 150 up to 256K, 50 up "
                   "to 4M, 15 at 16M, fewer above)")
    p.add_argument("--warmup", type=int, default=None, help="untimed ops per round, the first checked (default 2)")
    p.add_argument("--floor-ops", type=int, default=2000, help="4-byte ops timed for the dispatch floor")
    p.add_argument("--link-mbit", type=float, default=1000.0, help="shaped link rate, Mbit/s each way")
    p.add_argument("--candidate", default="hfreduce", help="backend measured against the others (default hfreduce)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck collective fails")
    add_output_flags(p, BenchConfig.json_path, BenchConfig.png_path)
    add_busy_flag(p)
    p.add_argument("--quick", action="store_true", help="4K,1M,16M, 1 round of 5 ops: a smoke run")
    a = p.parse_args(argv)
    dtypes = tuple(d.strip() for d in a.dtypes.split(",") if d.strip())
    for d in dtypes:
        if d not in DTYPE_ITEMSIZE:
            raise UserError(f"unknown dtype {d!r}; choose from {', '.join(DTYPE_ITEMSIZE)}")
    if not dtypes:
        raise UserError("--dtypes is empty; choose from " + ", ".join(DTYPE_ITEMSIZE))
    check_run_flags(a, also=("--floor-ops",))
    json_path, png_path = output_paths(a, BenchConfig.json_path, BenchConfig.png_path)
    layouts = parse_layouts(a.layouts)
    schedule = op_schedule(_sizes(a), a.iters, a.warmup, a.quick)
    return BenchConfig(layouts=layouts, dtypes=dtypes, schedule=schedule,
                       systems=parse_systems(a.systems, a.candidate), rounds=a.rounds or (1 if a.quick else 2),
                       candidate=a.candidate, link_mbit=a.link_mbit, timeout_s=a.timeout, floor_ops=a.floor_ops,
                       json_path=json_path, png_path=png_path, busy=a.busy, engine=engine_config())


def engine_config() -> HFReduceConfig:
    """The engine's config from this environment, as every candidate rank will read it."""
    try:
        return HFReduceConfig.from_env()
    except ValueError as exc:
        raise UserError(f"the hfreduce settings in this environment are invalid: {exc}") from None


# -- running one layout ------------------------------------------------------------


def _drop_peer(sets: dict[str, allreduce_peers.ProcessSet], res: LayoutResult, exc: allreduce_peers.SetFailed, where: str) -> None:
    """A peer failed: note it, end its processes, and go on without it; the torch ranks' failure is fatal."""
    if exc.set_name == "torch":
        raise exc
    st = sets.pop(exc.set_name)
    st.kill()
    for system, owner in OWNER.items():
        if owner == exc.set_name:
            res.notes[system] = f"{system_label(system, 'candidate')} failed {where}: {exc}"


Measure = Callable[[Any, Layout, dict[str, allreduce_peers.ProcessSet], LayoutResult, Callable[[str], None]], None]
"""What a part does with a layout's process sets once they are up (:func:`_measure` for allreduce)."""


def run_layout(cfg: BenchConfig, lay: Layout, peers: dict[str, allreduce_peers.PeerStatus],
               progress: Callable[[str], None], measure: Measure | None = None) -> LayoutResult:
    """Start the layout's process sets, ``measure`` (default: the allreduce rounds), end them.

    ``cfg`` is a :class:`BenchConfig` or any config with its ``candidate``, ``systems``,
    ``peers``, ``link_mbit`` and ``timeout_s`` (``fireflyer bench alltoall`` passes its own)."""
    from fireflyer.testing import netns

    res = LayoutResult(lay.name, lay.nodes, lay.local, lay.world, cfg.link_mbit if lay.shaped else None)
    if lay.shaped and (reason := netns.netns_unavailable_reason()) is not None:
        res.skipped = reason
        return res
    tmp = tempfile.mkdtemp(prefix=f"ffr-bench-{lay.name}-")
    control = os.path.join(tmp, "control.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(control)
    server.listen(64)
    link = netns.ShapedLink(rate_mbit=cfg.link_mbit, nodes=lay.nodes) if lay.shaped else None
    sets: dict[str, allreduce_peers.ProcessSet] = {}
    pending: list[Any] = []
    keep_logs = False
    try:
        if link is not None:
            link.open()
        allreduce_peers.start_sets(cfg, lay, tmp, control, link, peers, res, sets)
        for _attempt in range(len(sets)):  # each failure drops one peer; the torch ranks' is fatal
            try:
                allreduce_peers.accept(server, sets, max(180.0, cfg.timeout_s), pending)
                break
            except allreduce_peers.SetFailed as exc:
                _drop_peer(sets, res, exc, "to start")
        (measure or _measure)(cfg, lay, sets, res, progress)
        for st in list(sets.values()):
            st.finish()
    except (RuntimeError, OSError) as exc:
        keep_logs = True  # the error message points at them
        raise JobFailed(f"layout {lay.name}: {exc} (logs in {tmp})") from exc
    finally:
        for st in sets.values():
            st.kill()
        allreduce_peers.close_pending(pending)
        server.close()
        if link is not None:
            link.close()
        if not keep_logs and not any("failed" in n for n in res.notes.values()):
            shutil.rmtree(tmp, ignore_errors=True)
        elif not keep_logs:
            for system, note in res.notes.items():
                if "failed" in note:
                    res.notes[system] = f"{note} (logs in {tmp})"
    return res


def _measure(cfg: BenchConfig, lay: Layout, sets: dict[str, allreduce_peers.ProcessSet], res: LayoutResult,
             progress: Callable[[str], None]) -> None:
    """Copy bandwidth, the dispatch floor, then every dtype and size in alternating rounds."""
    torch_set = sets["torch"]
    call_s = 1.5 * cfg.timeout_s + 10
    copies = [c for r in torch_set.call({"cmd": "copy", "first_trial": 0}, call_s) for c in r["copies"]]
    floor = torch_set.call({"cmd": "floor", "ops": cfg.floor_ops}, call_s)
    res.dispatch_floor = dispatch_floor([r["times"] for r in floor], [r.get("doors", {}) for r in floor])
    measured: list[tuple[str, int, dict[str, tuple[list[float], int]], dict[str, str]]] = []
    for di, dtype in enumerate(cfg.dtypes):
        for si, (nbytes, ops, warmup) in enumerate(cfg.schedule):
            runnable, na = [], {}
            for system in cfg.systems:
                st = sets.get(OWNER[system])
                if st is None:
                    continue
                note = st.dtype_note(system, dtype)
                if note:
                    na[system] = note
                else:
                    runnable.append(system)
            samples: dict[str, list[float]] = {s: [] for s in runnable}
            wrong = dict.fromkeys(runnable, 0)
            cmd = {"cmd": "round", "dtype": dtype, "bytes": nbytes, "ops": ops, "warmup": warmup,
                   "size_index": si, "dtype_index": di}
            for rnd in range(cfg.rounds):
                k = rnd % max(1, len(runnable))
                for system in runnable[k:] + runnable[:k]:
                    if OWNER[system] not in sets:
                        continue
                    try:
                        replies = sets[OWNER[system]].call({**cmd, "system": system}, call_s)
                    except allreduce_peers.SetFailed as exc:
                        _drop_peer(sets, res, exc, f"at {dtype} {format_size(nbytes)}")
                        continue
                    samples[system] += slowest_per_op([r["times"] for r in replies])
                    wrong[system] += sum(r["wrong"] for r in replies)
            done = {s: (samples[s], wrong[s]) for s in runnable if OWNER[s] in sets}
            measured.append((dtype, nbytes, done, na))
            progress(f"{lay.name} {dtype} {format_size(nbytes)}: " + ", ".join(
                f"{system_label(s, cfg.candidate)} {format_ms(median(v[0]))} ms" for s, v in done.items()))
    copies += [c for r in torch_set.call({"cmd": "copy", "first_trial": COPY_TRIALS}, call_s) for c in r["copies"]]
    _collect(res, cfg, lay, copies, measured)


def _collect(res: LayoutResult, cfg: BenchConfig, lay: Layout, copies: list[dict[str, Any]],
             measured: list[tuple[str, int, dict[str, tuple[list[float], int]], dict[str, str]]]) -> None:
    res.copy_bw = aggregate_copy_bw(copies)
    hfreduce = "candidate" in cfg.systems and cfg.candidate == "hfreduce"
    for dtype, nbytes, done, na in measured:
        traffic = path_traffic(nbytes, lay.nodes, lay.local, DTYPE_ITEMSIZE[dtype], cfg.engine) if hfreduce else None
        res.rows.append(build_row(layout=lay.name, nodes=lay.nodes, local=lay.local, dtype=dtype,
                                  itemsize=DTYPE_ITEMSIZE[dtype], nbytes=nbytes, measured=done, na=na,
                                  copy_bw=res.copy_bw, traffic=traffic,
                                  link_mbit=cfg.link_mbit if lay.shaped else None))
    res.roofline = {"model": TRAFFIC_MODEL, "copy_bw": res.copy_bw, "copy_ranks": min(lay.world, os.cpu_count() or 1),
                    "copy_bytes_per_rank": 64 * MiB,
                    "host_mem_note": "memory traffic summed over the emulated nodes sharing this host"}
    head = headline_row([r for r in res.rows if r.get("candidate")])
    if head is not None and "roofline_s" in head:
        res.roofline.update(headline_bytes=head["bytes"], headline_dtype=head["dtype"], path=head.get("path"),
                            traffic=head["traffic"],
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
        raise JobFailed(f"`import fireflyer.hfreduce` failed ({exc}); try --candidate gloo") from exc
    if name.lower() not in dist.Backend.backend_list:
        raise UserError(f"backend {name!r} is not registered (have: {', '.join(dist.Backend.backend_list)}); "
                        f"until the engine registers it, use --candidate gloo")


def doc_fields(cfg: BenchConfig, peers: dict[str, allreduce_peers.PeerStatus],
               results: list[LayoutResult]) -> dict[str, Any]:
    """The result document's fields after its head."""
    return {
        "candidate": cfg.candidate,
        "config": {"dtypes": cfg.dtypes, "schedule": cfg.schedule, "rounds": cfg.rounds, "systems": cfg.systems,
                   "busy": cfg.busy,
                   "link_mbit": cfg.link_mbit, "floor_ops": cfg.floor_ops, "thresholds": thresholds(cfg.engine),
                   "timing": "each op's time is its slowest rank's; figures are medians over rounds x ops"},
        "peers": {name: st.to_json() for name, st in peers.items()},
        "layouts": [{k: v for k, v in asdict(r).items() if k not in ("rows", "roofline")} for r in results],
        "dispatch_floor": {r.layout: r.dispatch_floor for r in results if r.dispatch_floor},
        "rooflines": {r.layout: r.roofline for r in results if not r.skipped},
        "ratios": {r.layout: {f"{row['dtype']}/{row['bytes']}": row["ratio"] for row in r.rows} for r in results},
        "speedups": {r.layout: {f"{row['dtype']}/{row['bytes']}": row["speedup"] for row in r.rows} for r in results},
        "rows": [row for r in results for row in r.rows],
    }


ORDER_HELP = ("--order canonical: hfreduce's canonical summation order against its fast one, a benchmark of its "
              "own\n(its flags: fireflyer bench allreduce --order canonical --help)")


def split_order(argv: list[str]) -> tuple[str, list[str]]:
    """``--order ORDER`` or ``--order=ORDER`` taken out of ``argv`` (the last one counts): the order,
    ``fast`` when absent, and the other arguments."""
    order, rest, i = "fast", [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--order":
            if i + 1 >= len(argv):
                raise UserError("--order needs a value: fast or canonical")
            order, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--order="):
            order = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if order not in ("fast", "canonical"):
        raise UserError(f"--order must be fast or canonical, got {order!r}")
    return order, rest


def measure(cfg: BenchConfig) -> tuple[dict[str, allreduce_peers.PeerStatus], list[LayoutResult]]:
    """The peers found and every layout's result, each layout's table printed as it is done."""
    if "candidate" in cfg.systems:
        _check_candidate(cfg.candidate)
    console, say = make_console(width=TABLE_WIDTH), progress()
    peers = allreduce_peers.probe(cfg.peers, cfg.build_timeout_s, say)
    for st in peers.values():
        console.print(f"{system_label(st.name, cfg.candidate)}: {st.version}" if st.available
                      else f"[yellow]{st.note}[/yellow]", soft_wrap=True)
    if "candidate" in cfg.systems and cfg.candidate == "hfreduce":
        console.print(format_thresholds(thresholds(cfg.engine)), soft_wrap=True)
    results = []
    with busy_host(cfg.busy) as hogs:
        if hogs:
            console.print(f"a busy host: {plural(len(hogs), 'CPU-bound process', 'CPU-bound processes')} "
                          f"beside the ranks (--busy {cfg.busy})")
        for lay in cfg.layouts:
            res = run_layout(cfg, lay, peers, say)
            print_layout(console, cfg, res)
            results.append(res)
    return peers, results


def wrong_verdict(wrong: int, columns: str) -> int:
    """1, after a red line on the terminal, when ``wrong`` elements were wrong in all; else 0."""
    if not wrong:
        return 0
    make_console().print(f"[red]{wrong} wrong elements in total; see the {columns}[/red]")
    return 1


def main(argv: list[str]) -> int:
    """Run the benchmark; returns 0, or 1 when any row had wrong results.
    ``--order canonical`` runs :mod:`fireflyer.bench.canonical` instead."""
    order, rest = split_order(list(argv))
    if order == "canonical":
        from fireflyer.bench import canonical

        return canonical.main(rest)
    return run_bench(
        rest, part="allreduce", configure=build_config, measure=measure,
        fields=lambda cfg, m: doc_fields(cfg, *m), plot=lambda path, cfg, m: write_png(path, cfg, m[1]),
        paths=lambda cfg: (cfg.json_path, cfg.png_path), head=lambda _: document(bench_command("allreduce", argv)),
        verdict=lambda cfg, m: wrong_verdict(wrong_total([row for r in m[1] for row in r.rows]), "#wrong columns"))
