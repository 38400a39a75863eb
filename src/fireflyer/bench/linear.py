"""``fireflyer bench linear``: what the canonical linear's fixed blocks cost against ``nn.Linear``, on one thread.

For each shape (tokens x in_features -> out_features; by default the main job's fc, proj and qkv
at 16 x 64 tokens, and one larger layer) it times one forward and backward (input, weight and
bias gradients) of ``nn.Linear`` and of :class:`~fireflyer.haiscale.canonical_linear.CanonicalLinear`
with 1, 2 and 4 blocks: the one-process arithmetic every TP degree reproduces. Each round times
every variant once, in turn, so load shifts all alike; figures are medians over rounds. Writes
``linear.json``. Not a test: it measures and prints the ratios.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fireflyer.bench.harness import loadavg, median
from fireflyer.bench.skeleton import run_bench
from fireflyer.cliutil import ArgumentParser, doc_summary
from fireflyer.errors import UserError

NAME = "linear"
"""The results' file name, without the extension."""
DEFAULT_SHAPES: tuple[tuple[int, int, int], ...] = (
    (1024, 128, 512),  # the main job's MLP fc: 16 sequences x 64 tokens, d_model 128
    (1024, 512, 128),  # its MLP proj
    (1024, 128, 384),  # its fused qkv
    (1024, 512, 2048),  # a larger layer
)
BLOCKS = (1, 2, 4)
WARMUP = 2


def _step(layer: Any, x: Any, dy: Any) -> float:
    """Seconds of one forward and backward, gradients cleared first."""
    layer.zero_grad(set_to_none=True)
    x.grad = None
    start = time.perf_counter()
    layer(x).backward(dy)
    return time.perf_counter() - start


def _shape_row(tokens: int, fan_in: int, fan_out: int, rounds: int) -> dict[str, Any]:
    import torch
    from torch import nn

    from fireflyer.haiscale.canonical_linear import CanonicalLinear

    torch.manual_seed(0)
    linear = nn.Linear(fan_in, fan_out)
    variants = {"nn.Linear": linear, **{f"blocks={b}": CanonicalLinear.from_linear(linear, b) for b in BLOCKS}}
    x = torch.randn(tokens, fan_in, requires_grad=True)
    dy = torch.randn(tokens, fan_out)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(WARMUP + rounds):
        for name, layer in variants.items():
            seconds = _step(layer, x, dy)
            if r >= WARMUP:
                times[name].append(seconds)
    base = median(times["nn.Linear"])
    return {"tokens": tokens, "in_features": fan_in, "out_features": fan_out,
            "ms": {name: median(t) * 1e3 for name, t in times.items()},
            "ratio": {name: median(t) / base for name, t in times.items() if name != "nn.Linear"}}


def measure(shapes: Sequence[tuple[int, int, int]] = DEFAULT_SHAPES, rounds: int = 20) -> dict[str, Any]:
    """Median forward+backward milliseconds of each variant per shape ``(tokens, in, out)``, on one torch
    thread (restored after), and each CanonicalLinear's ratio to ``nn.Linear``."""
    import torch

    if rounds < 1:
        raise UserError(f"rounds must be at least 1, got {rounds}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [_shape_row(*shape, rounds) for shape in shapes]
    finally:
        torch.set_num_threads(threads)
    return {"threads": 1, "rounds": rounds, "blocks": list(BLOCKS), "rows": rows}


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """Shapes from ``"1024x128x512,1024x512x128"`` (tokens x in x out, comma-separated)."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise UserError(f"cannot read shape {item.strip()!r}; write TOKENSxINxOUT, e.g. 1024x128x512")
        shapes.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return shapes


@dataclass(frozen=True, kw_only=True)
class LinearBenchConfig:
    shapes: tuple[tuple[int, int, int], ...] = DEFAULT_SHAPES
    """``(tokens, in_features, out_features)`` per layer timed."""
    rounds: int = 20
    out_dir: str = "benchmarks/results"


def build_config(argv: list[str]) -> LinearBenchConfig:
    p = ArgumentParser(prog="fireflyer bench linear", description=doc_summary(__doc__))
    p.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in DEFAULT_SHAPES),
                   help="layers to time, TOKENSxINxOUT comma-separated (default: the main job's fc, proj, qkv "
                        "and 1024x512x2048)")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds per shape; figures are medians (default 20)")
    p.add_argument("--out", default="benchmarks/results", help=f"the folder {NAME}.json goes to")
    a = p.parse_args(argv)
    return LinearBenchConfig(shapes=tuple(parse_shapes(a.shapes)), rounds=a.rounds, out_dir=a.out)


def print_table(cfg: LinearBenchConfig, result: dict[str, Any]) -> None:
    """Each shape's milliseconds per variant and each CanonicalLinear's ratio to ``nn.Linear``."""
    names = ["nn.Linear"] + [f"blocks={b}" for b in BLOCKS]
    print(f"forward+backward, 1 thread, median of {cfg.rounds} rounds (ms; ratio to nn.Linear)")
    print(f"{'tokens x in -> out':<22}" + "".join(f"{n:>20}" for n in names))
    for row in result["rows"]:
        cells = [f"{row['ms']['nn.Linear']:.3f}"]
        cells += [f"{row['ms'][n]:.3f} ({row['ratio'][n]:.2f}x)" for n in names[1:]]
        label = f"{row['tokens']} x {row['in_features']} -> {row['out_features']}"
        print(f"{label:<22}" + "".join(f"{c:>20}" for c in cells))


def main(argv: list[str]) -> int:
    return run_bench(argv, part=NAME, configure=build_config, measure=lambda cfg: measure(cfg.shapes, cfg.rounds),
                     report=print_table, fields=lambda cfg, result: {"loadavg": loadavg(), **result})
