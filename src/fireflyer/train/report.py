"""After the job: the loss-curve PNG and the one-screen summary, both made from ``run.json``.

Rank 0 writes ``run.json`` (config, the data read and its reader's counters, per-step
losses, validation losses, timings, allreduce counters, a text sample); this module runs in the launching process, so the
ranks never import matplotlib.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fireflyer.cliutil import plural
from fireflyer.errors import JobFailed, UserError
from fireflyer.fsutil import atomic_write
from fireflyer.train.config import upgrade_saved


def load_run(out: str | Path) -> dict[str, Any]:
    path = Path(out) / "run.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise JobFailed(f"the job ended without writing {path}; see the logs in {Path(out) / 'logs'}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc})") from None


def plot_losses(run: dict[str, Any], path: str | Path) -> Path:
    """Train loss per step and validation loss per evaluation against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = run["history"]
    cfg = upgrade_saved(run["config"])  # its fields by their flag names
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(range(1, len(h["loss"]) + 1), h["loss"], lw=1, color="tab:blue", alpha=0.8, label="train (mean over ranks)")
    if h["val"]:
        steps, losses = zip(*h["val"], strict=True)
        ax.plot(steps, losses, "o-", ms=4, color="tab:orange", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title(f"fireflyer train: {cfg['layers']}-layer GPT, d={cfg['d_model']}, "
                 f"{plural(cfg['nodes'], 'node')} x {plural(cfg['ranks_per_node'], 'rank')}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    atomic_write(str(path), lambda f: fig.savefig(f, format="png"), tmp_name=f".{path.name}.tmp")
    plt.close(fig)
    return path


def summary(run: dict[str, Any], *, wall_s: float, out: str | Path, png: Path | None) -> str:
    """The end-of-run screen: model, world, speed, losses, files, and a sample of generated text."""
    cfg, h, t, ar, w = upgrade_saved(run["config"]), run["history"], run["timing"], run.get("allreduce"), run["world"]
    ft = run.get("fault_tolerance")
    loss = h["loss"]
    val = h["val"]
    status = "finished"
    if not run["finished"]:
        status = f"stopped at step {run['step']} of {cfg['steps']} (continue with --resume)"
    data = run["data"]
    lines = [
        "",
        f"fireflyer train: {status}",
        (f"  model      {run['model']['parameters'] / 1e6:.2f} M parameters: {plural(cfg['layers'], 'layer')}, "
         f"d_model {cfg['d_model']}, {plural(cfg['heads'], 'head')}, context {cfg['context']}, "
         f"{plural(run['model']['vocab_size'], 'character')}"),
        (f"  world      {plural(w['nodes'], 'node')} x {plural(w['ranks_per_node'], 'rank')} = "
         f"{plural(w['world_size'], 'rank')} on {w['device']}, {plural(w['threads_per_rank'], 'thread')} per rank, "
         + ("each node a torchft replica group over hfreduce" if ft else "haiscale DDP over hfreduce")),
        *_layout_lines(run),
        *_fault_lines(ft),
        (f"  data       {data['train_tokens']:,} train / {data['val_tokens']:,} val characters of "
         f"{data['source']}, {data['tokens_per_step']:,} tokens per step"),
        (f"  records    {data['records']['train']:,} + {data['records']['val']:,} windows of {data['window']} tokens "
         f"in {plural(data['shards']['train'] + data['shards']['val'], 'shard')} ({data['hash'][:12]}); shard cache hit rate "
         f"{data['cache_hit_rate']:.1%}, reader stall {data['stall_s']:.3f} s per rank"),
        (f"  speed      {_si(t['tokens_per_s'])} tokens/s over {plural(t['steps_this_run'], 'step')}"
         + (f"; allreduce {ar['gbps']:.2f} GB/s, {_bytes(ar['bytes_per_rank'])} per rank, "
            f"{ar['exposed_wait_s']:.1f} s exposed wait" if ar else "")),
    ]
    if loss:
        lines.append(f"  loss       train {loss[0]:.3f} (step 1) -> {_tail_mean(loss):.3f} "
                     f"(mean of the last {plural(min(10, len(loss)), 'step')})")
    if val:
        lines.append(f"             val {val[0][1]:.3f} (step {val[0][0]}) -> {val[-1][1]:.3f} (step {val[-1][0]})")
    resumed = f", resumed at step {run['resumed_from']}" if run["resumed_from"] is not None else ""
    lines += [
        (f"  time       {wall_s:.1f} s wall: {t['train_s']:.1f} s training, {t['eval_s']:.1f} s eval, "
         f"{t['save_s']:.1f} s saving{resumed}"),
        f"  files      {Path(out) / 'run.json'}" + (f", {png}" if png else "") + f", {Path(out) / 'ckpt'}/",
    ]
    text = run["sample"]["text"]
    if text:
        lines += ["  sample     (seeded, temperature 0.8)"]
        body = text.strip("\n").splitlines()[:8]
        lines += [f"    | {line[:96]}".rstrip() for line in body]
    return "\n".join(lines)


def _fault_lines(ft: dict[str, Any] | None) -> list[str]:
    """A fault-tolerant run's failures: when, which node, the quorum change, the time to the next step."""
    if not ft:
        return []
    failures, heals = ft.get("failures", []), ft.get("heals", [])
    lines = [f"  faults     {plural(len(failures), 'failure')} survived, {plural(ft.get('redone_steps', 0), 'step')} "
             f"redone, {plural(len(heals), 'heal')} from a live replica"
             + (f", {plural(ft['dropped_micro_batches'], 'micro-batch', 'micro-batches')} dropped (order fast)"
                if ft.get("dropped_micro_batches") else "")]
    for f in failures:
        lost = ", ".join(f.get("lost") or []) or "a replica"
        took = f"{f['recovered_s']:.1f} s" if f.get("recovered_s") is not None else "-"
        lines.append(f"             step {f['step']}: {lost} lost, {f['replicas_before']} -> {f['replicas_after']} "
                     f"replicas, next step done {took} after the failure")
    for hl in heals:
        lines.append(f"             step {hl['step']}: {hl['replica']} healed, {_bytes(hl['bytes'])} in "
                     f"{hl['seconds']:.1f} s")
    return lines


def _layout_lines(run: dict[str, Any]) -> list[str]:
    """A laid-out run's experts and layout (nothing for the dense demo's replicas)."""
    lay, m = run.get("layout"), run["model"]
    if not lay:
        return []
    lines = [f"  layout     pp {lay['pp']} x dp {lay['dp']} x ep {lay['ep']} x tp {lay['tp']}; "
             f"{max(m['parameters_per_rank']) / 1e6:.2f} M parameters on the busiest rank"]
    if m.get("kind") == "moe":
        e = run["experts"]
        per_step = sum(e["all_to_all_bytes"]) / len(e["all_to_all_bytes"])
        lines.append(f"  experts    {plural(m['experts'], 'routed expert')} (hidden {m['expert_hidden']} each) + "
                     f"{m['shared_experts']} shared, top-{m['top_k']}, {m['experts_per_rank']} per rank; imbalance "
                     f"{_tail_mean(e['imbalance']):.2f} (mean of the last "
                     f"{plural(min(10, len(e['imbalance'])), 'step')}); all-to-all "
                     f"{_bytes(per_step)} a step over all ranks")
    return lines


def _tail_mean(values: list[float], n: int = 10) -> float:
    tail = values[-n:]
    return sum(tail) / len(tail)


def _si(x: float) -> str:
    return f"{x / 1e6:.2f} M" if x >= 1e6 else f"{x / 1e3:.1f} k" if x >= 1e3 else f"{x:.0f}"


def _bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"
