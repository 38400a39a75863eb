"""``fireflyer cache simulate``: the exercise's three-tier cache model and prefetch study."""

from __future__ import annotations

import json
import sys
from typing import Any

from fireflyer.cliutil import ArgumentParser
from fireflyer.errors import UserError
from fireflyer.storage.cachesim import SimConfig, study


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"cannot read {text!r} as comma-separated numbers") from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"cannot read {text!r} as comma-separated integers") from None


def build_config(argv: list[str]) -> tuple[SimConfig, Any]:
    d = SimConfig()
    p = ArgumentParser(prog="fireflyer cache simulate",
                       description="Three-tier (HBM, DRAM, SSD) shard cache: demand-only LRU, locality prefetch swept "
                                   "over distances, the best hit count inside a budget, an oracle, and the stretch "
                                   "policies (confidence queue, admission filter, p99 latency).")
    add = p.add_argument
    add("--shards", type=int, default=d.shards, help=f"shards in the trace's space (default {d.shards})")
    add("--trace-len", type=int, default=d.trace_len, help=f"accesses (default {d.trace_len})")
    add("--seed", type=int, default=d.seed, help=f"trace seed (default {d.seed})")
    add("--local-prob", type=float, default=d.local_prob, help=f"chance of a local walk (default {d.local_prob})")
    add("--max-step", type=int, default=d.max_step, help=f"a local walk moves 1..this (default {d.max_step})")
    add("--hbm-slots", type=int, default=d.hbm_slots, help=f"HBM tier slots (default {d.hbm_slots})")
    add("--dram-slots", type=int, default=d.dram_slots, help=f"DRAM tier slots (default {d.dram_slots})")
    add("--ssd-cost", type=int, default=d.ssd_cost, help=f"cost of an SSD fetch (default {d.ssd_cost})")
    add("--dram-cost", type=int, default=d.dram_cost, help=f"cost of a DRAM fetch (default {d.dram_cost})")
    add("--spec-overhead", type=int, default=d.spec_overhead,
        help=f"extra cost of each speculative load (default {d.spec_overhead})")
    add("--budget", type=int, default=d.budget, help=f"cost budget (default {d.budget})")
    add("--distances", default=",".join(map(str, d.distances)), help="prefetch distances swept (default 1,2,3,4)")
    add("--penalty", type=int, default=d.penalty,
        help=f"stretch: cost of a speculative load missed by the next --window accesses (default {d.penalty})")
    add("--window", type=int, default=d.window,
        help=f"stretch: accesses a prefetch has to be used in (default {d.window})")
    add("--thresholds", default=",".join(f"{t:g}" for t in d.thresholds),
        help="stretch: confidence thresholds swept for the prefetch queue")
    add("--admission-window", type=int, default=d.admission_window,
        help=f"stretch: demands between halvings of the admission filter's counts (default {d.admission_window})")
    add("--lat-hbm", type=float, default=d.lat_hbm, help=f"stretch: HBM hit latency (default {d.lat_hbm:g})")
    add("--lat-dram", type=float, default=d.lat_dram, help=f"stretch: DRAM fetch latency (default {d.lat_dram:g})")
    add("--lat-ssd", type=float, default=d.lat_ssd, help=f"stretch: SSD fetch latency (default {d.lat_ssd:g})")
    add("--interval", type=float, default=d.interval, help=f"stretch: time between demands (default {d.interval:g})")
    add("--json", action="store_true", help="print the whole result as JSON instead of the table")
    add("--plot", metavar="PNG", default=None, help="write hits against cost to this PNG")
    a = p.parse_args(argv)
    try:
        cfg = SimConfig(shards=a.shards, trace_len=a.trace_len, seed=a.seed, local_prob=a.local_prob,
                        max_step=a.max_step, hbm_slots=a.hbm_slots, dram_slots=a.dram_slots, ssd_cost=a.ssd_cost,
                        dram_cost=a.dram_cost, spec_overhead=a.spec_overhead, budget=a.budget,
                        distances=_ints(a.distances), penalty=a.penalty, window=a.window,
                        thresholds=_floats(a.thresholds), admission_window=a.admission_window, lat_hbm=a.lat_hbm,
                        lat_dram=a.lat_dram, lat_ssd=a.lat_ssd, interval=a.interval)
    except ValueError as exc:
        raise UserError(f"{exc} (see fireflyer cache simulate --help)") from None
    if a.trace_len > 2_000_000:
        raise UserError("--trace-len above 2,000,000 would take minutes; use a shorter trace")
    return cfg, a


def _fmt(x: Any, nd: int = 1) -> str:
    if x is None:
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def render(r: dict[str, Any]) -> str:
    c = r["config"]
    out = [f"trace: {r['accesses']} accesses over {c['shards']} shards (seed {c['seed']}); HBM {c['hbm_slots']} slots, "
           f"DRAM {c['dram_slots']}; SSD fetch {c['ssd_cost']}, DRAM fetch {c['dram_cost']}, "
           f"+{c['spec_overhead']} per speculative load; budget {c['budget']}", ""]
    out.append(f"{'policy':<18}{'hits':>7}{'cost':>9}{'in budget':>11}{'gain/1000':>11}{'marginal/1000':>15}")
    b = r["baseline"]
    out.append(f"{b['label']:<18}{b['hits']:>7}{b['cost']:>9}{str(b['cost'] <= c['budget']):>11}{'-':>11}{'-':>15}")
    for p in r["locality"]:
        out.append(f"{p['label']:<18}{p['hits']:>7}{p['cost']:>9}{str(p['within_budget']):>11}"
                   f"{_fmt(p['gain_per_1000'], 2):>11}{_fmt(p['marginal_per_1000'], 2):>15}")
    for p in r["oracle"]:
        out.append(f"{p['label']:<18}{p['hits']:>7}{p['cost']:>9}{str(p['cost'] <= c['budget']):>11}")
    ch = r["chosen"]
    out.append("")
    if ch is None:
        out.append("chosen: nothing fits the budget, not even demand-only")
    else:
        out.append(f"chosen: {ch['label']} (most hits within the budget): {ch['hits']} hits at cost {ch['cost']}, "
                   f"{_fmt(r['gain_per_1000'], 2)} hits gained per 1000 extra cost units over demand-only")
        turns = r["curve_turns"]
        out.append("curve turns after the chosen distance: " + {True: "yes (every further distance buys hits dearer)",
                                                                  False: "no (a further distance buys hits cheaper, "
                                                                         "but costs more than the budget)",
                                                                  None: "n/a (no further distance)"}[turns])
    g = r["oracle_gap"]
    if g:
        out.append(f"oracle at d={g['distance']}: {g['oracle_hits']} hits at cost {g['oracle_cost']}; gap "
                   f"{g['hits']:+d} hits, {g['cost']:+d} cost")
    s = r["stretch"]
    out += ["", f"stretch (penalty {s['penalty']} per speculative load unused within {s['window']} accesses):"]
    q = s["queue"]["same_cost"]
    if q["locality"] and q["queue"]:
        out.append(f"  prefetch queue vs locality, both penalised, cost <= {q['cost_cap']}: "
                   f"{q['queue']['label']} {q['queue']['hits']} hits at {q['queue']['cost']} vs "
                   f"{q['locality']['label']} {q['locality']['hits']} hits at {q['locality']['cost']}")
    a = s["admission"]
    base_adm = a["points"][0]
    out.append(f"  admission filter, demand-only: {base_adm['hits']} hits at {base_adm['cost']} vs LRU "
               f"{b['hits']} at {b['cost']}")
    ac = a["same_cost"]
    if ac["lru"] and ac["admission"]:
        adm = ac["admission"]
        out.append(f"  admission vs LRU, cost <= {ac['cost_cap']}: {adm['label']} {adm['hits']} "
                   f"hits at {ac['admission']['cost']} vs {ac['lru']['label']} {ac['lru']['hits']} at "
                   f"{ac['lru']['cost']}")
    lat = s["latency"]
    best = lat["best_p99"]
    out.append(f"  latency (HBM {lat['lat_hbm']:g}, DRAM {lat['lat_dram']:g}, SSD {lat['lat_ssd']:g}, one fetch "
               f"channel, a demand every {lat['interval']:g}):")
    out.append(f"    {'policy':<18}{'p99':>8}{'mean':>8}{'cost':>9}")
    for p in lat["points"]:
        out.append(f"    {p['label']:<18}{p['p99_latency']:>8.1f}{p['mean_latency']:>8.1f}{p['cost']:>9}")
    if best:
        out.append(f"    best p99 within the budget: {best['label']} (p99 {best['p99_latency']:.1f}, mean "
                   f"{best['mean_latency']:.1f}); chosen by cost: {ch['label'] if ch else '-'} (p99 "
                   f"{_fmt(ch['p99_latency'] if ch else None)})")
    return "\n".join(out)


def write_plot(path: str, r: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fireflyer.fsutil import atomic_write

    fig, ax = plt.subplots(figsize=(7.5, 5))
    series = [("locality (LRU)", [r["baseline"], *r["locality"]], "o-", "tab:blue"),
              ("oracle", r["oracle"], "s--", "tab:green"),
              ("admission filter", r["stretch"]["admission"]["points"], "^-", "tab:orange"),
              ("confidence queue (penalised)", r["stretch"]["queue"]["points"], "d:", "tab:purple"),
              ("locality (penalised)", r["stretch"]["queue"]["locality_with_penalty"], "x:", "tab:gray")]
    for name, pts, style, color in series:
        ax.plot([p["cost"] for p in pts], [p["hits"] for p in pts], style, color=color, label=name)
    for p in [r["baseline"], *r["locality"]]:
        ax.annotate(f"d={p['distance']}", (p["cost"], p["hits"]), textcoords="offset points", xytext=(4, -10),
                    fontsize=8)
    ax.axvline(r["config"]["budget"], color="tab:red", lw=1, label=f"budget {r['config']['budget']}")
    if r["chosen"]:
        ax.plot([r["chosen"]["cost"]], [r["chosen"]["hits"]], "*", ms=16, color="tab:red", label="chosen")
    ax.set_xlabel("cost units")
    ax.set_ylabel(f"HBM hits (of {r['accesses']})")
    ax.set_title("fireflyer cache simulate: hits vs cost")
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


def simulate_main(argv: list[str]) -> int:
    cfg, a = build_config(argv)
    result = study(cfg)
    if a.plot:
        write_plot(a.plot, result)
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        print(render(result))
        if a.plot:
            print(f"\nplot: {a.plot}")
    return 0


def main(argv: list[str]) -> int:
    """``fireflyer cache ...``: dispatch on the subcommand."""
    if not argv or argv[0] != "cache":
        raise UserError("usage: fireflyer cache simulate [options]")
    rest = argv[1:]
    if not rest or rest[0] in ("-h", "--help"):
        print("usage: fireflyer cache simulate [options]\n\n  simulate  the three-tier cache model and the "
              "prefetch study (see fireflyer cache simulate --help)")
        return 0 if rest else 2
    if rest[0] != "simulate":
        raise UserError(f"unknown cache command {rest[0]!r}; the one there is: simulate")
    return simulate_main(rest[1:])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(["cache", *sys.argv[1:]]))
