"""fireflyer bench recovery: its flags through the CLI door, and its arithmetic on a made-up run (no timing asserts).

The benchmark itself runs four training jobs and kills nodes (minutes): it is run by hand, not here.
"""

from __future__ import annotations

import pytest

from fireflyer.bench import recovery as bench
from fireflyer.errors import UserError
from fireflyer.testing.cli import fireflyer, one_error_line


def test_the_cli_lists_and_explains_it():
    done = fireflyer("bench", "recovery", "--help", timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--every" in done.stdout and "--kills" in done.stdout and "checkpoint-restart" in done.stdout


def test_the_cli_refuses_kills_past_the_end_in_one_line():
    done = fireflyer("bench", "recovery", "--steps", "100", "--every", "50", "--kills", "2", timeout=60)
    assert "--steps 100" in one_error_line(done)


@pytest.mark.parametrize("argv,needle", [(["--nodes", "1"], "--nodes"), (["--every", "0"], "--every"),
                                         (["--steps", "3", "--kills", "0"], "--steps")])
def test_bad_flags(argv, needle):
    with pytest.raises(UserError, match=needle):
        bench.build_config(argv)


def test_each_kill_is_matched_with_its_failure_rejoin_and_heal():
    ft = {"failures": [{"step": 11, "at": 101.0, "lost": ["node1"], "recovered_s": 2.0},
                       {"step": 31, "at": 130.5, "lost": ["node2"], "recovered_s": 1.0}],
          "quorums": [{"step": 1, "at": 90.0, "replicas": ["node0", "node1", "node2"]},
                      {"step": 11, "at": 102.0, "replicas": ["node0", "node2"]},
                      {"step": 20, "at": 115.0, "replicas": ["node0", "node1", "node2"]},
                      {"step": 31, "at": 131.0, "replicas": ["node0", "node1"]}],
          "heals": [{"step": 0, "replica": "node1", "at": 90.0, "bytes": 10, "seconds": 0.1},
                    {"step": 20, "replica": "node1", "at": 115.1, "bytes": 66391, "seconds": 0.2}]}
    kills = [{"node": "node1", "at": 100.0, "step_seen": 10}, {"node": "node2", "at": 130.0, "step_seen": 30}]
    first, second = bench.recoveries(kills, ft)
    assert first["failure_step"] == 11 and first["kill_to_next_step_s"] == pytest.approx(3.0)
    assert first["rejoin_s"] == pytest.approx(15.0) and first["rejoined_step"] == 20
    assert first["heal_bytes"] == 66391 and first["rejoin_and_heal_s"] == pytest.approx(15.3)
    assert second["kill_to_next_step_s"] == pytest.approx(1.5)
    assert second["rejoin_s"] is None and second["heal_s"] is None  # node2 never came back in this run


def test_goodput_against_the_checkpoint_restart_model():
    g = bench.goodput(useful_s=90.0, wall_s=100.0, failures=2, save_every=100, plain_step_s=0.1, restart_s=15.0)
    assert g["ft_goodput"] == pytest.approx(0.9) and g["ft_lost_s"] == pytest.approx(10.0)
    assert g["cr_lost_per_failure_s"] == pytest.approx(5.0 + 15.0)  # half of 10 s, plus the restart
    assert g["cr_goodput"] == pytest.approx(90 / 130) and g["lost_time_saved_factor"] == pytest.approx(4.0)
    assert bench.goodput(useful_s=10.0, wall_s=9.0, failures=1, save_every=10, plain_step_s=0.1,
                         restart_s=1.0)["lost_time_saved_factor"] is None


def test_step_window():
    assert bench.step_window([(10.0, 1), (12.0, 40), (20.0, 100)]) == (10.0, 99)
    assert bench.step_window([(1.0, 1)])[1] == 0
