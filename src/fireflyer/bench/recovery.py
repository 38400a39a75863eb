"""``fireflyer bench recovery``: fault-tolerant training through killed nodes, against checkpoint-restart.

In one run, on this machine, the same ``fireflyer train --order canonical`` job (``--preset tiny``,
3 nodes x 2 ranks by default) four times:

* plain (no ``--fault-tolerant``), stopped half way (``--stop-at``) and continued with ``--resume``:
  the baseline's step time (``timing.train_s`` over the steps) and the measured restart time of
  checkpoint-restart, from launching the ``--resume`` to its first step's line;
* ``--fault-tolerant`` with no failure: its step time against the plain run's (target at most 1.1x),
  and the useful time of the steps (from the first step's line to the last one's);
* ``--fault-tolerant`` with every rank of one node SIGKILLed each ``--every`` steps (``--kills`` times,
  nodes 1, 2, 1, ...; each kill waits for the last killed node to rejoin, up to ``--rejoin-wait`` s):
  from its run.json, the time from each kill to the next completed step (target at most 5 s), to the
  quorum where the node is back and its heal (target at most 30 s), and its goodput.

Goodput is the no-failure run's time for the steps divided by the killed run's, both from the first
step's line to the last one's. Checkpoint-restart is modelled, from measured parts: each failure
loses half a checkpoint interval of steps (the paper's 5-minute interval scaled to this run as its own
``--save-every`` steps at the plain step time) plus the measured restart. The final weights' sha256
of the killed run must equal the runs' that never failed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fireflyer.bench.harness import figure, make_console
from fireflyer.bench.skeleton import run_bench
from fireflyer.cliutil import ArgumentParser, doc_summary
from fireflyer.errors import UserError

TARGETS = {"ft_step_time_ratio_at_most": 1.1, "kill_to_next_step_s_at_most": 5.0, "rejoin_and_heal_s_at_most": 30.0,
           "ft_goodput_at_least": 0.9, "lost_time_saved_factor_at_least": 2.0}
_STEP = re.compile(r"^step\s+(\d+)/(\d+)\s")
_JOINED = re.compile(r"^step (\d+): (.+) joined;")


@dataclass(frozen=True, kw_only=True)
class RecoveryBenchConfig:
    steps: int = 1500
    every: int = 300
    kills: int = 3
    save_every: int = 100
    nodes: int = 3
    ranks_per_node: int = 2
    preset: str = "tiny"
    rejoin_wait: float = 30.0
    timeout: float = 240.0
    work: str | None = None
    out_dir: str = "benchmarks/results"


def build_config(argv: list[str]) -> RecoveryBenchConfig:
    p = ArgumentParser(prog="fireflyer bench recovery", description=doc_summary(__doc__))
    p.add_argument("--steps", type=int, default=1500, help="steps of each training run (default 1500)")
    p.add_argument("--every", type=int, default=300, help="kill a node every this many steps (default 300)")
    p.add_argument("--kills", type=int, default=3, help="nodes killed in the fault-tolerant run (default 3)")
    p.add_argument("--save-every", type=int, default=100,
                   help="checkpoint interval in steps, of every run and of the checkpoint-restart model (default 100)")
    p.add_argument("--nodes", type=int, default=3, help="emulated nodes, each a replica group (default 3)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node (default 2)")
    p.add_argument("--preset", default="tiny", help="the training preset (default tiny)")
    p.add_argument("--rejoin-wait", type=float, default=30.0,
                   help="seconds a kill waits for the last killed node to rejoin (default 30)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds one training run may take (default 240)")
    p.add_argument("--work", default=None,
                   help="where the runs' out directories go (default: a temporary one, removed)")
    p.add_argument("--out", default="benchmarks/results", help="where recovery.json and recovery.png go")
    a = p.parse_args(argv)
    if a.nodes < 2:
        raise UserError("--nodes must be at least 2: a node is killed and another must survive")
    if a.every < 1 or a.kills < 0 or a.save_every < 1 or a.ranks_per_node < 1:
        raise UserError("--every, --save-every and --ranks-per-node must be at least 1, --kills at least 0")
    if a.every * a.kills >= a.steps:
        raise UserError(f"--every {a.every} x --kills {a.kills} must be below --steps {a.steps}")
    if a.steps < 4:
        raise UserError("--steps must be at least 4")
    return RecoveryBenchConfig(steps=a.steps, every=a.every, kills=a.kills, save_every=a.save_every, nodes=a.nodes,
                               ranks_per_node=a.ranks_per_node, preset=a.preset, rejoin_wait=a.rejoin_wait,
                               timeout=a.timeout, work=a.work, out_dir=a.out)


# -- running fireflyer train and watching its lines ----------------------------------------------


@dataclass
class Run:
    """One ``fireflyer train`` process, its output lines stamped with ``time.time()`` as they arrive."""

    out: str
    proc: subprocess.Popen
    launched: float
    mark: str
    """The run's lifetime mark: every process of it, found by :func:`fireflyer.lifetime.marked`."""
    lines: list[tuple[float, str]] = field(default_factory=list)
    reader: threading.Thread | None = None

    def steps(self) -> list[tuple[float, int]]:
        return [(t, int(m.group(1))) for t, ln in list(self.lines) if (m := _STEP.match(ln))]

    def last_step(self) -> int:
        s = self.steps()
        return s[-1][1] if s else 0

    def joined(self, node: str, after: float) -> bool:
        return any(t >= after and (m := _JOINED.match(ln)) and node in m.group(2).split(", ")
                   for t, ln in list(self.lines))

    def wait(self, timeout: float) -> dict[str, Any]:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise UserError(f"fireflyer train in {self.out} ran past {timeout:.0f} s; its output:\n{self.tail()}")
        if self.reader is not None:
            self.reader.join(timeout=5)
        if rc != 0:
            raise UserError(f"fireflyer train in {self.out} exited {rc}; its output:\n{self.tail()}")
        with open(os.path.join(self.out, "run.json"), encoding="utf-8") as f:
            return json.load(f)

    def tail(self, n: int = 30) -> str:
        return "\n".join(ln for _, ln in self.lines[-n:])


def launch(args: list[str], out: str) -> Run:
    from fireflyer import lifetime

    mark = lifetime.child_mark()
    proc = subprocess.Popen([sys.executable, "-m", "fireflyer", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, env={**os.environ, lifetime.MARK: mark})
    run = Run(out=out, proc=proc, launched=time.time(), mark=mark)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            run.lines.append((time.time(), line.rstrip("\n")))

    run.reader = threading.Thread(target=read, daemon=True)
    run.reader.start()
    return run


def kill_node(node: str, mark: str) -> tuple[float, list[int]]:
    from fireflyer.train.fault_tolerant import node_ranks

    pids = node_ranks(node, mark)
    at = time.time()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return at, pids


# -- the arithmetic (pure: tested without running anything) ------------------------------------------


def step_time(run_json: dict[str, Any]) -> float:
    t = run_json["timing"]
    return t["train_s"] / t["steps_this_run"]


def step_window(steps: list[tuple[float, int]]) -> tuple[float, int]:
    """Seconds from the first step line to the last, and the steps done in between."""
    if len(steps) < 2:
        return float("nan"), 0
    return steps[-1][0] - steps[0][0], steps[-1][1] - steps[0][1]


def recoveries(kills: list[dict[str, Any]], ft: dict[str, Any]) -> list[dict[str, Any]]:
    """Each kill matched with the run's failure, the quorum where its node is back and its heal.

    ``kills``: ``{node, at, step_seen}``; ``ft``: run.json's ``fault_tolerance``."""
    out = []
    for i, k in enumerate(kills):
        until = kills[i + 1]["at"] if i + 1 < len(kills) else float("inf")
        fail = next((f for f in ft.get("failures", []) if k["node"] in f.get("lost", [])
                     and f["at"] + (f.get("recovered_s") or 0.0) >= k["at"] - 0.05), None)
        back = next((q for q in ft.get("quorums", []) if q["at"] > k["at"] and k["node"] in q["replicas"]), None)
        heal = next((h for h in ft.get("heals", []) if h["replica"] == k["node"] and h["at"] > k["at"]), None)
        r: dict[str, Any] = {**k, "failure_step": None, "detected_after_kill_s": None, "recovered_s": None,
                             "kill_to_next_step_s": None, "rejoined_step": None, "rejoin_s": None,
                             "heal_s": None, "heal_bytes": None, "rejoin_and_heal_s": None,
                             "next_kill_before_rejoin": back is not None and back["at"] > until}
        if fail is not None and fail.get("recovered_s") is not None:
            r.update(failure_step=fail["step"], detected_after_kill_s=fail["at"] - k["at"],
                     recovered_s=fail["recovered_s"], kill_to_next_step_s=fail["at"] + fail["recovered_s"] - k["at"])
        if back is not None:
            r.update(rejoined_step=back["step"], rejoin_s=back["at"] - k["at"])
        if heal is not None:
            r.update(heal_s=heal["seconds"], heal_bytes=heal["bytes"])
            r["rejoin_and_heal_s"] = max(r["rejoin_s"] or 0.0, heal["at"] - k["at"]) + heal["seconds"]
        out.append(r)
    return out


def goodput(*, useful_s: float, wall_s: float, failures: int, save_every: int, plain_step_s: float,
            restart_s: float) -> dict[str, Any]:
    """Fault-tolerant goodput (measured) against checkpoint-restart's (modelled from measured parts)."""
    interval_s = save_every * plain_step_s
    per_failure = interval_s / 2 + restart_s
    cr_lost = failures * per_failure
    ft_lost = wall_s - useful_s
    return {
        "useful_s": useful_s, "ft_wall_s": wall_s, "ft_goodput": useful_s / wall_s, "ft_lost_s": ft_lost,
        "cr_checkpoint_interval_s": interval_s, "cr_lost_per_failure_s": per_failure, "cr_lost_s": cr_lost,
        "cr_wall_s": useful_s + cr_lost, "cr_goodput": useful_s / (useful_s + cr_lost),
        "lost_time_saved_factor": (cr_lost / ft_lost) if ft_lost > 0 else None,
    }


# -- the benchmark -------------------------------------------------------------------------------------


PER_RANK = 8
"""Sequences each rank trains on a step (the tiny preset's micro-batch): the global batch grows with the layout."""


def _common(cfg: RecoveryBenchConfig, out: str) -> list[str]:
    return ["--preset", cfg.preset, "--order", "canonical", "--steps", str(cfg.steps), "--save-every",
            str(cfg.save_every), "--eval-interval", str(cfg.steps // 2), "--nodes", str(cfg.nodes),
            "--ranks-per-node", str(cfg.ranks_per_node), "--global-batch", str(PER_RANK * cfg.nodes * cfg.ranks_per_node),
            "--micro-batch-size", str(PER_RANK), "--out", out, "--overwrite"]


def _timeline(run: Run) -> dict[str, Any]:
    return {"launched": run.launched, "steps": [[t - run.launched, s] for t, s in run.steps()]}


def run(cfg: RecoveryBenchConfig, say=print) -> dict[str, Any]:
    from fireflyer.lighthouse import HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS

    work = cfg.work or tempfile.mkdtemp(prefix=".fireflyer-bench-recovery-", dir=os.getcwd())
    os.makedirs(work, exist_ok=True)
    t_bench = time.time()
    try:
        # plain, stopped half way, then resumed: the baseline and the measured restart of checkpoint-restart
        plain_out = os.path.join(work, "plain")
        half = cfg.steps // 2
        say(f"plain run, steps 1-{half} (--stop-at), then --resume to {cfg.steps}")
        first = launch(_common(cfg, plain_out) + ["--stop-at", str(half)], plain_out)
        plain1 = first.wait(cfg.timeout)
        resumed = launch(["--out", plain_out, "--resume"], plain_out)
        plain2 = resumed.wait(cfg.timeout)
        r_steps = resumed.steps()
        restart_s = r_steps[0][0] - resumed.launched
        plain_step_s = (plain1["timing"]["train_s"] + plain2["timing"]["train_s"]) / (
            plain1["timing"]["steps_this_run"] + plain2["timing"]["steps_this_run"])

        say("fault-tolerant run, no failure")
        clean_out = os.path.join(work, "ft-clean")
        clean_run = launch(_common(cfg, clean_out) + ["--fault-tolerant"], clean_out)
        clean = clean_run.wait(cfg.timeout)

        say(f"fault-tolerant run, a node's ranks SIGKILLed every {cfg.every} steps, {cfg.kills} times")
        killed_out = os.path.join(work, "ft-killed")
        killed_run = launch(_common(cfg, killed_out) + ["--fault-tolerant"], killed_out)
        kills: list[dict[str, Any]] = []
        try:
            for k in range(1, cfg.kills + 1):
                node = f"node{1 + (k - 1) % (cfg.nodes - 1)}"
                deadline = time.time() + cfg.timeout
                while (killed_run.last_step() < k * cfg.every and killed_run.proc.poll() is None
                       and time.time() < deadline):
                    time.sleep(0.01)
                if kills:  # let the last killed node rejoin first, so each kill is one failure
                    wait_until = time.time() + cfg.rejoin_wait
                    while (not killed_run.joined(kills[-1]["node"], kills[-1]["at"]) and killed_run.proc.poll() is None
                           and time.time() < wait_until):
                        time.sleep(0.02)
                if killed_run.proc.poll() is not None:
                    break
                at, pids = kill_node(node, killed_run.mark)
                kills.append({"node": node, "at": at, "step_seen": killed_run.last_step(), "pids": pids})
                say(f"  killed {node} ({len(pids)} ranks) after step {kills[-1]['step_seen']}")
            killed = killed_run.wait(cfg.timeout)
        except BaseException:
            if killed_run.proc.poll() is None:
                killed_run.proc.terminate()
            raise
    finally:
        if cfg.work is None:
            shutil.rmtree(work, ignore_errors=True)

    ft = killed["fault_tolerance"]
    rec = recoveries(kills, ft)
    useful_s, useful_steps = step_window(clean_run.steps())
    wall_s, wall_steps = step_window(killed_run.steps())
    gp = goodput(useful_s=useful_s, wall_s=wall_s, failures=len(kills), save_every=cfg.save_every,
                 plain_step_s=plain_step_s, restart_s=restart_s)
    sha = {"plain": plain2["model"]["weights_sha256"], "ft_clean": clean["model"]["weights_sha256"],
           "ft_killed": killed["model"]["weights_sha256"]}

    def worst(key: str) -> float | None:
        xs = [r[key] for r in rec if r[key] is not None]
        return max(xs) if xs else None

    return {
        "bench_s": time.time() - t_bench,
        "step_time": {"plain_s": plain_step_s, "ft_s": step_time(clean), "ratio": step_time(clean) / plain_step_s},
        "restart": {"resume_launch_to_first_step_s": restart_s,
                    "resume_wall_s": resumed.steps()[-1][0] - resumed.launched,
                    "ft_launch_to_first_step_s": clean_run.steps()[0][0] - clean_run.launched},
        "kills": rec,
        "worst": {"kill_to_next_step_s": worst("kill_to_next_step_s"), "rejoin_s": worst("rejoin_s"),
                  "rejoin_and_heal_s": worst("rejoin_and_heal_s"), "heal_s": worst("heal_s")},
        "all_rejoined": all(r["rejoin_s"] is not None for r in rec),
        "bounds": {"lighthouse_heartbeat_timeout_s": HEARTBEAT_TIMEOUT_MS / 1e3,
                   "lighthouse_join_timeout_s": JOIN_TIMEOUT_MS / 1e3,
                   "note": "a killed rank is seen at once by hfreduce (a closed connection, ConnectionLost) by the "
                           "survivors in the collective; the next step waits for a quorum without the dead replica, "
                           "which the Lighthouse forms once its heartbeat is older than the heartbeat timeout; so "
                           "kill-to-next-step is about detection + heartbeat timeout + a redone step. Rejoining is "
                           "bounded by the agent restarting the node's ranks (process start, import torch, data, "
                           "the newest checkpoint) plus the join timeout and one heal over the network."},
        "goodput": {**gp, "useful_steps": useful_steps, "ft_steps": wall_steps},
        "weights_sha256": {**sha, "killed_equals_uninterrupted": sha["ft_killed"] == sha["ft_clean"] == sha["plain"]},
        "fault_tolerance": {k: ft.get(k) for k in ("failures", "quorums", "heals", "redone_steps",
                                                    "dropped_micro_batches")},
        "timelines": {"plain_resume": _timeline(resumed), "ft_clean": _timeline(clean_run),
                      "ft_killed": _timeline(killed_run)},
        "measured": ["step times (run.json timing.train_s / steps)", "restart of --resume (launch to its first "
                     "step line)", "kill times (this process, time.time() right before SIGKILL)", "failures, "
                     "recovered_s, quorums and heals (the killed run's run.json)", "useful time and the killed "
                     "run's time (first to last step line of the no-failure and the killed fault-tolerant run)",
                     "weights' sha256 (run.json)"],
        "modelled": ["checkpoint-restart's lost time per failure = half its checkpoint interval + the measured "
                     "restart; the interval is the paper's 5 minutes scaled to this run as the run's own "
                     "--save-every steps at the plain step time; detecting the failure and rescheduling the job "
                     "are counted as zero for checkpoint-restart (in its favour)"],
    }


def _fmt(x: float | None, unit: str = "s", digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}{(' ' + unit) if unit else ''}"


def _ok(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "NO")


def _print(r: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title="Recovery: fault-tolerant training through killed nodes")
    for col in ("measure", "measured", "target", "met"):
        t.add_column(col, justify="right")
    st, w, gp = r["step_time"], r["worst"], r["goodput"]
    t.add_row("FT step time / plain (no failure)", f"{st['ratio']:.3f}x ({st['ft_s'] * 1e3:.1f} / "
              f"{st['plain_s'] * 1e3:.1f} ms)", "≤ 1.1x", _ok(st["ratio"] <= TARGETS["ft_step_time_ratio_at_most"]))
    for k in r["kills"]:
        t.add_row(f"kill {k['node']} after step {k['step_seen']}: to next step",
                  _fmt(k["kill_to_next_step_s"]), "≤ 5 s",
                  _ok(None if k["kill_to_next_step_s"] is None else k["kill_to_next_step_s"] <= 5))
        t.add_row("  rejoin (quorum) / + heal", f"{_fmt(k['rejoin_s'])} / {_fmt(k['rejoin_and_heal_s'])} "
                  f"({_fmt(k['heal_s'], 's', 3)}, {k['heal_bytes'] or 0:,} B)", "≤ 30 s",
                  _ok(None if k["rejoin_and_heal_s"] is None else k["rejoin_and_heal_s"] <= 30))
    t.add_row("FT goodput (useful / wall)",
              f"{gp['ft_goodput'] * 100:.1f}% ({gp['useful_s']:.1f} / {gp['ft_wall_s']:.1f} s)",
              "≥ 90%", _ok(gp["ft_goodput"] >= 0.9))
    t.add_row("checkpoint-restart goodput (model)", f"{gp['cr_goodput'] * 100:.1f}% (lost {gp['cr_lost_s']:.1f} s)",
              "", "")
    f = gp["lost_time_saved_factor"]
    t.add_row("lost time: checkpoint-restart / FT", "FT lost nothing" if f is None else
              f"{f:.1f}x ({gp['cr_lost_s']:.1f} / {gp['ft_lost_s']:.1f} s)", "≥ 2x", _ok(f is None or f >= 2))
    t.add_row("--resume: launch to first step", _fmt(r["restart"]["resume_launch_to_first_step_s"]), "", "")
    t.add_row("killed run's weights = uninterrupted", str(r["weights_sha256"]["killed_equals_uninterrupted"]),
              "equal", _ok(r["weights_sha256"]["killed_equals_uninterrupted"]))
    make_console().print(t)


def _write_png(path: str, r: dict[str, Any]) -> None:
    with figure(path, 2, 1, figsize=(10, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}) as (fig, (a, b)):
        tl = r["timelines"]
        t0 = tl["ft_killed"]["launched"]
        for name, style in (("ft_clean", {"color": "#999999", "ls": "--", "label": "fault-tolerant, no failure"}),
                            ("ft_killed", {"color": "#1f77b4", "label": "fault-tolerant, nodes killed"})):
            pts = tl[name]["steps"]
            a.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", **style)
        for i, k in enumerate(r["kills"]):
            x = k["at"] - t0
            a.axvline(x, color="#d62728", lw=1, label="SIGKILL of a node's ranks" if i == 0 else None)
            a.annotate(k["node"], (x, 0), xytext=(3, 5), textcoords="offset points", color="#d62728", fontsize=8)
        ft = r["fault_tolerance"]
        heals = [h for h in ft["heals"] if h["step"] > 0]
        if heals:
            a.scatter([h["at"] - t0 for h in heals], [h["step"] for h in heals], marker="^", color="#2ca02c", zorder=3,
                      label="heal from a live replica")
        qs = ft["quorums"]
        a.scatter([q["at"] - t0 for q in qs], [q["step"] for q in qs], marker="s", s=18, color="#ff7f0e", zorder=3,
                  label="quorum change")
        a.set_ylabel("step")
        a.legend(fontsize=8, loc="upper left")
        a.grid(True, alpha=0.3)
        gp = r["goodput"]
        a.set_title(f"Steps over wall time: goodput {gp['ft_goodput'] * 100:.0f}% "
                    f"(checkpoint-restart, modelled: {gp['cr_goodput'] * 100:.0f}%)")
        end = tl["ft_killed"]["steps"][-1][0] if tl["ft_killed"]["steps"] else 0
        xs = [q["at"] - t0 for q in qs] + [end]
        ys = [len(q["replicas"]) for q in qs] + [len(qs[-1]["replicas"]) if qs else 0]
        b.step(xs, ys, where="post", color="#ff7f0e")
        b.set_ylabel("replicas")
        b.set_xlabel("seconds since each run's launch")
        b.set_yticks(range(0, max(ys + [1]) + 1))
        b.grid(True, alpha=0.3)


def main(argv: list[str]) -> int:
    return run_bench(
        argv, part="recovery", configure=build_config, measure=run, report=lambda cfg, r: _print(r),
        fields=lambda cfg, r: {
            "baseline": "the same job without --fault-tolerant; checkpoint-restart modelled from its measured "
                        "step time and --resume restart",
            "targets": TARGETS,
            "config": {"steps": cfg.steps, "every": cfg.every, "kills": cfg.kills, "save_every": cfg.save_every,
                       "nodes": cfg.nodes, "ranks_per_node": cfg.ranks_per_node, "preset": cfg.preset,
                       "order": "canonical"},
            **r},
        plot=lambda path, cfg, r: _write_png(path, r))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
