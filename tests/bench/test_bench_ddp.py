"""fireflyer bench ddp: flags and the arithmetic of its summary (the timing itself is not a test)."""

from __future__ import annotations

import pytest

from fireflyer.errors import UserError
from fireflyer.bench.ddp import build_config, summarise


@pytest.mark.parametrize("argv,needle", [
    (["--layouts", "3"], "NODESxRANKS"),
    (["--layouts", "9x9"], "1-16"),
    (["--weak", "a,b"], "--weak"),
    (["--d-model", "100"], "multiple of 64"),
    (["--batch", "0"], "--batch"),
    (["--bucket-mb", "0"], "--bucket-mb"),
])
def test_bad_flags_say_what_is_wrong(argv, needle):
    with pytest.raises(UserError, match=needle):
        build_config(argv)


def test_defaults_are_the_issue_s_layouts():
    cfg = build_config([])
    assert cfg.layouts == ((1, 4), (2, 2)) and cfg.weak == (1, 2, 4)
    assert build_config(["--weak", "none"]).weak == ()


def _rank(step, comm, wait):
    return {"step_s": step, "comm_alone_s": comm, "haiscale_wait_s": wait}


def test_summary_takes_the_slowest_rank_and_derives_ratio_and_hiding():
    report = {"world": 2, "nodes": 1, "params": 1000, "grad_bytes": 4000, "tokens_per_rank": 64,
              "threads_per_rank": 1, "buckets": 2, "ranks": [
                  _rank({"compute": 1.0, "haiscale": 1.2, "gloo": 1.6}, {"haiscale": 0.4, "gloo": 0.8}, 0.1),
                  _rank({"compute": 0.9, "haiscale": 1.1, "gloo": 1.5}, {"haiscale": 0.3, "gloo": 0.7}, 0.2),
              ]}
    row = summarise(report)
    assert row["step_s"] == {"compute": 1.0, "haiscale": 1.2, "gloo": 1.6}
    assert row["ratio"] == pytest.approx(0.75)
    assert row["hidden_fraction"]["haiscale"] == pytest.approx(0.5)  # 0.2 exposed of 0.4 alone
    assert row["hidden_fraction"]["gloo"] == pytest.approx(0.25)  # 0.6 exposed of 0.8
    assert row["hidden_fraction_wait"] == pytest.approx(0.5)  # waited 0.2 of 0.4
    assert row["allreduce_gbps_alone"]["haiscale"] == pytest.approx(4000 / 0.4 / 1e9)
