"""The three-tier shard cache model of the seed exercise, and the prefetch-distance study on it.

The model (kept exactly as the exercise states it):

* a seeded trace over ``shards`` shards: with probability ``local_prob`` the next shard
  is 1..``max_step`` ahead of the current one (wrapping), otherwise a uniform random jump;
* tiers HBM (``hbm_slots``) above DRAM (``dram_slots``) above SSD (everything), LRU in
  each; a demand is a hit only if its shard is in HBM;
* a shard not in HBM is promoted one tier at a time: from DRAM it costs ``dram_cost``
  (and moves to DRAM's most recent end), from SSD ``ssd_cost``; either way it then sits
  at the most recent end of both DRAM and HBM, each evicting its least recent shard;
* every speculative load (a prefetch of a shard other than the one demanded) adds
  ``spec_overhead``; a prefetched shard already in HBM is only touched (no cost).

The study: a demand-only baseline; the locality policy (the next d shards) for each d;
the best hit count whose cost is inside ``budget`` (not simply the largest d), with the
hit gain per 1000 extra cost units over the baseline; and an oracle that prefetches the
exact next d demands, with the gap to it.

The stretch goals run on the same simulator with optional parts switched on: a penalty
for speculative loads not demanded within the next ``window`` accesses, a confidence-
gated prefetch queue, a scan-resistant admission filter, and per-tier latencies with a
single fetch channel, where the p99 demand latency is the objective instead of cost.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from fireflyer.storage.policy import (LRU, ConfidencePrefetch, FrequencyAdmission, LocalityPrefetch, OraclePrefetch,
                                      Prefetcher)
from fireflyer.errors import UserError


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """The model's parameters; the defaults are the exercise's."""

    shards: int = 128
    trace_len: int = 4000
    seed: int = 5
    local_prob: float = 0.8
    """Chance that the next access walks forward 1..max_step shards instead of jumping at random."""
    max_step: int = 3
    hbm_slots: int = 16
    dram_slots: int = 64
    ssd_cost: int = 40
    dram_cost: int = 4
    spec_overhead: int = 2
    budget: int = 240000
    distances: tuple[int, ...] = (1, 2, 3, 4)
    # -- stretch goals (not part of the exercise's base model)
    penalty: int = 4
    """Cost charged for each speculative load not demanded within the next ``window`` accesses."""
    window: int = 4
    thresholds: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
    """Confidence thresholds swept for the prefetch queue."""
    admission_window: int = 256
    lat_hbm: float = 1.0
    lat_dram: float = 4.0
    lat_ssd: float = 40.0
    interval: float = 100.0
    """Time between demands (the compute of one step); fetches share one channel."""

    def __post_init__(self) -> None:
        positive = ("shards", "trace_len", "max_step", "hbm_slots", "dram_slots", "window", "admission_window")
        for name in positive:
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("ssd_cost", "dram_cost", "spec_overhead", "budget", "penalty"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must not be negative, got {getattr(self, name)}")
        if not 0.0 <= self.local_prob <= 1.0:
            raise UserError(f"local_prob must be in [0, 1], got {self.local_prob}")
        if not self.distances or any(d < 1 for d in self.distances) or len(set(self.distances)) != len(self.distances):
            raise UserError(f"distances must be distinct integers >= 1, got {self.distances}")
        if any(not 0.0 <= t <= 1.0 for t in self.thresholds) or not self.thresholds:
            raise UserError(f"thresholds must be in [0, 1], got {self.thresholds}")
        for name in ("lat_hbm", "lat_dram", "lat_ssd", "interval"):
            if not getattr(self, name) >= 0:
                raise UserError(f"{name} must not be negative, got {getattr(self, name)}")


def make_trace(cfg: SimConfig) -> list[int]:
    """The exercise's trace: local forward walks with random jumps, from ``cfg.seed``."""
    rng = random.Random(cfg.seed)
    trace, cur = [], 0
    for _ in range(cfg.trace_len):
        if rng.random() < cfg.local_prob:
            cur = (cur + rng.randint(1, cfg.max_step)) % cfg.shards
        else:
            cur = rng.randrange(cfg.shards)
        trace.append(cur)
    return trace


@dataclass
class SimResult:
    hits: int
    cost: int
    accesses: int
    speculative_loads: int = 0
    wasted: int = 0
    """Speculative loads not demanded within the next ``window`` accesses."""
    skipped: int = 0
    """Speculative loads the admission filter declined."""
    latencies: list[float] = field(default_factory=list, repr=False)

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return 0.0
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, max(0, int(round(q / 100.0 * len(xs) + 0.5)) - 1))]

    def summary(self) -> dict[str, Any]:
        n = max(1, len(self.latencies))
        return {"hits": self.hits, "cost": self.cost, "hit_rate": self.hits / max(1, self.accesses),
                "speculative_loads": self.speculative_loads, "wasted": self.wasted, "skipped": self.skipped,
                "mean_latency": sum(self.latencies) / n, "p99_latency": self.percentile(99)}


def simulate(trace: Sequence[int], cfg: SimConfig, prefetcher: Prefetcher | None = None, *,
             admission: FrequencyAdmission | None = None, penalty: int = 0) -> SimResult:
    """Run ``trace`` through the tiers. With no admission filter and ``penalty=0`` this is
    exactly the exercise's model; latencies are always recorded (they do not change it)."""
    hbm, dram = LRU(cfg.hbm_slots), LRU(cfg.dram_slots)
    res = SimResult(hits=0, cost=0, accesses=len(trace))
    issued: deque[list] = deque()  # [step, shard, used] of speculative loads, oldest first
    open_by_shard: dict[int, list[list]] = {}
    ready: dict[int, float] = {}  # when a shard's last load into HBM completes
    busy_until = 0.0
    for i, shard in enumerate(trace):
        now = i * cfg.interval
        for entry in open_by_shard.pop(shard, []):
            entry[2] = True
        while issued and issued[0][0] < i - cfg.window:
            entry = issued.popleft()
            if not entry[2]:
                res.wasted += 1
                res.cost += penalty
                open_by_shard[entry[1]] = [e for e in open_by_shard.get(entry[1], []) if e is not entry]
                if not open_by_shard[entry[1]]:
                    del open_by_shard[entry[1]]
        if prefetcher is not None:
            prefetcher.observe(i, shard)
        if admission is not None:
            admission.record(shard)
        loads = [shard]
        if prefetcher is not None:
            loads += [s for s in prefetcher.candidates(i, shard) if s != shard]
        for s in loads:
            speculative = s != shard
            if s in hbm:
                hbm.touch(s)
                if not speculative:
                    res.hits += 1
                    res.latencies.append(max(ready.get(s, 0.0) - now, 0.0) + cfg.lat_hbm)
                continue
            if admission is not None and speculative and admission.filter_prefetches:
                victim = hbm.victim()
                if victim is not None and not admission.admit(s, victim):
                    res.skipped += 1
                    continue
            in_dram = s in dram
            if in_dram:
                res.cost += cfg.dram_cost
                dram.remove(s)
            else:
                res.cost += cfg.ssd_cost
            start = max(now, busy_until)
            busy_until = start + (cfg.lat_dram if in_dram else cfg.lat_ssd)
            if speculative:
                res.cost += cfg.spec_overhead
                res.speculative_loads += 1
                entry = [i, s, False]
                issued.append(entry)
                open_by_shard.setdefault(s, []).append(entry)
            else:
                res.latencies.append(busy_until - now + cfg.lat_hbm)
            check = admission is not None and (not speculative or admission.filter_prefetches)
            if in_dram or not check or _admits(dram, admission, s):
                dram.insert(s)
            if not check or speculative or _admits(hbm, admission, s):
                hbm.insert(s)
                ready[s] = busy_until
    for entry in issued:  # loads still open when the trace ends had their whole window or the rest of the trace
        if not entry[2]:
            res.wasted += 1
            res.cost += penalty
    return res


def _admits(tier: LRU, admission: FrequencyAdmission, key: int) -> bool:
    victim = tier.victim()
    return victim is None or admission.admit(key, victim)


# -- the study -----------------------------------------------------------------------


def _point(label: str, family: str, r: SimResult, **extra: Any) -> dict[str, Any]:
    return {"label": label, "family": family, **extra, **r.summary()}


def _best_within(points: list[dict[str, Any]], cap: float) -> dict[str, Any] | None:
    """Most hits at cost <= cap (ties: the cheaper one)."""
    inside = [p for p in points if p["cost"] <= cap]
    return max(inside, key=lambda p: (p["hits"], -p["cost"])) if inside else None


def per_1000(d_hits: float, d_cost: float) -> float | None:
    return None if d_cost <= 0 else d_hits / (d_cost / 1000.0)


def study(cfg: SimConfig) -> dict[str, Any]:
    """Everything ``fireflyer cache simulate`` reports, as plain data."""
    trace = make_trace(cfg)
    base = simulate(trace, cfg)
    baseline = _point("demand-only", "baseline", base, distance=0)
    locality = []
    prev = baseline
    for d in sorted(cfg.distances):
        r = simulate(trace, cfg, LocalityPrefetch(distance=d, num_shards=cfg.shards))
        p = _point(f"locality d={d}", "locality", r, distance=d)
        p["within_budget"] = r.cost <= cfg.budget
        p["gain_per_1000"] = per_1000(r.hits - base.hits, r.cost - base.cost)
        p["marginal_per_1000"] = per_1000(p["hits"] - prev["hits"], p["cost"] - prev["cost"])
        locality.append(p)
        prev = p
    chosen = _best_within([baseline] + locality, cfg.budget)
    chosen_d = chosen["distance"] if chosen else None
    # "the curve turns": each distance past the chosen one buys its extra hits dearer than the chosen did.
    turns = None
    if chosen and chosen_d and chosen["hits"] > base.hits:
        cost_per_hit = (chosen["cost"] - base.cost) / (chosen["hits"] - base.hits)
        beyond = [p for p in locality if p["distance"] > chosen_d]
        if beyond:
            turns = True
            last = chosen
            for p in beyond:
                extra = p["hits"] - last["hits"]
                if extra > 0 and (p["cost"] - last["cost"]) / extra <= cost_per_hit:
                    turns = False
                last = p
    oracle = []
    for d in sorted(cfg.distances):
        r = simulate(trace, cfg, OraclePrefetch(trace=trace, distance=d))
        oracle.append(_point(f"oracle d={d}", "oracle", r, distance=d))
    oracle_at = next((o for o in oracle if o["distance"] == chosen_d), None)
    gap = None
    if chosen and oracle_at:
        gap = {"distance": chosen_d, "oracle_hits": oracle_at["hits"], "oracle_cost": oracle_at["cost"],
               "hits": oracle_at["hits"] - chosen["hits"], "cost": oracle_at["cost"] - chosen["cost"]}
    return {"config": _jsonable(asdict(cfg)), "accesses": len(trace), "baseline": baseline, "locality": locality,
            "chosen": chosen, "gain_per_1000": chosen.get("gain_per_1000") if chosen else None, "curve_turns": turns,
            "oracle": oracle, "oracle_gap": gap, "stretch": stretch(trace, cfg, chosen)}


def stretch(trace: list[int], cfg: SimConfig, chosen: dict[str, Any] | None) -> dict[str, Any]:
    """The three stretch policies, each compared with locality prefetch at the same cost cap."""
    dmax = max(cfg.distances)
    # 1. A confidence-gated prefetch queue, everyone charged the penalty for missed speculation.
    penalised_loc = [_point(f"locality d={d}", "locality+penalty",
                            simulate(trace, cfg, LocalityPrefetch(distance=d, num_shards=cfg.shards),
                                     penalty=cfg.penalty), distance=d) for d in [0, *sorted(cfg.distances)]]
    queue = [_point(f"queue t={t:g}", "queue", simulate(
        trace, cfg, ConfidencePrefetch(max_distance=dmax, num_shards=cfg.shards, threshold=t, window=cfg.window),
        penalty=cfg.penalty), threshold=t) for t in cfg.thresholds]
    cap_q = _best_within(penalised_loc, cfg.budget)
    q_cmp = {"cost_cap": cap_q["cost"] if cap_q else None, "locality": cap_q,
             "queue": _best_within(queue, cap_q["cost"]) if cap_q else None}
    # 2. Scan-resistant admission instead of plain LRU, same prefetch distances.
    admitted = [_point(f"admission d={d}", "admission", simulate(
        trace, cfg, LocalityPrefetch(distance=d, num_shards=cfg.shards) if d else None,
        admission=FrequencyAdmission(window=cfg.admission_window)), distance=d) for d in [0, *sorted(cfg.distances)]]
    cap = chosen["cost"] if chosen else cfg.budget
    a_cmp = {"cost_cap": cap, "lru": chosen, "admission": _best_within(admitted, cap)}
    # 3. p99 demand latency as the objective: every variant above, judged by its tail.
    plain = [_point("demand-only", "baseline", simulate(trace, cfg), distance=0)]
    plain += [_point(f"locality d={d}", "locality", simulate(trace, cfg, LocalityPrefetch(
        distance=d, num_shards=cfg.shards)), distance=d) for d in sorted(cfg.distances)]
    candidates = [p for p in plain + admitted + queue if p["cost"] <= cfg.budget]
    by_p99 = min(candidates, key=lambda p: (p["p99_latency"], p["mean_latency"], p["cost"])) if candidates else None
    return {"penalty": cfg.penalty, "window": cfg.window,
            "queue": {"points": queue, "locality_with_penalty": penalised_loc, "same_cost": q_cmp},
            "admission": {"points": admitted, "same_cost": a_cmp},
            "latency": {"lat_hbm": cfg.lat_hbm, "lat_dram": cfg.lat_dram, "lat_ssd": cfg.lat_ssd,
                        "interval": cfg.interval, "points": plain + admitted + queue, "best_p99": by_p99,
                        "chosen_by_cost": chosen}}


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
