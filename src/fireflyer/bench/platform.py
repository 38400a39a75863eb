"""``fireflyer bench platform``: the scheduler's cycle time, a suspend→resume round trip, and a simulated day.

All in one run, one JSON (``bench-platform.json``) and one PNG (``bench-platform.png``):

1. **Scheduling cycle.** 10,000 queued tasks (mixed priorities, 200 users in 10 groups,
   1 to 32 nodes, quotas for some users) over 1,250 nodes in 2 zones, with the cluster
   in the state the policy itself would leave it: the tasks it would start on an empty
   cluster are running (for 0 to 8 hours, so turn-taking is live), then a tenth of them
   finished and freed their nodes. Timed: the pure :func:`~fireflyer.platform.state.policy.schedule`
   alone, and a full :meth:`~fireflyer.platform.scheduler.daemon.Daemon.tick` over a real SQLite
   store holding that state (watch the running attempts, read, decide, apply in one
   transaction, launch the starts through an executor that starts nothing), each from
   the same state (a fresh copy of the store per cycle). Baseline: HAI's 1 s tick.
2. **Suspend→resume round trip** on the local executor: a real platform (``fireflyer
   platform start``, one node) and a small Python job that polls
   ``receive_suspend_command()`` every 10 ms, saves a state file and calls
   ``go_suspend()``. Timed from ``fireflyer suspend``: the job's acknowledgement, the
   attempt stopped (INTERRUPT), and after ``fireflyer resume`` the resumed attempt's rank
   running. Baseline: a cold submit→running of the same job. Also the preemption path:
   a HIGH task submitted while a NORMAL one holds the only node, until HIGH runs.
3. **Utilisation over a synthetic day** (:mod:`fireflyer.platform.state.simulate`): the
   platform's policy against FIFO without preemption (and FIFO with greedy backfill).
"""

from __future__ import annotations

import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from fireflyer.cliutil import ArgumentParser, doc_summary
from fireflyer.bench.harness import bench_command, document, figure, loadavg
from fireflyer.bench.skeleton import result_paths, run_bench
from fireflyer.errors import JobFailed, UserError
from fireflyer.platform.state import simulate as sim
from fireflyer.platform.state.policy import Node, PolicyConfig, Priority, Task, schedule
from fireflyer.testing.live_platform import MARKS_JOB, LivePlatform

HAI_TICK_S = 1.0
WAIT_S = 60.0
"""The longest any single wait in the round-trip measurement may take."""


@dataclass(frozen=True, kw_only=True)
class PlatformBenchConfig:
    tasks: int = 10_000
    """Queued tasks in the cycle measurement."""
    nodes: int = 1_250
    """Nodes in the cycle measurement."""
    zones: int = 2
    users: int = 200
    cycles: int = 5
    """Cycles timed (each from the same state)."""
    reps: int = 5
    """Repetitions of each round-trip measurement."""
    ticks: tuple[float, ...] = (0.1, 1.0)
    """Daemon ticks the round trip is measured with."""
    skip_roundtrip: bool = False
    sim: sim.SimConfig = field(default_factory=sim.SimConfig)
    """The simulated day's cluster and settings (``--sim-nodes``, ``--sim-hours``, ``--sim-step``)."""
    seed: int = 0
    day_seeds: int = 5
    """The day is also simulated with this many seeds (seed, seed+1, ...), to show how much one day's ratios vary."""
    out_dir: str = "runs/bench-platform"

    def __post_init__(self) -> None:
        for name in ("tasks", "nodes", "zones", "users", "cycles", "reps", "day_seeds"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UserError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.zones > self.nodes:
            raise UserError(f"zones ({self.zones}) cannot exceed nodes ({self.nodes})")
        if not self.ticks or min(self.ticks) <= 0:
            raise UserError(f"ticks must be positive seconds, got {self.ticks}")


QUICK: dict[str, Any] = {"tasks": 1_000, "nodes": 125, "users": 40, "cycles": 2, "reps": 1, "ticks": (0.1,)}


def build_config(argv: list[str]) -> PlatformBenchConfig:
    d = PlatformBenchConfig()
    p = ArgumentParser(prog="fireflyer bench platform", description=doc_summary(__doc__))
    p.add_argument("--out", default=d.out_dir, help=f"where bench-platform.json and .png go (default {d.out_dir})")
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run (1,000 tasks on 125 nodes, "
                                                        "one repetition at tick 0.1)")
    p.add_argument("--skip-roundtrip", action="store_true", help="skip the measurement on a real platform")
    p.add_argument("--tasks", type=int, help=f"queued tasks in the cycle (default {d.tasks})")
    p.add_argument("--nodes", type=int, help=f"nodes in the cycle (default {d.nodes})")
    p.add_argument("--cycles", type=int, help=f"cycles timed (default {d.cycles})")
    p.add_argument("--reps", type=int, help=f"round-trip repetitions (default {d.reps})")
    p.add_argument("--ticks", help="daemon ticks for the round trip, comma-separated seconds (default 0.1,1.0)")
    p.add_argument("--sim-nodes", type=int, help=f"simulated cluster's nodes (default {d.sim.nodes})")
    p.add_argument("--sim-hours", type=float, help=f"simulated hours (default {d.sim.hours:g})")
    p.add_argument("--sim-step", type=float, help=f"simulated seconds per scheduling cycle (default {d.sim.step_s:g})")
    p.add_argument("--seed", type=int, help=f"workload seed (default {d.seed})")
    p.add_argument("--day-seeds", type=int, help=f"seeds the day's ratios are also given for (default {d.day_seeds})")
    a = p.parse_args(argv)
    changes: dict[str, Any] = dict(QUICK) if a.quick else {}
    try:
        ticks = tuple(float(x) for x in a.ticks.split(",")) if a.ticks else None
    except ValueError:
        raise UserError(f"--ticks takes comma-separated seconds, got {a.ticks!r}") from None
    changes.update(_given(tasks=a.tasks, nodes=a.nodes, cycles=a.cycles, reps=a.reps, ticks=ticks, seed=a.seed,
                          day_seeds=a.day_seeds))
    changes.update(out_dir=a.out, skip_roundtrip=a.skip_roundtrip)
    try:
        changes["sim"] = replace(d.sim, **_given(nodes=a.sim_nodes, hours=a.sim_hours, step_s=a.sim_step))
    except UserError as exc:
        raise UserError(f"the simulated day: {exc}") from None
    try:
        return replace(d, **changes)
    except (TypeError, ValueError) as exc:
        raise UserError(str(exc)) from None


def _given(**values: Any) -> dict[str, Any]:
    """The flags given: ``values`` without the Nones."""
    return {k: v for k, v in values.items() if v is not None}


def config_fields(cfg: PlatformBenchConfig) -> dict[str, Any]:
    """The config as the result document records it: flat, the simulator's fields prefixed ``sim_``."""
    out: dict[str, Any] = {}
    for name, value in asdict(cfg).items():
        out.update({f"sim_{k}": v for k, v in value.items()} if name == "sim" else {name: value})
    return out


# ---------------------------------------------------------------------- 1. the scheduling cycle
PRIORITY_MIX = ((Priority.LOW, 20), (Priority.BELOW_NORMAL, 5), (Priority.UNDER_NORMAL, 5), (Priority.NORMAL, 40),
                (Priority.ABOVE_NORMAL, 10), (Priority.HIGH, 12), (Priority.VERY_HIGH, 6),
                (Priority.EXTREME_HIGH, 2))
"""Share (%) of each priority among the cycle's tasks."""
SIZES = (1, 2, 4, 8, 16, 32)


@dataclass
class CycleState:
    nodes: list[Node]
    running: list[Task]
    queued: list[Task]
    quotas: dict[tuple[str, str, Priority], int]

    @property
    def tasks(self) -> list[Task]:
        return sorted(self.running + self.queued, key=lambda t: t.id)


def cycle_state(*, tasks: int, nodes: int, zones: int, users: int, seed: int = 0) -> CycleState:
    """A busy cluster as the policy itself would run it, with ``tasks`` queued (see the module doc)."""
    rng = random.Random(seed)
    cluster = [Node(f"node{i:05d}", f"zone{i * zones // nodes}") for i in range(nodes)]
    prios = [p for p, _ in PRIORITY_MIX]
    weights = [w for _, w in PRIORITY_MIX]
    groups = max(1, users // 20)

    def draw(i: int) -> Task:
        u = rng.randrange(users)
        return Task(i, f"user{u}", rng.choice(SIZES), rng.choices(prios, weights)[0], f"group{u % groups}")

    quotas = {(f"user{u}", f"group{u % groups}", p): 16 for u in range(0, users, 10) for p in prios}
    extra = max(1, tasks // 10)
    pool = [draw(i + 1) for i in range(tasks + extra)]
    first = schedule(cluster, pool, quotas, PolicyConfig())
    started = {s.task_id: s.nodes for s in first.starts}
    running = [replace(t, state="running", assigned=started[t.id], run_seconds=rng.uniform(0, 8 * 3600))
               for t in pool if t.id in started]
    rng.shuffle(running)
    running = sorted(running[: len(running) - len(running) // 10], key=lambda t: t.id)  # a tenth finished
    queued = [t for t in pool if t.id not in started][:tasks]
    return CycleState(cluster, running, queued, quotas)


class _NoopExecutor:
    """Starts nothing: every attempt is alive, launching returns a dummy handle."""

    name = "noop"

    def launch(self, launch: Any, attempt_dir: str) -> str:
        return f"noop:{launch.task_id}"

    def alive(self, handle: str) -> bool:
        return True

    def kill(self, handle: str) -> None:
        pass

    def find(self, task_id: int, attempt_dir: str) -> str | None:
        return None


def _build_store(state: CycleState, root: Path) -> Path:
    """A platform home whose SQLite store holds ``state``; returns the home's root."""
    from fireflyer.platform.layout import Home, write_json
    from fireflyer.platform.state.policy import Decisions, Start
    from fireflyer.platform.state.store import Store

    home = Home(root)
    store = Store(home.db)
    try:
        store.add_nodes(state.nodes)
        for (user, group, prio), n in state.quotas.items():
            store.set_quota(user, group, prio, n)
        now = time.time()
        ids: dict[int, int] = {}
        for t in state.tasks:
            ids[t.id] = store.submit(user=t.user, nodes=t.nodes, command=["true"], priority=t.priority,
                                     group=t.group, now=now - 9 * 3600)
        for t in state.running:
            sid = ids[t.id]
            store.apply(Decisions(starts=[Start(sid, t.assigned)]), now=now - t.run_seconds)
            store.set_handle(sid, f"noop:{sid}")
            write_json(home.attempt(sid).supervisor, {"pid": 0, "host": "bench"}, sort_keys=True)
    finally:
        store.close()
    return root


def measure_cycle(cfg: PlatformBenchConfig, work: Path) -> dict[str, Any]:
    from fireflyer.platform.config import PlatformConfig
    from fireflyer.platform.scheduler.daemon import Daemon
    from fireflyer.platform.layout import Home
    from fireflyer.platform.state.store import Store

    t0 = time.perf_counter()
    state = cycle_state(tasks=cfg.tasks, nodes=cfg.nodes, zones=cfg.zones, users=cfg.users, seed=cfg.seed)
    tasks = state.tasks
    pure, pure_dec = [], None
    for _ in range(cfg.cycles):
        t = time.perf_counter()
        pure_dec = schedule(state.nodes, tasks, state.quotas, PolicyConfig())
        pure.append(time.perf_counter() - t)
    template = _build_store(state, work / "template")
    setup_s = time.perf_counter() - t0
    pcfg = PlatformConfig(nodes=cfg.nodes, zones=cfg.zones, policy=PolicyConfig(default_quota=None))  # the pure cycle's policy
    ticks, decide, steady, started, suspended = [], [], [], [], []
    for k in range(cfg.cycles):
        root = work / f"cycle{k}"
        shutil.copytree(template, root)
        store = Store(Home(root).db)
        try:
            daemon = Daemon(Home(root), pcfg, executor=_NoopExecutor(), store=store)
            t = time.perf_counter()
            cycle = daemon.tick()
            ticks.append(time.perf_counter() - t)
            decide.append(cycle.decide_s)
            started.append(len(cycle.started))
            suspended.append(len(cycle.suspending))
            t = time.perf_counter()
            daemon.tick()
            steady.append(time.perf_counter() - t)
        finally:
            store.close()
        shutil.rmtree(root, ignore_errors=True)
    assert pure_dec is not None
    med = statistics.median(ticks)
    return {
        "tasks_queued": len(state.queued), "tasks_running": len(state.running), "nodes": cfg.nodes,
        "zones": cfg.zones, "nodes_busy": sum(t.nodes for t in state.running), "users": cfg.users,
        "quota_rows": len(state.quotas), "cycles": cfg.cycles, "setup_s": setup_s,
        "decisions": {"starts": len(pure_dec.starts), "suspends": len(pure_dec.suspends),
                      "waiting": len(pure_dec.waiting)},
        "policy_s": {"median": statistics.median(pure), "max": max(pure), "all": pure},
        "daemon_tick_s": {"median": med, "max": max(ticks), "all": ticks},
        "daemon_read_decide_s": {"median": statistics.median(decide), "max": max(decide), "all": decide},
        "daemon_steady_tick_s": {"median": statistics.median(steady), "max": max(steady), "all": steady},
        "daemon_started": started, "daemon_suspended": suspended,
        "baseline_s": HAI_TICK_S,
        "ratio_policy": statistics.median(pure) / HAI_TICK_S,
        "ratio_daemon": med / HAI_TICK_S,
        "ratio_daemon_max": max(ticks) / HAI_TICK_S,
    }


# ---------------------------------------------------------------------- 2. the round trip on a real platform
class _BenchPlatform(LivePlatform):
    """A live platform of one node whose tasks are :data:`~fireflyer.testing.live_platform.MARKS_JOB`:
    each marks when it runs and when it saw a suspend, in ``marks``; waits poll every 5 ms."""

    def __init__(self, home: Path, marks: Path, tick: float) -> None:
        self.marks = marks
        super().__init__(home, "--nodes", "1", tick=tick, timeout=WAIT_S, poll_s=0.005)

    def submit_marks(self, mode: str, priority: str = "NORMAL") -> int:
        return self.submit(sys.executable, MARKS_JOB, str(self.marks), mode, priority=priority, name=mode, user=None)

    def mark(self, name: str, chain: int, attempt: int) -> float | None:
        try:
            return float((self.marks / f"{name}.{chain}.{attempt}").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def status_time(self, task_id: int) -> float:
        """When the attempt's supervisor wrote how it ended (its ranks had stopped)."""
        from fireflyer.platform.layout import Home

        return Home(self.home).attempt(task_id).status.stat().st_mtime

    def wait_mark(self, name: str, chain: int, attempt: int) -> float:
        return self.wait(f"{name} of task {chain} attempt {attempt}", lambda: self.mark(name, chain, attempt))


def _roundtrip_once(p: _BenchPlatform) -> dict[str, float]:
    from fireflyer.platform.state.store import HELD, StopCode

    t_submit = time.time()
    chain = p.submit_marks("loop")
    ready0 = p.wait_mark("ready", chain, 0)
    time.sleep(0.3)
    t0 = time.time()
    p.cli("suspend", str(chain))
    t_cli = time.time()
    p.wait_stored(chain, HELD)
    t_res = time.time()
    p.cli("resume", str(chain))
    ready1 = p.wait_mark("ready", chain, 1)
    first, second = p.store.chain(chain)[:2]
    if not first.stop_code & StopCode.INTERRUPT:
        raise JobFailed(f"task {chain}'s first attempt ended {first.stop_code}, not INTERRUPT: {first.detail}")
    ack = p.wait_mark("ack", chain, 0)
    ended = p.status_time(first.id)
    p.finish(chain)
    return {"cold_start_s": ready0 - t_submit, "suspend_cli_s": t_cli - t0, "acknowledged_s": ack - t0,
            "supervisor_stopped_s": ended - t0, "stopped_s": first.finished_at - t0, "resume_issued_s": t_res - t0,
            "rescheduled_after_resume_s": second.started_at - t_res, "running_after_resume_s": ready1 - t_res,
            "total_s": ready1 - t0}


def _preempt_once(p: _BenchPlatform) -> dict[str, float]:
    from fireflyer.platform.state.store import FINISHED, StopCode

    low = p.submit_marks("loop", "NORMAL")
    p.wait_mark("ready", low, 0)
    time.sleep(0.3)
    t0 = time.time()
    high = p.submit_marks("once", "HIGH")
    ready = p.wait_mark("ready", high, 0)
    ack = p.wait_mark("ack", low, 0)
    first = p.store.chain(low)[0]
    if not first.stop_code & StopCode.INTERRUPT:
        raise JobFailed(f"task {low} ended {first.stop_code}, not INTERRUPT: {first.detail}")
    started = p.store.task(high).started_at
    p.wait_stored(high, FINISHED)
    p.wait_mark("ready", low, 1)  # the preempted chain comes back by itself
    p.finish(low)
    return {"low_acknowledged_s": ack - t0, "low_stopped_s": first.finished_at - t0,
            "high_scheduled_s": started - t0, "high_running_s": ready - t0}


def _stats(rows: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {k: {"median": statistics.median(r[k] for r in rows), "min": min(r[k] for r in rows),
                "max": max(r[k] for r in rows)} for k in rows[0]}


def measure_roundtrip(cfg: PlatformBenchConfig, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tick in cfg.ticks:
        marks = work / f"marks-{tick:g}"
        marks.mkdir(parents=True)
        p = _BenchPlatform(work / f"home-{tick:g}", marks, tick)
        try:
            trips = [_roundtrip_once(p) for _ in range(cfg.reps)]
            preempts = [_preempt_once(p) for _ in range(cfg.reps)]
        finally:
            p.close()
        rt, pre = _stats(trips), _stats(preempts)
        out[f"{tick:g}"] = {"tick_s": tick, "reps": cfg.reps, "roundtrip": rt, "preemption": pre,
                            "raw": {"roundtrip": trips, "preemption": preempts},
                            "ratio_total_to_cold_start": rt["total_s"]["median"] / rt["cold_start_s"]["median"]}
    return out


# ---------------------------------------------------------------------- 3. the simulated day
def measure_day(cfg: PlatformBenchConfig) -> dict[str, Any]:
    scfg = cfg.sim
    jobs = sim.make_workload(seed=cfg.seed, max_nodes=scfg.nodes)
    t0 = time.perf_counter()
    results = sim.compare(jobs, scfg)
    elapsed = time.perf_counter() - t0
    summ = {name: r.summary() for name, r in results.items()}
    hai, fifo = summ["hai"], summ["fifo"]

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    hi = [p.name for p in (Priority.EXTREME_HIGH, Priority.VERY_HIGH, Priority.HIGH) if p.name in hai["wait_s"]]
    seeds = []
    for seed in range(cfg.seed, cfg.seed + cfg.day_seeds):
        day = sim.make_workload(seed=seed, max_nodes=scfg.nodes)
        other = {name: r.summary() for name, r in sim.compare(day, scfg).items()}
        h, f = other["hai"], other["fifo"]
        seeds.append({"seed": seed, "offered_node_hours": sum(j.nodes * j.work_s for j in day) / 3600,
                      "utilisation": {n: o["utilisation"] for n, o in other.items()},
                      "useful_utilisation": {n: o["useful_utilisation"] for n, o in other.items()},
                      "ratio_utilisation_hai_to_fifo": ratio(h["utilisation"], f["utilisation"]),
                      "ratio_useful_utilisation_hai_to_fifo": ratio(h["useful_utilisation"], f["useful_utilisation"]),
                      "ratio_high_wait_mean_hai_to_fifo": ratio(h["wait_s"]["HIGH"]["mean_s"],
                                                                f["wait_s"]["HIGH"]["mean_s"])
                      if "HIGH" in h["wait_s"] else None})
    return {
        "config": asdict(scfg), "seed": cfg.seed, "simulate_s": elapsed,
        "workload": [{"name": c.name, "priority": c.priority.name, "count": c.count, "sizes": list(c.sizes),
                      "hours": list(c.hours), "arrive": list(c.arrive), "bursts": c.bursts, "at_start": c.at_start}
                     for c in sim.DEFAULT_CLASSES],
        "jobs": len(jobs), "offered_node_hours": sum(j.nodes * j.work_s for j in jobs) / 3600,
        "capacity_node_hours": scfg.nodes * scfg.hours,
        "policies": summ,
        "timeline": {name: {"t_h": [s.t / 3600 for s in r.steps], "busy": [s.busy for s in r.steps]}
                     for name, r in results.items()},
        "ratio_utilisation_hai_to_fifo": ratio(hai["utilisation"], fifo["utilisation"]),
        "ratio_useful_utilisation_hai_to_fifo": ratio(hai["useful_utilisation"], fifo["useful_utilisation"]),
        "ratio_wait_hai_to_fifo": {p: {"mean": ratio(hai["wait_s"][p]["mean_s"], fifo["wait_s"][p]["mean_s"]),
                                       "p95": ratio(hai["wait_s"][p]["p95_s"], fifo["wait_s"][p]["p95_s"])}
                                   for p in hi},
        "seeds": seeds,
    }


# ---------------------------------------------------------------------- output
def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 10 else f"{s:.1f} s"


def _print(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    c = r["cycle"]
    t = Table(title=f"Scheduling cycle: {c['tasks_queued']:,} queued + {c['tasks_running']} running tasks, "
                    f"{c['nodes']:,} nodes in {c['zones']} zones")
    for col in ("measure", "median", "max", "baseline", "ratio (median)"):
        t.add_column(col, justify="right")
    for label, key in (("policy schedule() alone", "policy_s"), ("daemon tick (watch, decide, apply, launch)",
                                                                  "daemon_tick_s"),
                       ("  of which read + decide", "daemon_read_decide_s"),
                       ("daemon tick, next cycle (steady)", "daemon_steady_tick_s")):
        v = c[key]
        t.add_row(label, _ms(v["median"]), _ms(v["max"]), "HAI tick 1 s", f"{v['median'] / HAI_TICK_S:.3f}")
    console = Console(width=max(120, Console().width))
    console.print(t)
    console.print(f"  first cycle decided {c['decisions']['starts']} starts and {c['decisions']['suspends']} "
                  f"suspends; target < 1 s")
    for tick, rt in (r.get("roundtrip") or {}).items():
        t = Table(title=f"Suspend→resume on the local executor, tick {tick} s ({rt['reps']} reps, medians)")
        for col in ("measure", "median", "min", "max", "baseline", "ratio"):
            t.add_column(col, justify="right")
        cold = rt["roundtrip"]["cold_start_s"]["median"]
        # each part's whole path (its against_cold row) is compared with a cold start
        for part, against_cold, rows in (
                ("roundtrip", "total_s", (("suspend → job acknowledged", "acknowledged_s"),
                                          ("suspend → ranks stopped (supervisor's status)", "supervisor_stopped_s"),
                                          ("suspend → stop recorded (INTERRUPT, held)", "stopped_s"),
                                          ("resume → attempt scheduled", "rescheduled_after_resume_s"),
                                          ("resume → ranks running", "running_after_resume_s"),
                                          ("suspend → resumed ranks running (total)", "total_s"),
                                          ("cold submit → ranks running", "cold_start_s"))),
                ("preemption", "high_running_s", (("HIGH submit → NORMAL acknowledged", "low_acknowledged_s"),
                                                  ("HIGH submit → NORMAL stopped", "low_stopped_s"),
                                                  ("HIGH submit → HIGH scheduled", "high_scheduled_s"),
                                                  ("HIGH submit → HIGH ranks running", "high_running_s")))):
            x = rt[part]
            for label, key in rows:
                ratio = f"{x[key]['median'] / cold:.2f}" if key == against_cold else ""
                t.add_row(label, _ms(x[key]["median"]), _ms(x[key]["min"]), _ms(x[key]["max"]),
                          f"cold start {_ms(cold)}" if key == against_cold else "", ratio)
        console.print(t)
    d = r["day"]
    t = Table(title=f"A synthetic day on {d['config']['nodes']} nodes ({d['jobs']} jobs, "
                    f"{d['offered_node_hours']:.0f} node-h offered / {d['capacity_node_hours']:.0f} capacity)")
    names = list(d["policies"])
    t.add_column("measure", justify="right")
    for n in names:
        t.add_column(n, justify="right")
    t.add_column("hai / fifo", justify="right")
    pol = d["policies"]
    t.add_row("node utilisation", *[f"{pol[n]['utilisation'] * 100:.1f}%" for n in names],
              f"{d['ratio_utilisation_hai_to_fifo']:.3f}")
    t.add_row("useful utilisation", *[f"{pol[n]['useful_utilisation'] * 100:.1f}%" for n in names],
              f"{d['ratio_useful_utilisation_hai_to_fifo']:.3f}")
    t.add_row("preemptions", *[str(pol[n]["preemptions"]) for n in names], "")
    t.add_row("finished jobs", *[f"{pol[n]['finished']}/{pol[n]['jobs']}" for n in names], "")
    for prio in pol["hai"]["wait_s"]:
        for stat in ("mean_s", "p95_s"):
            vals = [pol[n]["wait_s"][prio][stat] for n in names]
            f = pol["fifo"]["wait_s"][prio][stat]
            t.add_row(f"{prio} wait {stat[:-2]}", *[f"{v / 60:.1f} min" for v in vals],
                      f"{pol['hai']['wait_s'][prio][stat] / f:.3f}" if f else "-")
    console.print(t)
    if d["seeds"]:
        def spread(key: str) -> str:
            vals = [x[key] for x in d["seeds"] if x[key] is not None]
            return f"median {statistics.median(vals):.3f} (min {min(vals):.3f}, max {max(vals):.3f})"

        console.print(f"  over seeds {d['seeds'][0]['seed']}..{d['seeds'][-1]['seed']}: hai/fifo utilisation "
                      f"{spread('ratio_utilisation_hai_to_fifo')}; useful {spread('ratio_useful_utilisation_hai_to_fifo')}"
                      f"; HIGH mean wait {spread('ratio_high_wait_mean_hai_to_fifo')}")


def _write_png(path: str, r: dict[str, Any]) -> None:
    with figure(path, 2, 2, figsize=(13, 9), dpi=100) as (fig, axes):
        a, b, c, d = axes.flat
        cy = r["cycle"]
        labels = ["schedule()", "daemon tick", "read+decide", "steady tick"]
        keys = ["policy_s", "daemon_tick_s", "daemon_read_decide_s", "daemon_steady_tick_s"]
        a.bar(labels, [cy[k]["median"] for k in keys], color="#1f77b4", label="median")
        a.scatter(labels, [cy[k]["max"] for k in keys], color="#d62728", zorder=3, label="max")
        a.axhline(HAI_TICK_S, color="#999999", linestyle="--", label="HAI tick (1 s)")
        a.set_ylabel("seconds")
        a.set_title(f"Cycle: {cy['tasks_queued']:,} queued, {cy['nodes']:,} nodes")
        a.legend()
        rts = r.get("roundtrip") or {}
        if rts:
            names, stop, back, cold, high = [], [], [], [], []
            for tick, rt in rts.items():
                x = rt["roundtrip"]
                names.append(f"tick {tick} s")
                stop.append(x["stopped_s"]["median"])
                back.append(x["total_s"]["median"] - x["stopped_s"]["median"])
                cold.append(x["cold_start_s"]["median"])
                high.append(rt["preemption"]["high_running_s"]["median"])
            xs = list(range(len(names)))
            w = 0.27
            b.bar([x - w for x in xs], stop, w, color="#ff7f0e", label="suspend → stopped")
            b.bar([x - w for x in xs], back, w, bottom=stop, color="#1f77b4", label="stopped → resumed running")
            b.bar(xs, cold, w, color="#999999", label="cold submit → running")
            b.bar([x + w for x in xs], high, w, color="#2ca02c", label="HIGH submit → running (preempts)")
            b.set_xticks(xs, names)
            b.set_ylabel("seconds (median)")
            b.set_title("Suspend→resume on the local executor")
            b.legend(fontsize=8)
        else:
            b.text(0.5, 0.5, "round trip skipped", ha="center", va="center")
            b.set_axis_off()
        day = r["day"]
        for name, tl in day["timeline"].items():
            c.plot(tl["t_h"], [x / day["config"]["nodes"] * 100 for x in tl["busy"]], label=name, linewidth=1)
        c.set_xlabel("hour")
        c.set_ylabel("nodes allocated (%)")
        c.set_ylim(0, 105)
        c.set_title("A synthetic day: allocation over time")
        c.legend()
        pol = day["policies"]
        prios = list(pol["hai"]["wait_s"])
        names = list(pol)
        w = 0.8 / len(names)
        for i, n in enumerate(names):
            xs = [j + (i - (len(names) - 1) / 2) * w for j in range(len(prios))]
            d.bar(xs, [pol[n]["wait_s"][p]["mean_s"] / 60 for p in prios], w, label=f"{n} mean")
            d.scatter(xs, [pol[n]["wait_s"][p]["p95_s"] / 60 for p in prios], color="black", s=10, zorder=3)
        d.set_xticks(range(len(prios)), prios, fontsize=8)
        d.set_ylabel("queue wait (minutes; dots: p95)")
        d.set_title("Wait per priority: " + ", ".join(f"{n} {pol[n]['utilisation'] * 100:.0f}% used" for n in names),
                    fontsize=9)
        d.legend(fontsize=8)


def run(cfg: PlatformBenchConfig) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="fireflyer-bench-platform-"))
    try:
        result: dict[str, Any] = {"cycle": measure_cycle(cfg, work)}
        result["roundtrip"] = None if cfg.skip_roundtrip else measure_roundtrip(cfg, work)
        result["day"] = measure_day(cfg)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def measure(cfg: PlatformBenchConfig) -> tuple[list[float] | None, dict[str, Any]]:
    """The load average before, and :func:`run`'s result; a failed measurement is a one-line error."""
    load_before = loadavg()
    try:
        return load_before, run(cfg)
    except RuntimeError as exc:
        raise UserError(f"platform benchmark failed: {exc}") from None


def main(argv: list[str]) -> int:
    return run_bench(
        argv, part="platform", configure=build_config, measure=measure, report=lambda cfg, m: _print(m[1]),
        fields=lambda cfg, m: {
            "loadavg_before": m[0], "loadavg_after": loadavg(),
            "baselines": {"cycle": "HAI Platform's 1 s scheduling tick",
                          "roundtrip": "a cold submit → running of the same job on the same platform",
                          "day": "FIFO without preemption (strict submission order, head-of-line blocking); "
                                 "also FIFO with greedy backfill"},
            "config": config_fields(cfg), **m[1]},
        plot=lambda path, cfg, m: _write_png(path, m[1]),
        paths=lambda cfg: result_paths(cfg.out_dir, "bench-platform"),
        head=lambda argv: document(bench_command("platform", argv), torch=False))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
