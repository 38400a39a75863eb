"""``fireflyer bench pp``: the pipeline bubble of GPipe, 1F1B and Interleaved1F1B, measured and in theory.

It starts one pipeline of ``--stages`` ranks, each stage on its own emulated node (the
paper's placement), with real torchrun (:mod:`fireflyer.bench.pp_worker`).
Each rank times every forward and backward its stages run. For one step:

    wall        = last rank's end - first rank's start
    bubble(s)   = 1 - (time stage s spent in forward/backward) / wall

next to the theory for even stages and free communication, ``(p-1)/(m+p-1)`` for GPipe
and 1F1B and ``(p-1)/(v*m+p-1)`` for Interleaved1F1B with ``v`` stages per rank. Measured
idle time also holds the send/receive time that the theory leaves out. It also reports
each stage's peak of activation bytes kept for backward and its peak of micro-batches in
flight, against ``m`` (GPipe) and ``min(m, p-s)`` (1F1B).

When the host has fewer cores than stages, the stages share cores: a forward takes longer
while others compute too (the ``stretch`` column, wall over CPU time of the compute), so
busy time grows and the measured bubble shrinks against a machine with a device per stage.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from fireflyer.cliutil import ArgumentParser, doc_summary, plural
from fireflyer.bench.harness import figure, make_console
from fireflyer.bench.skeleton import result_paths, run_bench, run_ranks
from fireflyer.errors import UserError
from fireflyer.haiscale.pipeline import Schedule

DEFAULT_SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B)


@dataclass(frozen=True, kw_only=True)
class PPBenchConfig:
    """What ``fireflyer bench pp`` runs. Each field is a flag."""

    stages: int = 4
    """Pipeline ranks (p), each on its own emulated node."""
    microbatches: tuple[int, ...] = (4, 8, 16)
    """Micro-batch counts (m) to measure."""
    schedules: tuple[Schedule, ...] = DEFAULT_SCHEDULES
    virtual: int = 2
    """Stages per rank (v) for Interleaved1F1B."""
    width: int = 1024
    """Features of every Linear layer."""
    layers: int = 4
    """Linear+ReLU blocks per rank (split into v stages for Interleaved1F1B)."""
    rows: int = 64
    """Rows per micro-batch."""
    steps: int = 5
    warmup: int = 2
    backend: str = "hfreduce"
    """Default process group backend; on CPU hosts the pipeline's send/recv use it too (haiscale.pipeline)."""
    timeout_s: float = 600.0
    out_dir: str = "benchmarks/results"

    def __post_init__(self) -> None:
        if self.stages < 2:
            raise UserError(f"--stages must be at least 2, got {self.stages}")
        if not self.microbatches or min(self.microbatches) < 1:
            raise UserError(f"--microbatches needs positive counts, got {self.microbatches}")
        if not self.schedules:
            raise UserError("--schedules is empty; choose from " + ", ".join(s.value for s in Schedule))
        if Schedule.ONE_F_ONE_B in self.schedules and min(self.microbatches) < self.stages:
            raise UserError(f"1F1B needs every --microbatches >= --stages ({self.stages}), "
                            f"got {min(self.microbatches)}")
        if Schedule.INTERLEAVED_1F1B in self.schedules:
            if self.virtual < 1 or self.layers % self.virtual:
                raise UserError(f"--layers ({self.layers}) must be a multiple of --virtual ({self.virtual})")
            bad = [m for m in self.microbatches if m % max(1, m // self.stages)]
            if bad:
                raise UserError(f"Interleaved1F1B needs each --microbatches m to be a multiple of m // --stages; "
                                f"{bad} are not (multiples of --stages={self.stages} always work)")
        for name in ("width", "layers", "rows", "steps"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.warmup < 0 or not self.timeout_s > 0:
            raise UserError("--warmup must be >= 0 and --timeout positive")

    @property
    def json_path(self) -> str:
        return result_paths(self.out_dir, "pp")[0]

    @property
    def png_path(self) -> str:
        return result_paths(self.out_dir, "pp")[1]


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise UserError(f"{flag} takes a comma list of integers, got {text!r}") from None


def build_config(argv: list[str]) -> PPBenchConfig:
    p = ArgumentParser(prog="fireflyer bench pp", description=doc_summary(__doc__))
    d = PPBenchConfig()
    p.add_argument("--stages", type=int, default=d.stages, help="pipeline stages = ranks (default 4)")
    p.add_argument("--microbatches", default=",".join(map(str, d.microbatches)), help="comma list (default 4,8,16)")
    p.add_argument("--schedules", default=",".join(s.value for s in d.schedules),
                   help="comma list of: " + ", ".join(s.value for s in Schedule))
    p.add_argument("--virtual", type=int, default=d.virtual, help="stages per rank for Interleaved1F1B (default 2)")
    p.add_argument("--width", type=int, default=d.width, help="Linear features (default 1024)")
    p.add_argument("--layers", type=int, default=d.layers, help="Linear+ReLU blocks per rank (default 4)")
    p.add_argument("--rows", type=int, default=d.rows, help="rows per micro-batch (default 64)")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per case (default 5)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps per case (default 2)")
    p.add_argument("--backend", default=d.backend, help="default process group backend (default hfreduce)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds before the job is stopped")
    p.add_argument("--out", default=d.out_dir, metavar="DIR", help="where pp.json and pp.png go")
    p.add_argument("--quick", action="store_true", help="m = 4,8; 3 steps, 1 warm-up: a smoke run")
    a = p.parse_args(argv)
    try:
        schedules = tuple(dict.fromkeys(Schedule.parse(s.strip()) for s in a.schedules.split(",") if s.strip()))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    mbs = _ints(a.microbatches, "--microbatches")
    steps, warmup = a.steps, a.warmup
    if a.quick:
        mbs = tuple(m for m in mbs if m <= 8) or mbs[:1]
        steps, warmup = min(steps, 3), min(warmup, 1)
    return PPBenchConfig(stages=a.stages, microbatches=mbs, schedules=schedules, virtual=a.virtual,
                         width=a.width, layers=a.layers, rows=a.rows, steps=steps, warmup=warmup,
                         backend=a.backend, timeout_s=a.timeout, out_dir=a.out)


# -- analysis (pure) ---------------------------------------------------------------------


def step_timing(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Wall time of one step and each rank's busy, idle and CPU time in it.

    ``per_rank[r]`` holds that rank's ``start``, ``end`` and ``events``
    (``[kind, microbatch, stage, t0, t1, cpu_s]``), all on one monotonic clock.
    """
    start = min(r["start"] for r in per_rank)
    wall = max(r["end"] for r in per_rank) - start
    busy = [sum(e[4] - e[3] for e in r["events"]) for r in per_rank]
    cpu = [sum(e[5] for e in r["events"]) for r in per_rank]
    return {"wall_s": wall, "busy_s": busy, "cpu_s": cpu,
            "bubble": [1.0 - b / wall if wall > 0 else float("nan") for b in busy]}


def replay(per_rank_events: list[list[list[Any]]], num_stages: int) -> dict[str, Any]:
    """The step a machine with a device per rank would take: the measured ops, replayed.

    Each rank runs its forwards and backwards in the order it ran them, each for the CPU
    time it took, and as soon as its inputs exist: ``F(mb, s)`` after ``F(mb, s-1)``;
    ``B(mb, s)`` after ``F(mb, s)`` and ``B(mb, s+1)``. Communication is free and no rank
    waits for a core, so this separates the schedule's own bubble (with the real, uneven
    op costs) from this host's shared cores and messaging overhead.
    """
    order = [sorted(evs, key=lambda e: e[3]) for evs in per_rank_events]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * len(order)
    busy = [0.0] * len(order)
    pos = [0] * len(order)
    moved = True
    while moved:
        moved = False
        for r, ops in enumerate(order):
            while pos[r] < len(ops):
                kind, mb, stage, _, _, cpu = ops[pos[r]]
                if kind == "F":
                    deps = [("F", mb, stage - 1)] if stage > 0 else []
                else:
                    deps = [("F", mb, stage)] + ([("B", mb, stage + 1)] if stage < num_stages - 1 else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                free[r] = done[(kind, mb, stage)] = start + cpu
                busy[r] += cpu
                pos[r] += 1
                moved = True
    if any(p < len(ops) for p, ops in zip(pos, order)):
        raise UserError("the recorded ops do not form a pipeline schedule (an op waits on one never run)")
    makespan = max(free)
    return {"wall_s": makespan, "bubble": [1.0 - b / makespan if makespan > 0 else float("nan") for b in busy]}


def inflight_theory(schedule: Schedule, pp_size: int, n_mb: int, stage: int) -> int | None:
    """Micro-batches whose activations a stage holds at once at most; None where not modelled."""
    if schedule is Schedule.GPIPE:
        return n_mb
    if schedule is Schedule.ONE_F_ONE_B:
        return min(n_mb, pp_size - stage)
    return None


def analyse(cfg: PPBenchConfig, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (schedule, m) from every rank's records, ranks ordered by pipeline rank."""
    ranks = sorted(ranks, key=lambda r: r["pp_rank"])
    p = len(ranks)
    rows = []
    for i, case in enumerate(ranks[0]["cases"]):
        sched = Schedule.parse(case["schedule"])
        m, v = case["microbatches"], case["virtual"]
        timings = [step_timing([r["cases"][i]["steps"][k] for r in ranks]) for k in range(len(case["steps"]))]
        per_stage = [statistics.median(t["bubble"][s] for t in timings) for s in range(p)]
        replays = [replay([r["cases"][i]["steps"][k]["events"] for r in ranks], p * v)
                   for k in range(len(case["steps"]))]
        replay_stage = [statistics.median(t["bubble"][s] for t in replays) for s in range(p)]
        ops = [e for r in ranks for st in r["cases"][i]["steps"] for e in st["events"]]
        busy = sum(sum(t["busy_s"]) for t in timings)
        cpu = sum(sum(t["cpu_s"]) for t in timings)
        steps = [r["cases"][i]["steps"] for r in ranks]
        fwd_bytes = [statistics.median(b for st in s for b in st["forward_bytes"]) for s in steps]
        rows.append({
            "schedule": sched.value, "microbatches": m, "stages": p, "virtual": v,
            "step_s": statistics.median(t["wall_s"] for t in timings),
            "bubble_measured": statistics.fmean(per_stage),
            "bubble_per_stage": per_stage,
            "bubble_theory": sched.bubble_fraction(p, m, v),
            "bubble_replay": statistics.fmean(replay_stage),
            "bubble_replay_per_stage": replay_stage,
            "replay_step_s": statistics.median(t["wall_s"] for t in replays),
            "fb_cpu_s": sum(e[5] for e in ops) / (len(ops) / 2),
            "stretch": busy / cpu if cpu > 0 else float("nan"),
            "peak_saved_bytes": [max(st["peak_saved_bytes"] for st in s) for s in steps],
            "saved_bytes_per_microbatch": [b * v for b in fwd_bytes],
            "peak_inflight": [max(st["peak_inflight"] for st in s) for s in steps],
            "inflight_theory": [inflight_theory(sched, p, m, s) for s in range(p)],
        })
    return rows


# -- running -----------------------------------------------------------------------------


def run(cfg: PPBenchConfig) -> list[dict[str, Any]]:
    """One row per schedule and micro-batch count, from one pipeline of ``cfg.stages`` ranks, a node each."""
    spec = {"backend": cfg.backend, "schedules": [s.value for s in cfg.schedules],
            "microbatches": list(cfg.microbatches), "virtual": cfg.virtual, "width": cfg.width,
            "layers": cfg.layers, "rows": cfg.rows, "steps": cfg.steps, "warmup": cfg.warmup,
            "timeout_s": cfg.timeout_s}
    ranks = run_ranks("fireflyer.bench.pp_worker", spec, (cfg.stages, 1), timeout_s=cfg.timeout_s,
                      env={"GLOO_SOCKET_IFNAME": "lo"})
    return analyse(cfg, ranks)


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f}"


def print_table(console: Any, cfg: PPBenchConfig, rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    t = Table(title=f"p = {cfg.stages} stages, one per emulated node; Linear {cfg.width}x{cfg.width} x {cfg.layers} "
                    f"per rank; {cfg.rows} rows per micro-batch; Interleaved1F1B with v = {cfg.virtual}; "
                    f"median of {plural(cfg.steps, 'step')}",
              title_justify="left", show_edge=False, pad_edge=False)
    for col in ("schedule", "m", "step\nms", "F+B\nCPU ms", "bubble\nmeasured", "bubble\nreplay",
                "bubble\ntheory", "stretch", "peak saved\nMiB per stage", "in flight per stage\n(theory)"):
        t.add_column(col, justify="left" if col == "schedule" else "right")
    for r in rows:
        theory = "" if r["inflight_theory"][0] is None else " (" + ",".join(map(str, r["inflight_theory"])) + ")"
        t.add_row(r["schedule"], str(r["microbatches"]), f"{r['step_s'] * 1e3:.0f}", f"{r['fb_cpu_s'] * 1e3:.1f}",
                  f"{r['bubble_measured']:.1%}", f"{r['bubble_replay']:.1%}", f"{r['bubble_theory']:.1%}",
                  f"{r['stretch']:.2f}", " ".join(_mib(b) for b in r["peak_saved_bytes"]),
                  ",".join(map(str, r["peak_inflight"])) + theory)
    console.print(t)
    console.print("  measured: 1 - a stage's forward+backward time / the step's wall time, from timestamps, mean "
                  "over stages (idle includes send/recv)\n"
                  "  replay: the same ops at their CPU cost, each rank on its own device, communication free\n"
                  "  theory: (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1); F+B CPU ms: a micro-batch's forward "
                  "plus backward on one stage\n"
                  "  stretch: wall / CPU time of the compute (1.00: a core per stage; above: stages shared cores)",
                  soft_wrap=True)
    cores = os.cpu_count() or 1
    if cores < cfg.stages:
        console.print(f"  [yellow]{cfg.stages} stages share {cores} cores: stages computing at the same time "
                      f"slow each other, so 'measured' is not a device-per-stage figure; 'replay' is the "
                      f"estimate of one[/yellow]", soft_wrap=True)


def write_png(path: str, cfg: PPBenchConfig, rows: list[dict[str, Any]]) -> None:
    """Left: bubble against m, measured, replayed and in theory. Right: peak saved activations per stage."""
    with figure(path, 1, 2, figsize=(12, 4.5)) as (fig, (ax1, ax2)):
        colors = {Schedule.GPIPE.value: "tab:blue", Schedule.ONE_F_ONE_B.value: "tab:red",
                  Schedule.INTERLEAVED_1F1B.value: "tab:green"}
        ms = sorted(cfg.microbatches)
        p = cfg.stages
        ax1.plot(ms, [Schedule.GPIPE.bubble_fraction(p, m) for m in ms], "-", color="gray", lw=2, alpha=0.6,
                 label="theory, GPipe = 1F1B")
        if Schedule.INTERLEAVED_1F1B in cfg.schedules:
            ax1.plot(ms, [Schedule.INTERLEAVED_1F1B.bubble_fraction(p, m, cfg.virtual) for m in ms], "--",
                     color="gray", lw=2, alpha=0.6, label=f"theory, Interleaved1F1B v={cfg.virtual}")
        for sched in cfg.schedules:
            rs = sorted((r for r in rows if r["schedule"] == sched.value), key=lambda r: r["microbatches"])
            x = [r["microbatches"] for r in rs]
            c = colors[sched.value]
            ax1.plot(x, [r["bubble_measured"] for r in rs], "o-", color=c, label=f"{sched.value} measured")
            ax1.plot(x, [r["bubble_replay"] for r in rs], "x:", color=c, label=f"{sched.value} replay")
        ax1.set_xscale("log", base=2)
        ax1.set_xticks(ms, [str(m) for m in ms])
        ax1.set_ylim(0, max([r["bubble_measured"] for r in rows] + [r["bubble_theory"] for r in rows]) * 1.1)
        ax1.set_xlabel("micro-batches per step (m)")
        ax1.set_ylabel("bubble: idle share of a step")
        ax1.set_title(f"bubble, p = {p} stages")
        ax1.grid(True, alpha=0.3)
        ax1.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        m_big = max(cfg.microbatches)
        big = [r for r in rows if r["microbatches"] == m_big]
        width = 0.8 / max(1, len(big))
        for k, r in enumerate(big):
            xs = [s + k * width for s in range(p)]
            ax2.bar(xs, [b / (1 << 20) for b in r["peak_saved_bytes"]], width, color=colors[r["schedule"]],
                    label=r["schedule"])
        ax2.set_xticks([s + 0.4 - width / 2 for s in range(p)], [f"stage {s}" for s in range(p)])
        ax2.set_ylabel("peak activations saved for backward (MiB)")
        ax2.set_title(f"activation memory, m = {m_big}")
        ax2.grid(True, axis="y", alpha=0.3)
        ax2.legend(fontsize=7)
        fig.suptitle(f"pipeline schedules, {plural(p, 'rank')} on {plural(os.cpu_count() or 0, 'core')} (measured: shared cores; "
                     f"replay: a device per rank)")


def main(argv: list[str]) -> int:
    """Run the benchmark, print the table, write ``pp.json`` and ``pp.png`` under ``--out``."""
    return run_bench(
        argv, part="pp", configure=build_config, measure=run,
        report=lambda cfg, rows: print_table(make_console(), cfg, rows),
        fields=lambda cfg, rows: {
            "config": {k: v for k, v in asdict(cfg).items() if k != "out_dir"},
            "reference": {"bubble": "(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for Interleaved1F1B",
                          "replay": "measured op CPU times replayed in each rank's executed order, a device per "
                                    "rank, free communication",
                          "in_flight": "m for GPipe, min(m, p-s) for 1F1B at stage s"},
            "placement": "one pipeline, stage s on emulated node s (make_subgroups(pp_size=stages))",
            "shared_cores": (os.cpu_count() or 1) < cfg.stages,
            "rows": rows},
        plot=write_png)
