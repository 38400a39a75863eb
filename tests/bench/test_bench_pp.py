"""``fireflyer bench pp``: its flags and the bubble arithmetic, without running a pipeline."""

from __future__ import annotations

import pytest

from fireflyer.errors import UserError
from fireflyer.bench.pp import (
    build_config,
    inflight_theory,
    replay,
    step_timing,
)
from fireflyer.haiscale.pipeline import Schedule


def ops_gpipe(stage: int, m: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def ops_1f1b(stage: int, m: int, p: int) -> list[tuple[str, int]]:
    warm = min(m, p - stage)
    ops = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        ops += [("B", b), ("F", f)]
        b, f = b + 1, f + 1
    return ops + [("B", i) for i in range(b, m)]


def events(ops: list[tuple[str, int]], stage: int, t_f: float, t_b: float) -> list[list]:
    """Ops in order, with made-up timestamps (only the order matters to the replay) and CPU costs."""
    return [[kind, mb, stage, float(k), float(k) + 0.5, t_f if kind == "F" else t_b]
            for k, (kind, mb) in enumerate(ops)]


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("p, m", [(4, 4), (4, 8), (4, 16), (2, 5)])
def test_replay_of_even_stages_gives_the_textbook_bubble(schedule, p, m):
    per_rank = [events(ops_gpipe(s, m) if schedule == "GPipe" else ops_1f1b(s, m, p), s, 1.0, 2.0)
                for s in range(p)]
    out = replay(per_rank, p)
    assert out["wall_s"] == pytest.approx((m + p - 1) * 3.0)
    for b in out["bubble"]:
        assert b == pytest.approx(Schedule.parse(schedule).bubble_fraction(p, m))


def test_replay_rejects_an_impossible_order():
    # stage 1 runs backward of micro-batch 0 before anything produced its forward input
    with pytest.raises(ValueError, match="do not form a pipeline schedule"):
        replay([events([("F", 0), ("B", 0)], 0, 1, 1), events([("B", 0), ("F", 0)], 1, 1, 1)], 2)


def test_step_timing():
    per_rank = [{"start": 10.0, "end": 14.0, "events": [["F", 0, 0, 10.0, 11.0, 0.5], ["B", 0, 0, 13.0, 14.0, 1.0]]},
                {"start": 10.5, "end": 13.0, "events": [["F", 0, 1, 11.0, 12.0, 1.0], ["B", 0, 1, 12.0, 13.0, 1.0]]}]
    t = step_timing(per_rank)
    assert t["wall_s"] == 4.0 and t["busy_s"] == [2.0, 2.0] and t["cpu_s"] == [1.5, 2.0]
    assert t["bubble"] == [0.5, 0.5]


def test_inflight_theory():
    assert [inflight_theory(Schedule.ONE_F_ONE_B, 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert inflight_theory(Schedule.GPIPE, 4, 8, 3) == 8
    assert inflight_theory(Schedule.ONE_F_ONE_B, 4, 2, 0) == 2
    assert inflight_theory(Schedule.INTERLEAVED_1F1B, 4, 8, 0) is None


def test_defaults_and_quick():
    cfg = build_config([])
    assert cfg.stages == 4 and cfg.microbatches == (4, 8, 16) and cfg.json_path.endswith("benchmarks/results/pp.json")
    quick = build_config(["--quick", "--schedules", "pipedream,gpipe", "--out", "/tmp/x"])
    assert quick.microbatches == (4, 8) and quick.schedules == (Schedule.ONE_F_ONE_B, Schedule.GPIPE)
    assert quick.png_path == "/tmp/x/pp.png"


@pytest.mark.parametrize("argv, words", [
    (["--schedules", "zb"], "valid schedules"),
    (["--stages", "1"], "at least 2"),
    (["--microbatches", "2,8"], "1F1B needs every --microbatches >= --stages"),
    (["--microbatches", "four"], "comma list of integers"),
    (["--schedules", "interleaved1f1b", "--layers", "3"], "multiple of --virtual"),
    (["--schedules", "interleaved1f1b", "--microbatches", "9"], "multiple of m // --stages"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_flags_are_one_line_user_errors(argv, words):
    with pytest.raises(UserError, match=words) as err:
        build_config(argv)
    assert "\n" not in str(err.value)
