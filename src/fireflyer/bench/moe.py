"""``fireflyer bench moe``: expert parallelism against replicated experts, in the same run.

On 2 emulated nodes x 2 ranks (started with real torchrun through
:func:`fireflyer.launch.run_local`), every rank trains the same small DeepSeekMoE
(:class:`~fireflyer.train.moe_model.MoEGPT`) on the same seeded token batches two ways
(:mod:`fireflyer.bench.moe_worker`): (a) EP = the ranks of a node, data parallel across nodes,
expert gradients averaged over the ranks that hold the same experts; (b) every expert on
every rank, data parallel over the world. Rounds alternate between the two.

It reports, against the issue's targets:

* expert parameters per rank, counted from the built modules: (a)/(b) should be exactly 1/EP;
* the full training step (forward, backward with DDP's reduction, AdamW, bias update), the
  slowest rank's, median of rounds: (a)/(b) should be at most 1.2x;
* the all-to-all seconds, bytes and calls per step in (a) (from the MoE layers' stats) and their
  share of the step, with the load imbalance the routing produced.

The table goes to the terminal, JSON and a PNG to ``--out`` (``moe.json``, ``moe.png``).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any, Callable

from fireflyer.bench.harness import figure, loadavg, machine_info, make_console, median, progress
from fireflyer.bench.skeleton import run_bench, run_ranks
from fireflyer.cliutil import ArgumentParser, doc_summary, plural
from fireflyer.errors import UserError
from fireflyer.train.moe_model import MoEShape

CONFIGS = ("ep", "replicated")  # the worker's names (fireflyer.bench.moe_worker.CONFIGS), without importing torch
DATA = ("corpus", "random")
PHASES = ("forward", "backward", "optimizer", "bias")
TARGET_STEP_RATIO = 1.2
"""(a)'s step over (b)'s may be at most this."""


@dataclass(frozen=True, kw_only=True)
class MoEBenchConfig:
    layout: tuple[int, int] = (2, 2)
    """NODES x RANKS: EP is the ranks of a node, DP the nodes; (b) is data parallel over all of them."""
    shape: MoEShape = field(default_factory=lambda: MoEShape(vocab_size=65, context=64, layers=2, d_model=128, heads=4,
                                                             n_routed=8, n_shared=1, expert_hidden=128, top_k=2))
    batch: int = 16
    """Sequences per rank per step."""
    data: str = "corpus"
    """``corpus``: windows of the shipped text; ``random``: uniform token ids (see :func:`moe_worker.batches`)."""
    warmup: int = 3
    steps: int = 8
    """Timed steps per round and configuration."""
    rounds: int = 5
    lr: float = 1e-3
    timeout_s: float = 900.0
    out_dir: str = "benchmarks/results"

    def __post_init__(self) -> None:
        nodes, per = self.layout
        if nodes < 1 or per < 2 or nodes * per > 16:
            raise UserError(f"layout {nodes}x{per} needs at least 2 ranks per node (EP inside a node) and at most 16 "
                            "ranks in all, e.g. 2x2")
        if self.shape.n_routed % per:
            raise UserError(f"EP = {per} ranks per node does not divide --experts {self.shape.n_routed}; pick "
                            "an expert count that is a multiple of the ranks per node")
        if self.batch < 1 or self.steps < 1 or self.rounds < 1 or self.warmup < 0:
            raise UserError(f"need --batch, --steps and --rounds >= 1 and --warmup >= 0, got {self.batch}, "
                            f"{self.steps}, {self.rounds}, {self.warmup}")
        if self.data not in DATA:
            raise UserError(f"--data {self.data!r}: choose one of {', '.join(DATA)}")
        if not self.timeout_s > 0 or not self.lr > 0:
            raise UserError("--timeout and --lr must be positive")

    @property
    def ep(self) -> int:
        return self.layout[1]


def _layout(text: str) -> tuple[int, int]:
    try:
        nodes, per = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise UserError(f"layout {text!r} is not NODESxRANKS, e.g. 2x2") from None
    return nodes, per


def corpus_vocab() -> int:
    """The shipped corpus's vocabulary size, one token per character."""
    from fireflyer.train.records import load_corpus

    return len(set(load_corpus()))


def build_config(argv: list[str]) -> MoEBenchConfig:
    p = ArgumentParser(prog="fireflyer bench moe", description=doc_summary(__doc__))
    p.add_argument("--layout", default="2x2", help="NODESxRANKS; EP = RANKS (default 2x2)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks, each with an MoE layer (default 2)")
    p.add_argument("--d-model", type=int, default=128, help="the model's width (default 128)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer (default 8)")
    p.add_argument("--shared", type=int, default=1, help="shared experts per MoE layer (default 1)")
    p.add_argument("--expert-hidden", type=int, default=128, help="each expert's hidden width (default 128)")
    p.add_argument("--top-k", type=int, default=2, help="routed experts per token (default 2)")
    p.add_argument("--data", default="corpus", choices=DATA,
                   help="corpus: windows of the shipped text (default); random: uniform token ids")
    p.add_argument("--vocab", type=int, default=None,
                   help="token ids (default: the corpus's characters, 63; 65 with --data random)")
    p.add_argument("--context", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step (default 16)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration first (default 3)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per round and configuration (default 8)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, alternating the configurations (default 5)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    p.add_argument("--out", default="benchmarks/results", metavar="DIR", help="where moe.json and moe.png go")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 1 layer, d-model 32, 4 experts of 16, context 16, batch 2, 1 round of 2 steps")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.d_model, a.heads, a.experts, a.expert_hidden = 1, 32, 2, 4, 16
        a.context, a.batch, a.warmup, a.steps, a.rounds = 16, 2, 1, 2, 1
    if a.vocab is None:
        a.vocab = corpus_vocab() if a.data == "corpus" else 65
    if a.d_model % max(1, a.heads):
        raise UserError(f"--d-model {a.d_model} must be a multiple of --heads {a.heads}")
    try:
        shape = MoEShape(vocab_size=a.vocab, context=a.context, layers=a.layers, d_model=a.d_model, heads=a.heads,
                         n_routed=a.experts, n_shared=a.shared, expert_hidden=a.expert_hidden, top_k=a.top_k)
    except (UserError, ValueError) as exc:
        raise UserError(f"model flags: {exc}") from exc
    return MoEBenchConfig(layout=_layout(a.layout), shape=shape, batch=a.batch, data=a.data, warmup=a.warmup,
                          steps=a.steps, rounds=a.rounds, timeout_s=a.timeout, out_dir=a.out)


# -- running and collecting ----------------------------------------------------------


def run_layout(cfg: MoEBenchConfig) -> list[dict[str, Any]]:
    """Every rank's results."""
    spec = {"shape": asdict(cfg.shape), "batch": cfg.batch, "data": cfg.data, "warmup": cfg.warmup,
            "steps": cfg.steps, "rounds": cfg.rounds, "lr": cfg.lr, "configs": list(CONFIGS),
            "timeout_s": min(300.0, cfg.timeout_s)}
    return run_ranks("fireflyer.bench.moe_worker", spec, cfg.layout, timeout_s=cfg.timeout_s)


def _slowest(ranks: list[dict[str, Any]], config: str, key: str, over: Callable[[list[float]], float] = max
             ) -> list[list[float]]:
    """Per round, per step: ``over`` the ranks of ``key`` (default the largest: the slowest rank decides a step)."""
    per_rank = [r["configs"][config]["rounds"] for r in ranks]
    rounds = len(per_rank[0])
    return [[over([pr[k][i][key] for pr in per_rank]) for i in range(len(per_rank[0][k]))] for k in range(rounds)]


def _per_step(ranks: list[dict[str, Any]], config: str, key: str,
              over: Callable[[list[float]], float] = max) -> float:
    """The median over rounds of each round's mean per step of ``key`` (``over`` the ranks: the slowest's)."""
    return median(statistics.fmean(steps) for steps in _slowest(ranks, config, key, over))


def summarise_config(ranks: list[dict[str, Any]], config: str) -> dict[str, Any]:
    """One configuration: parameters per rank (from the modules) and the per-step figures."""
    held = [r["configs"][config] for r in ranks]
    row: dict[str, Any] = {
        "ep_size": held[0]["ep_size"],
        "expert_params_per_rank": [h["expert_params"] for h in held],
        "params_per_rank": [h["params"] for h in held],
        "experts_held": held[0]["experts_held"],
        "step_s": _per_step(ranks, config, "step"),
        "step_s_rounds": [statistics.fmean(s) for s in _slowest(ranks, config, "step")],
        "phases_s": {p: _per_step(ranks, config, p, statistics.fmean) for p in PHASES},  # the ranks' mean: they add up
        "a2a_s": _per_step(ranks, config, "a2a_s"),
        "a2a_bytes": _per_step(ranks, config, "a2a_bytes"),
        "a2a_calls": _per_step(ranks, config, "a2a_calls"),
        "ddp_wait_s": _per_step(ranks, config, "ddp_wait_s"),
        "imbalance": _per_step(ranks, config, "imbalance"),
        "dropped": _per_step(ranks, config, "dropped"),
        "final_loss": statistics.fmean(r["configs"][config]["rounds"][-1][-1]["loss"] for r in ranks),
    }
    row["expert_params"] = max(row["expert_params_per_rank"])
    row["params"] = max(row["params_per_rank"])
    row["a2a_share"] = row["a2a_s"] / row["step_s"] if row["step_s"] > 0 else float("nan")
    return row


def verdicts(ep: dict[str, Any], replicated: dict[str, Any], ep_size: int) -> dict[str, Any]:
    """The issue's two targets, met or missed: expert parameters per rank exactly 1/EP of replicated
    (as an exact fraction of the counted parameters), and the step at most ``TARGET_STEP_RATIO`` x."""
    if replicated["expert_params"] <= 0:
        raise UserError("the replicated model holds no expert parameters; the benchmark needs MoE layers")
    params_ratio = Fraction(ep["expert_params"], replicated["expert_params"])
    uneven = len(set(ep["expert_params_per_rank"])) > 1
    step_ratio = ep["step_s"] / replicated["step_s"] if replicated["step_s"] > 0 else float("nan")
    return {
        "expert_params_ratio": float(params_ratio),
        "expert_params_ratio_exact": f"{params_ratio.numerator}/{params_ratio.denominator}",
        "expert_params_target": f"1/{ep_size}",
        "expert_params_met": params_ratio == Fraction(1, ep_size) and not uneven,
        "step_ratio": step_ratio,
        "step_ratio_target": TARGET_STEP_RATIO,
        "step_ratio_met": step_ratio <= TARGET_STEP_RATIO,
        "a2a_share": ep["a2a_share"],
    }


def train_flops(shape: MoEShape, tokens: int) -> float:
    """Matmul FLOPs of one training step on ``tokens`` tokens: 6 x the parameters a token passes through
    (attention, gate, shared and top-k routed experts, head) plus attention's scores (12 x layers x context
    x d_model per token), the usual estimate; for context, not a measurement."""
    d, h = shape.d_model, shape.expert_hidden
    moe_layers = shape.layers - shape.first_dense
    attn = 4 * d * d
    moe = d * shape.n_routed + (shape.n_shared + shape.top_k) * 3 * d * h
    dense_mlp = 8 * d * d
    active = shape.layers * attn + moe_layers * moe + shape.first_dense * dense_mlp + d * shape.vocab_size
    return float(tokens * (6 * active + 12 * shape.layers * shape.context * d))


def summarise(cfg: MoEBenchConfig, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    rows = {c: summarise_config(ranks, c) for c in CONFIGS}
    flops = train_flops(cfg.shape, cfg.batch * cfg.shape.context)
    ep = rows["ep"]
    return {"layout": f"{cfg.layout[0]}x{cfg.layout[1]}", "world": len(ranks), "ep": cfg.ep, "dp": cfg.layout[0],
            "threads_per_rank": ranks[0]["threads"], "rows": rows,
            "verdicts": verdicts(ep, rows["replicated"], cfg.ep),
            "flops_per_rank_step": flops,
            "gflops_per_rank": {c: flops / r["step_s"] / 1e9 for c, r in rows.items() if r["step_s"] > 0},
            "a2a_gbps": ep["a2a_bytes"] / ep["a2a_s"] / 1e9 if ep["a2a_s"] > 0 else None}


# -- report ------------------------------------------------------------------------


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def _short(name: str, res: dict[str, Any]) -> str:
    return f"(a) EP{res['ep']}xDP{res['dp']}" if name == "ep" else f"(b) repl. DP{res['world']}"


def _met(ok: bool) -> str:
    return "[green]met[/green]" if ok else "[red]missed[/red]"


def print_report(console: Any, cfg: MoEBenchConfig, res: dict[str, Any]) -> None:
    from rich.table import Table

    s = cfg.shape
    t = Table(title=f"MoE training step, {res['layout']}: (a) EP={res['ep']} inside a node x DP={res['dp']} across "
                    f"against (b) replicated experts, DP={res['world']} (slowest rank, median of {plural(cfg.rounds, 'round')})",
              title_justify="left", show_edge=False, pad_edge=False)
    for col in ("config", "expert\nparams/rank", "params\n/rank", "step\nms", "fwd*\nms", "bwd+DDP*\nms",
                "AdamW*\nms", "bias*\nms", "a2a\nms/step", "a2a\nshare", "a2a\nKB/step", "a2a\ncalls", "imbal-\nance"):
        t.add_column(col, justify="left" if col == "config" else "right")
    for name, r in res["rows"].items():
        ph, a2a = r["phases_s"], r["a2a_calls"] > 0
        t.add_row(_short(name, res), f"{r['expert_params']:,}", f"{r['params']:,}", _ms(r["step_s"]),
                  _ms(ph["forward"]), _ms(ph["backward"]), _ms(ph["optimizer"]), _ms(ph["bias"]),
                  _ms(r["a2a_s"]) if a2a else "-", f"{r['a2a_share'] * 100:.1f}%" if a2a else "-",
                  f"{r['a2a_bytes'] / 1e3:.0f}" if a2a else "-", f"{r['a2a_calls']:.0f}", f"{r['imbalance']:.2f}")
    console.print(t)
    console.print("  step, a2a: the slowest rank's; * phases: the ranks' mean; a2a = all-to-all inside fwd and bwd; "
                  "imbalance: the busiest layer's busiest expert over the mean")
    v = res["verdicts"]
    console.print(f"  expert params per rank (a)/(b) = {v['expert_params_ratio_exact']} = {v['expert_params_ratio']:.3f}"
                  f" (target exactly {v['expert_params_target']}): {_met(v['expert_params_met'])}")
    console.print(f"  step time (a)/(b) = {v['step_ratio']:.2f}x (target <= {v['step_ratio_target']}x): "
                  f"{_met(v['step_ratio_met'])}")
    ep = res["rows"]["ep"]
    gbps = res["a2a_gbps"]
    console.print(f"  all-to-all in (a): {_ms(ep['a2a_s'])} ms per step = {ep['a2a_share'] * 100:.1f}% of the step, "
                  f"{ep['a2a_bytes'] / 1e3:.0f} KB sent+received per rank per step in {ep['a2a_calls']:.0f} calls"
                  + (f" ({gbps:.3f} GB/s, waits for the slowest peer included)" if gbps else ""))
    mach = machine_info(torch=False)
    load = loadavg()
    g = res["gflops_per_rank"]
    console.print(f"  context: {plural(mach.get('cpu_count') or 0, 'core')} ({mach.get('cpu') or 'cpu'}), "
                  f"{plural(res['world'], 'rank')} of {plural(res['threads_per_rank'], 'thread')}, "
                  f"load {load[0] if load else '?'}; model {plural(s.layers, 'layer')}, d_model {s.d_model}, "
                  f"{plural(s.n_routed, 'routed expert')} (hidden {s.expert_hidden} each) + {s.n_shared} shared, "
                  f"top-{s.top_k}, {cfg.batch}x{s.context} tokens per rank ({cfg.data} data)")
    console.print(f"  roofline: ~{res['flops_per_rank_step'] / 1e9:.3g} GFLOP of matmuls per rank per step "
                  f"(6 x active params x tokens + attention), run at {g.get('ep', 0):.3g} GFLOP/s per rank in (a) and "
                  f"{g.get('replicated', 0):.3g} in (b); EP moves tokens, not work: on balanced routing each rank runs the "
                  f"same expert FLOPs in both, so (a)/(b) above 1 is the exchange and its bookkeeping, plus the waits "
                  f"of imbalance (the rank holding the busiest experts runs more than its share)")


def write_png(path: str, cfg: MoEBenchConfig, res: dict[str, Any]) -> None:
    """Left: the step's phases per configuration, the all-to-all marked. Right: expert parameters per rank."""
    with figure(path, 1, 2, figsize=(11, 4.2)) as (fig, (ax_t, ax_p)):
        names = list(res["rows"])
        xs = range(len(names))
        bottom = [0.0] * len(names)
        colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green", "bias": "tab:purple"}
        for phase in PHASES:
            vals = [res["rows"][n]["phases_s"][phase] * 1e3 for n in names]
            ax_t.bar(list(xs), vals, 0.5, bottom=bottom, label=phase if phase != "backward" else "backward + DDP",
                     color=colors[phase])
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax_t.bar([x + 0.3 for x in xs], [res["rows"][n]["a2a_s"] * 1e3 for n in names], 0.1, color="black",
                 label="all-to-all (inside fwd/bwd)")
        for x, n in zip(xs, names):
            ax_t.text(x, bottom[x], f"step {res['rows'][n]['step_s'] * 1e3:.0f} ms (slowest rank)", ha="center",
                      va="bottom", fontsize=8)
        ax_t.set_xticks(list(xs), [_short(n, res) for n in names], fontsize=8)
        ax_t.set_ylabel("ms per step (phases: mean over ranks)")
        ax_t.set_title(f"step: (a)/(b) = {res['verdicts']['step_ratio']:.2f}x (target <= {TARGET_STEP_RATIO}x)")
        ax_t.legend(fontsize=7)
        ax_p.bar(list(xs), [res["rows"][n]["expert_params"] / 1e3 for n in names], 0.5, color="tab:gray")
        ax_p.axhline(res["rows"]["replicated"]["expert_params"] / 1e3 / res["ep"], color="tab:red", ls="--", lw=1,
                     label=f"replicated / EP ({res['ep']})")
        ax_p.set_xticks(list(xs), [_short(n, res) for n in names], fontsize=8)
        ax_p.set_ylabel("expert parameters per rank (thousands)")
        ax_p.set_title(f"expert params: (a)/(b) = {res['verdicts']['expert_params_ratio_exact']}")
        ax_p.legend(fontsize=8)
        fig.suptitle(f"MoE {res['layout']}: EP={res['ep']} x DP={res['dp']} vs replicated experts, DP={res['world']}")


def measure(cfg: MoEBenchConfig) -> dict[str, Any]:
    """The summary of both configurations."""
    progress()(f"{cfg.layout[0]}x{cfg.layout[1]}: {cfg.warmup} warm-up + {plural(cfg.rounds, 'round')} x "
               f"{plural(cfg.steps, 'step')} of (a) EP x DP and (b) replicated experts ...")
    return summarise(cfg, run_layout(cfg))


def main(argv: list[str]) -> int:
    return run_bench(
        argv, part="moe", configure=build_config, measure=measure,
        report=lambda cfg, res: print_report(make_console(), cfg, res),
        fields=lambda cfg, res: {
            "config": {"layout": res["layout"], "shape": asdict(cfg.shape), "batch": cfg.batch, "data": cfg.data,
                       "warmup": cfg.warmup, "steps": cfg.steps, "rounds": cfg.rounds, "lr": cfg.lr},
            "target": {"expert_params_ratio": f"1/{cfg.ep}", "step_ratio_at_most": TARGET_STEP_RATIO},
            "loadavg": loadavg(),
            **res},
        plot=write_png)
