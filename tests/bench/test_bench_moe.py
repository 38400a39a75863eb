"""``fireflyer bench moe``: its flags, the summary and verdict arithmetic, the parameter counting the
worker does, and one tiny run through the CLI (real ranks, 2x2). No timing asserts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fireflyer.bench.moe import (
    MoEBenchConfig,
    build_config,
    summarise,
    summarise_config,
    train_flops,
    verdicts,
)
from fireflyer.bench.moe_worker import batches
from fireflyer.errors import UserError
from fireflyer.train.moe_model import MoEGPT, MoEShape


def test_defaults_are_the_issue_s_model():
    cfg = build_config([])
    s = cfg.shape
    assert cfg.layout == (2, 2) and cfg.ep == 2 and cfg.batch == 16 and cfg.data == "corpus"
    assert (s.layers, s.d_model, s.heads, s.n_routed, s.n_shared, s.expert_hidden, s.top_k, s.context) == \
        (2, 128, 4, 8, 1, 128, 2, 64)
    assert s.vocab_size == 63  # the shipped corpus's characters
    assert build_config(["--data", "random"]).shape.vocab_size == 65
    quick = build_config(["--quick", "--out", "/tmp/x"])
    assert quick.shape.layers == 1 and quick.rounds == 1 and quick.out_dir == "/tmp/x"


@pytest.mark.parametrize("argv, words", [
    (["--layout", "2"], "NODESxRANKS"),
    (["--layout", "2x1"], "at least 2 ranks per node"),
    (["--layout", "2x3"], "does not divide --experts 8"),
    (["--batch", "0"], "--batch"),
    (["--d-model", "130"], "multiple of --heads"),
    (["--top-k", "9"], "model flags: MoEConfig.top_k"),
    (["--data", "random", "--vocab", "10"], None),
])
def test_flags(argv, words):
    if words is None:
        assert build_config(argv).shape.vocab_size == 10
        return
    with pytest.raises(UserError, match=words) as err:
        build_config(argv)
    assert "\n" not in str(err.value)


def test_bad_layout_from_the_config_itself():
    with pytest.raises(UserError, match="at most 16"):
        MoEBenchConfig(layout=(4, 8))


def _step(step: float, a2a: float = 0.0, **kw) -> dict:
    return {"step": step, "forward": step / 4, "backward": step / 2, "optimizer": step / 8, "bias": step / 8,
            "a2a_s": a2a, "a2a_calls": 10 if a2a else 0, "a2a_bytes": 1000 if a2a else 0, "ddp_wait_s": 0.0,
            "imbalance": kw.get("imbalance", 1.5), "dropped": 0, "loss": 4.0}


def _rank(ep_steps: list[list[float]], rep_steps: list[list[float]], *, ep_params: int = 3, rep_params: int = 6) -> dict:
    return {"threads": 1, "configs": {
        "ep": {"expert_params": ep_params, "params": 10, "ep_size": 2, "experts_held": [[0, 1]],
               "rounds": [[_step(t, a2a=t / 4) for t in r] for r in ep_steps]},
        "replicated": {"expert_params": rep_params, "params": 13, "ep_size": 1, "experts_held": [[0, 1, 2, 3]],
                       "rounds": [[_step(t) for t in r] for r in rep_steps]}}}


def test_summary_takes_the_slowest_rank_per_step_and_the_median_round():
    ranks = [_rank([[1.0, 3.0], [2.0, 2.0], [9.0, 9.0]], [[1.0, 1.0]] * 3),
             _rank([[2.0, 1.0], [1.0, 1.0], [1.0, 1.0]], [[2.0, 2.0]] * 3)]
    row = summarise_config(ranks, "ep")
    # per step the slowest rank: round means 2.5, 2.0, 9.0 -> median 2.5
    assert row["step_s_rounds"] == [2.5, 2.0, 9.0] and row["step_s"] == 2.5
    assert row["a2a_s"] == pytest.approx(2.5 / 4) and row["a2a_share"] == pytest.approx(0.25)
    # phases are the ranks' mean, so they add up to the mean rank's step
    assert row["phases_s"]["backward"] == pytest.approx(sorted([1.75, 1.5, 5.0])[1] / 2)
    assert row["expert_params"] == 3 and row["expert_params_per_rank"] == [3, 3] and row["a2a_calls"] == 10


def test_verdicts_are_exact_fractions_and_the_step_target():
    ep = {"expert_params": 393216, "expert_params_per_rank": [393216] * 4, "step_s": 1.1, "a2a_share": 0.4}
    rep = {"expert_params": 786432, "step_s": 1.0}
    v = verdicts(ep, rep, 2)
    assert v["expert_params_met"] and v["expert_params_ratio_exact"] == "1/2" and v["step_ratio_met"]
    assert v["step_ratio"] == pytest.approx(1.1)
    v = verdicts({**ep, "expert_params": 393217, "step_s": 1.3}, rep, 2)
    assert not v["expert_params_met"] and not v["step_ratio_met"]
    # equal totals but uneven shards are not 1/EP on every rank
    assert not verdicts({**ep, "expert_params_per_rank": [393216, 393215]}, rep, 2)["expert_params_met"]


def test_summarise_wires_rows_and_verdicts():
    cfg = build_config(["--quick"])
    res = summarise(cfg, [_rank([[2.0]], [[1.0]]), _rank([[2.0]], [[1.0]])])
    assert res["verdicts"]["step_ratio"] == pytest.approx(2.0) and not res["verdicts"]["step_ratio_met"]
    assert res["verdicts"]["expert_params_met"] and res["a2a_gbps"] == pytest.approx(1000 / 0.5 / 1e9)


def test_train_flops_counts_top_k_not_all_experts():
    shape = build_config([]).shape
    more = MoEShape(**{**shape.__dict__, "n_routed": 16})
    tokens = 1024
    # more routed experts at the same top-k add only the gate's columns
    assert train_flops(more, tokens) - train_flops(shape, tokens) == 6 * tokens * shape.layers * shape.d_model * 8


def test_expert_parameters_of_the_real_modules_are_the_replicated_ones_over_ep():
    """What the worker counts, on modules built the way the worker builds (replicated here: EP needs ranks),
    against the slices the EP layers would hold: each global expert is one row of the stacked weights."""
    shape = build_config([]).shape
    model = MoEGPT(shape, seed=0)
    per_expert = 3 * shape.d_model * shape.expert_hidden
    total = sum(p.numel() for p in model.expert_parameters())
    assert total == shape.layers * shape.n_routed * per_expert
    assert all(p.shape[0] == shape.n_routed for p in model.expert_parameters())


def test_batches_are_seeded_by_rank_and_step():
    shape = build_config([]).shape
    for data in ("corpus", "random"):
        get = batches(data, shape, 3)
        x, y = get(1, 5)
        assert x.shape == (3, shape.context) and torch.equal(x[:, 1:], y[:, :-1])
        assert torch.equal(get(1, 5)[0], x) and not torch.equal(get(2, 5)[0], x)
        assert int(x.max()) < shape.vocab_size


@pytest.mark.heavy  # the MoE model's training is in the default tier (tests/train/test_train_parallel.py)
@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_quick_run_through_the_cli(tmp_path):
    done = subprocess.run([sys.executable, "-m", "fireflyer.cli", "bench", "moe", "--quick", "--timeout", "90",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "expert params per rank (a)/(b) = 1/2" in done.stdout and "target <= 1.2x" in done.stdout
    doc = json.loads((tmp_path / "moe.json").read_text())
    assert doc["command"][:3] == ["fireflyer", "bench", "moe"] and doc["verdicts"]["expert_params_met"]
    ep, rep = doc["rows"]["ep"], doc["rows"]["replicated"]
    assert ep["experts_held"] == [[0, 1]] and rep["experts_held"] == [[0, 1, 2, 3]]
    assert ep["a2a_calls"] == 5 and rep["a2a_calls"] == 0 and ep["a2a_bytes"] > 0  # 3 forward + 2 backward, 1 layer
    assert (tmp_path / "moe.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
