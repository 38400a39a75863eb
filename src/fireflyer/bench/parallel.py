"""``fireflyer bench parallel``: what the canonical order costs the main job under each parallelism.

For each case (data parallel, FSDP, expert parallel and tensor parallel, on the layouts ``fireflyer train``
runs)
it trains the demo's model for ``--steps`` steps with ``--order fast`` and with ``--order
canonical``, in turn, ``--rounds`` times, through the real CLI (torchrun, hfreduce, the record
reader), and reads each run's training seconds from its ``run.json``: a step's time is the
training time over the steps (the first step's warm-up included in both orders alike). The
ratio of the medians is the canonical order's cost. A tensor-parallel run in the canonical
order computes every linear in ``--linear-blocks`` blocks (the one-process arithmetic every TP
degree dividing it reproduces); the fast one is plain Megatron. One more case prices those
blocks on a data-parallel run, where they buy the bits of the TP layouts.

The same run times the canonical linear alone against ``nn.Linear`` at the main job's shapes
(:mod:`fireflyer.bench.linear`, one thread). Writes ``parallel.json`` and ``parallel.png``.
Not a test: it measures and prints.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fireflyer.bench import linear
from fireflyer.bench.harness import figure, loadavg, median
from fireflyer.bench.skeleton import result_paths, run_bench
from fireflyer.cliutil import ArgumentParser, doc_summary
from fireflyer.errors import UserError

NAME = "parallel"
"""The results' file name, without the extension."""
ORDERS = ("fast", "canonical")


@dataclass(frozen=True)
class Case:
    """One parallelism on one layout: its name, the target ratio, and the flags that set it up."""

    name: str
    target: float
    flags: tuple[str, ...]
    canonical_flags: tuple[str, ...] = ()
    """Flags the canonical run adds (its linear blocks)."""


CASES = (
    Case("ddp 1x4", 1.15, ("--nodes", "1", "--ranks-per-node", "4")),
    Case("fsdp 1x4", 1.15, ("--nodes", "1", "--ranks-per-node", "4", "--fsdp")),
    Case("ep 2x2 (EP=2 x DP=2)", 1.15, ("--nodes", "2", "--ranks-per-node", "2", "--model", "moe", "--ep", "2")),
    Case("tp 1x2 (TP=2)", 1.3, ("--nodes", "1", "--ranks-per-node", "2", "--tp", "2"), ("--linear-blocks", "2")),
    Case("dp x tp 2x2", 1.3, ("--nodes", "2", "--ranks-per-node", "2", "--tp", "2"), ("--linear-blocks", "2")),
    Case("ddp 1x4 linear-blocks 2", 1.3, ("--nodes", "1", "--ranks-per-node", "4"), ("--linear-blocks", "2")),
    Case("pp 2x2 (PP=2 x DP=2)", 1.15, ("--nodes", "2", "--ranks-per-node", "2", "--pp", "2")),
    Case("pp x ep 2x2 (PP=2 x EP=2)", 1.15, ("--nodes", "2", "--ranks-per-node", "2", "--model", "moe", "--pp", "2",
                                             "--ep", "2")),
)


@dataclass(frozen=True)
class ParallelBenchConfig:
    steps: int = 20
    rounds: int = 2
    run_timeout: float = 600.0
    cases: tuple[str, ...] = tuple(c.name for c in CASES)
    out: str = "benchmarks/results"
    linear_rounds: int = 20
    """Rounds of the canonical linear's timing (the document has them as ``linear.rounds``)."""

    def __post_init__(self) -> None:
        if not 2 <= self.steps <= 10_000:
            raise UserError(f"--steps must be 2 to 10000, got {self.steps}")
        if not 1 <= self.rounds <= 100:
            raise UserError(f"--rounds must be 1 to 100, got {self.rounds}")
        known = {c.name for c in CASES}
        unknown = [c for c in self.cases if c not in known]
        if unknown or not self.cases:
            raise UserError(f"unknown case(s) {', '.join(map(repr, unknown)) or '(none given)'}; choose from: "
                            f"{', '.join(sorted(known))}")
        if self.linear_rounds < 1:
            raise UserError(f"--linear-rounds must be at least 1, got {self.linear_rounds}")


def _train(case: Case, order: str, cfg: ParallelBenchConfig, out: Path) -> float:
    """Seconds per training step of one ``fireflyer train`` run of ``case`` in ``order``."""
    flags = [*case.flags, *(case.canonical_flags if order == "canonical" else ())]
    argv = [sys.executable, "-m", "fireflyer.cli", "train", "--order", order, "--steps", str(cfg.steps),
            "--save-every", "0", "--eval-interval", "0", "--eval-batches", "1", "--sample-tokens", "0",
            *flags, "--out", str(out), "--overwrite"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=cfg.run_timeout)
    except subprocess.TimeoutExpired:
        raise UserError(f"{case.name} ({order}) did not finish within {cfg.run_timeout:g} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"{case.name} ({order}) failed: {last}")
    run = json.loads((out / "run.json").read_text())
    return run["timing"]["train_s"] / run["timing"]["steps_this_run"]


def measure(cfg: ParallelBenchConfig) -> list[dict[str, Any]]:
    """Each case's step seconds per order and round (the orders alternating), medians and the ratio."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="fireflyer-bench-parallel-") as tmp:
        for case in (c for c in CASES if c.name in cfg.cases):
            times: dict[str, list[float]] = {o: [] for o in ORDERS}
            for r in range(cfg.rounds):
                for order in (ORDERS if r % 2 == 0 else ORDERS[::-1]):
                    times[order].append(_train(case, order, cfg, Path(tmp) / f"{order}{r}"))
            fast, canonical = median(times["fast"]), median(times["canonical"])
            rows.append({**asdict(case), "step_s": times, "fast_s": fast, "canonical_s": canonical,
                         "ratio": canonical / fast})
            print(f"  {case.name:<28} fast {fast * 1e3:7.1f} ms   canonical {canonical * 1e3:7.1f} ms   "
                  f"{canonical / fast:.2f}x (target <= {case.target:g}x)", flush=True)
    return rows


def _png(path: str, rows: list[dict[str, Any]], linears: dict[str, Any]) -> None:
    with figure(path, 1, 2, figsize=(12, 4.2)) as (fig, (left, right)):
        names = [r["name"] for r in rows]
        left.barh(names, [r["ratio"] for r in rows], color="#4c72b0")
        for i, r in enumerate(rows):
            left.plot([r["target"]] * 2, [i - 0.4, i + 0.4], color="#c44e52")
        left.axvline(1.0, color="black", linewidth=0.8)
        left.set_xlabel("canonical / fast step time (red: target)")
        left.set_title("fireflyer train, the demo's model")
        left.invert_yaxis()
        labels = [f"{r['tokens']}x{r['in_features']}->{r['out_features']}" for r in linears["rows"]]
        width = 0.25
        for j, b in enumerate(linears["blocks"]):
            right.bar([i + j * width for i in range(len(labels))], [r["ratio"][f"blocks={b}"] for r in linears["rows"]],
                      width, label=f"blocks={b}")
        right.axhline(1.0, color="black", linewidth=0.8)
        right.set_xticks([i + width for i in range(len(labels))], labels, fontsize=8)
        right.set_ylabel("CanonicalLinear / nn.Linear (forward+backward)")
        right.set_title("the canonical linear alone, 1 thread")
        right.legend()


def build_config(argv: list[str]) -> ParallelBenchConfig:
    d = ParallelBenchConfig()
    p = ArgumentParser(prog="fireflyer bench parallel", description=doc_summary(__doc__))
    p.add_argument("--steps", type=int, default=d.steps, help=f"training steps per run (default {d.steps})")
    p.add_argument("--rounds", type=int, default=d.rounds, help=f"runs per order and case (default {d.rounds})")
    p.add_argument("--cases", default=",".join(d.cases), help="comma list of cases (default: all)")
    p.add_argument("--linear-rounds", type=int, default=d.linear_rounds, help="rounds of the canonical linear's timing")
    p.add_argument("--out", default=d.out, help=f"the folder {NAME}.json and .png go to (default {d.out})")
    a = p.parse_args(argv)
    return ParallelBenchConfig(steps=a.steps, rounds=a.rounds, out=a.out, linear_rounds=a.linear_rounds,
                               cases=tuple(c.strip() for c in a.cases.split(",") if c.strip()))


def run(cfg: ParallelBenchConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every case's row and the canonical linear's timing, each printed as it is measured."""
    print(f"fireflyer bench parallel: {cfg.steps} steps a run, {cfg.rounds} rounds, fast and canonical in turn")
    rows = measure(cfg)
    linears = linear.measure(linear.DEFAULT_SHAPES, cfg.linear_rounds)
    for r in linears["rows"]:
        ratios = ", ".join(f"{name} {x:.2f}x" for name, x in r["ratio"].items())
        print(f"  linear {r['tokens']} x {r['in_features']} -> {r['out_features']}: nn.Linear "
              f"{r['ms']['nn.Linear']:.2f} ms; {ratios}")
    return rows, linears


def main(argv: list[str]) -> int:
    return run_bench(
        argv, part=NAME, configure=build_config, measure=run,
        fields=lambda cfg, m: {"loadavg": loadavg(),
                               "config": {k: v for k, v in asdict(cfg).items() if k != "linear_rounds"},
                               "cases": m[0], "linear": m[1]},
        plot=lambda path, cfg, m: _png(path, *m), paths=lambda cfg: result_paths(cfg.out, NAME))
