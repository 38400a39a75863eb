"""``fireflyer bench platform`` at tiny sizes: it runs, writes its JSON and PNG, and its state is sound.

The round trip on a real platform is skipped here (it starts processes); no timing is asserted.
"""

from __future__ import annotations

import json

import pytest

from fireflyer.errors import UserError
from fireflyer.bench import platform as bench
from fireflyer.platform.state.policy import PolicyConfig, schedule


def test_the_bench_runs_at_tiny_sizes_and_writes_json_and_png(tmp_path):
    out = tmp_path / "out"
    rc = bench.main(["--quick", "--skip-roundtrip", "--tasks", "150", "--nodes", "40", "--cycles", "1",
                     "--sim-nodes", "32", "--sim-hours", "4", "--day-seeds", "2", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "bench-platform.json").read_text())
    assert (out / "bench-platform.png").stat().st_size > 0
    c = doc["cycle"]
    assert c["tasks_queued"] == 150 and c["nodes"] == 40 and len(c["daemon_tick_s"]["all"]) == 1
    assert c["baseline_s"] == 1.0 and c["ratio_daemon"] > 0
    assert doc["roundtrip"] is None
    day = doc["day"]
    assert set(day["policies"]) == {"hai", "fifo", "fifo_backfill"}
    assert day["config"]["nodes"] == 32 and day["ratio_utilisation_hai_to_fifo"] > 0
    assert [x["seed"] for x in day["seeds"]] == [0, 1]
    assert doc["command"][:3] == ["fireflyer", "bench", "platform"]


def test_the_cycle_state_is_what_the_policy_would_run():
    s = bench.cycle_state(tasks=300, nodes=60, zones=2, users=20, seed=1)
    assert len(s.queued) == 300 and all(t.state == "queued" for t in s.queued)
    held = [n for t in s.running for n in t.assigned]
    assert len(held) == len(set(held)) <= 60
    assert all(len(t.assigned) == t.nodes for t in s.running)
    ids = [t.id for t in s.tasks]
    assert len(ids) == len(set(ids))
    # deterministic for a seed
    again = bench.cycle_state(tasks=300, nodes=60, zones=2, users=20, seed=1)
    assert again.tasks == s.tasks and again.quotas == s.quotas
    d = schedule(s.nodes, s.tasks, s.quotas, PolicyConfig())
    assert len(d.starts) + len(d.suspends) + len(d.waiting) > 0


def test_flags_map_onto_the_config_and_bad_ones_are_one_line_errors():
    cfg = bench.build_config(["--ticks", "0.2,0.5", "--reps", "2", "--out", "x"])
    assert cfg.ticks == (0.2, 0.5) and cfg.reps == 2 and cfg.out_dir == "x" and cfg.tasks == 10_000
    quick = bench.build_config(["--quick", "--tasks", "99"])
    assert quick.tasks == 99 and quick.nodes == 125 and quick.reps == 1
    with pytest.raises(UserError, match="--ticks"):
        bench.build_config(["--ticks", "fast"])
    with pytest.raises(UserError, match="tasks"):
        bench.build_config(["--tasks", "0"])
    with pytest.raises(UserError, match="ticks"):
        bench.build_config(["--ticks", "0"])



def test_the_simulated_day_is_the_simulator_s_own_config():
    cfg = bench.build_config(["--sim-nodes", "32", "--sim-hours", "4", "--sim-step", "30"])
    assert (cfg.sim.nodes, cfg.sim.hours, cfg.sim.step_s) == (32, 4.0, 30.0)
    assert cfg.sim.suspend_s == bench.sim.SimConfig().suspend_s  # the rest: the simulator's defaults
    flat = bench.config_fields(cfg)
    assert flat["sim_nodes"] == 32 and flat["sim_step_s"] == 30.0 and "sim" not in flat
    with pytest.raises(UserError, match="simulated day: nodes"):
        bench.build_config(["--sim-nodes", "0"])
