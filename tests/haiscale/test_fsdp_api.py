"""haiscale FSDP in one process (an hfreduce group of one rank): the API, bad input, units, memory helpers, bench flags."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fireflyer.errors import UserError
from fireflyer.train.model import GPT, ModelShape, synthetic_batch


@pytest.fixture(scope="module")
def pg():
    import fireflyer.hfreduce  # noqa: F401 - registers the backend

    if dist.is_initialized():
        pytest.skip("another test left a default process group behind")
    dist.init_process_group("hfreduce", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


CFG = ModelShape(vocab_size=32, context=4, layers=2, d_model=16, heads=2)


def _fully_shard(*args, **kwargs):
    from fireflyer.haiscale.fsdp import fully_shard

    return fully_shard(*args, **kwargs)


class Blockless(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize(
    "make, kwargs, exc, needle",
    [
        (lambda: "model", {}, TypeError, "nn.Module"),
        (lambda: nn.ReLU(), {}, ValueError, "no parameters"),
        (lambda: GPT.seeded(CFG), {"shard_types": ("Block",)}, TypeError, "shard_types"),
        (lambda: GPT.seeded(CFG), {"shard_types": nn.Linear, "auto_wrap": bool}, ValueError, "not both"),
        (lambda: GPT.seeded(CFG), {"prefetch": -1}, ValueError, "prefetch"),
        (lambda: GPT.seeded(CFG), {"reshard_after_forward": "yes"}, TypeError, "reshard_after_forward"),
        (lambda: GPT.seeded(CFG), {"mp_policy": "bf16"}, TypeError, "MixedPrecisionPolicy"),
        (lambda: GPT.seeded(CFG), {"group": object()}, TypeError, "ProcessGroup"),
        (lambda: GPT.seeded(CFG), {"optimizer": 3}, TypeError, "functools.partial"),
        (lambda: GPT.seeded(CFG), {"optimizer": lambda params: "adam"}, TypeError, "not a torch.optim.Optimizer"),
        (lambda: GPT.seeded(CFG), {"optimizer": lambda params: torch.optim.SGD(params[:1], lr=1)}, ValueError,
         "leaves out trainable parameters"),
        (lambda: GPT.seeded(CFG), {"optimizer": lambda params: torch.optim.LBFGS(params)}, TypeError, "closure"),
        (lambda: GPT.seeded(CFG).to("meta"), {}, ValueError, "meta device"),
    ],
)
def test_bad_input_says_what_to_do(pg, make, kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        _fully_shard(make(), **kwargs)


def test_sharding_twice_or_attaching_twice_is_refused(pg):
    from fireflyer.haiscale.fsdp import apply_optimizer_in_backward

    model = _fully_shard(GPT.seeded(CFG), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(ValueError, match="already sharded"):
        _fully_shard(model)
    with pytest.raises(ValueError, match="already steps an optimizer"):
        apply_optimizer_in_backward(model, functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(ValueError, match="not sharded by fireflyer.haiscale.fully_shard"):
        apply_optimizer_in_backward(GPT.seeded(CFG), functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(ValueError, match="build it after fully_shard"):
        apply_optimizer_in_backward(_fully_shard(GPT.seeded(CFG)), torch.optim.SGD(GPT.seeded(CFG).parameters(), lr=0.1))


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")  # Linear units return views; harmless here
def test_units_default_to_the_modulelist_blocks_or_follow_the_choice(pg):
    from fireflyer.train.model import Block
    from fireflyer.haiscale.fsdp import sharding_info

    model = GPT.seeded(CFG)
    blocks = list(model.blocks)
    assert sharding_info(_fully_shard(model)).units == blocks
    with pytest.warns(UserWarning, match="tied weights"):
        by_linear = _fully_shard(GPT.seeded(CFG), shard_types=nn.Linear)
    assert len(sharding_info(by_linear).units) == 4 * CFG.layers  # the head shares the embedding's weight
    by_linear(*synthetic_batch(CFG, rank=0, step=0, size=2)).backward()  # so the root gathers it for both
    model = GPT.seeded(CFG)
    assert sharding_info(_fully_shard(model, auto_wrap=lambda m: isinstance(m, Block))).units == list(model.blocks)
    with pytest.warns(UserWarning, match="no units"):
        _fully_shard(Blockless())


def test_one_rank_training_matches_plain_training_with_and_without_optimizer_in_backward(pg):
    from fireflyer.haiscale.fsdp import FullyShardedDataParallel

    adam = functools.partial(torch.optim.AdamW, lr=1e-2)
    plain = GPT.seeded(CFG)
    plain_opt = adam(plain.parameters())
    sharded = _fully_shard(GPT.seeded(CFG))
    sharded_opt = adam(sharded.parameters())
    in_bwd = FullyShardedDataParallel(GPT.seeded(CFG), optimizer=adam)
    for step in range(3):
        x, y = synthetic_batch(CFG, rank=0, step=step, size=2)
        for model, opt in ((plain, plain_opt), (sharded, sharded_opt)):
            opt.zero_grad()
            model(x, y).backward()
            opt.step()
        in_bwd(x, y).backward()
    full = in_bwd.full_state_dict()
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters(), strict=True):
        assert torch.equal(p, q.full_tensor()), name
        assert torch.equal(p, full[name]), name
    assert all(p.grad is None for p in in_bwd.parameters())
    assert in_bwd.tensor_bytes().grads == 0 and in_bwd.tensor_bytes().optimizer > 0


def test_config_checks_itself():
    from fireflyer.haiscale.fsdp import FSDPConfig

    assert FSDPConfig().prefetch == 1
    with pytest.raises(ValueError, match="prefetch"):
        FSDPConfig(prefetch=True)
    with pytest.raises(TypeError, match="overlap_reduce_scatter"):
        FSDPConfig(overlap_reduce_scatter=1)


def test_tensor_bytes_count_shared_storage_once_and_peak_rss_sees_a_big_buffer():
    from fireflyer.haiscale.fsdp_memory import PeakRSS, tensor_bytes

    model = GPT.seeded(CFG)  # head.weight is tok.weight
    opt = torch.optim.Adam(model.parameters())
    x, y = synthetic_batch(CFG, rank=0, step=0, size=2)
    model(x, y).backward()
    opt.step()
    held = tensor_bytes(model, opt)
    assert held.params == 4 * CFG.num_params == held.grads
    assert held.optimizer == 2 * held.params + 4 * len(list(model.parameters()))  # exp_avg, exp_avg_sq, step
    rss = PeakRSS()
    big = torch.ones(16 << 20)  # 64 MiB
    del big
    growth = rss.growth_bytes()
    assert growth is None or growth >= 60 << 20


def test_gpt_for_params_comes_close():
    cfg = ModelShape.for_params(25_000_000, layers=6)
    assert abs(cfg.num_params - 25e6) < 3e6 and cfg.d_model % cfg.heads == 0
    assert sum(p.numel() for p in GPT.seeded(ModelShape.for_params(300_000, layers=1)).parameters()) \
        == ModelShape.for_params(300_000, layers=1).num_params


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--layouts", "1x1"], "at least 2 ranks"),
        (["--layouts", "four"], "NODESxRANKS"),
        (["--params", "lots"], "lots"),
        (["--variants", "haiscale,zero"], "zero"),
        (["--steps", "0"], "--steps"),
        (["--bogus"], "unrecognized"),
    ],
)
def test_bench_flags_are_checked(argv, needle):
    from fireflyer.bench.fsdp import build_config

    with pytest.raises(UserError, match=needle):
        build_config(argv)


def test_bench_quick_config():
    from fireflyer.bench.fsdp import build_config, parse_count

    cfg = build_config(["--quick", "--layouts", "2x2", "--out", "/tmp/x"])
    assert cfg.layouts == ((2, 2),) and cfg.model.layers == 2 and cfg.model.num_params < 2e6
    assert parse_count("25M") == 25_000_000 and parse_count("1.5k") == 1500


def test_bench_report_from_rank_results(tmp_path):
    import io
    import json

    from rich.console import Console

    from fireflyer.bench.fsdp import (
        FSDPBenchConfig,
        print_layout,
        summarise,
        write_png,
    )

    def rank(r: int, scale: float) -> dict:
        mem = {"ddp": 4.0, "haiscale-optbwd": 1.0}
        return {"rank": r, "variants": {v: {
            "step_s": [0.2 * scale, 0.1 * scale, 0.3 * scale], "losses": [5.0, 4.0],
            "params_bytes": int(400 * mem.get(v, 1.0)), "grads_bytes": 0 if v == "haiscale-optbwd" else int(400 * mem.get(v, 1.0)),
            "optimizer_bytes": int(800 * mem.get(v, 1.0)), "rss_growth_bytes": 10_000_000 if r else None,
            "rss_peak_reset": True, "stats": {}} for v in ("haiscale", "haiscale-optbwd", "fsdp2-gloo", "ddp")}}

    variants = ("haiscale", "haiscale-optbwd", "fsdp2-gloo", "ddp")
    res = summarise("1x2", 2, [rank(0, 1.0), rank(1, 2.0 / 3)], variants)
    row = res["rows"]["haiscale"]
    assert row["step_s"] == pytest.approx(0.2)  # the slowest rank's median
    assert row["memory_vs_ddp"]["params"] == pytest.approx(0.25)
    assert res["rows"]["haiscale-optbwd"]["memory_vs_ddp"]["grads"] == 0
    assert row["speedup_vs_fsdp2_gloo"] == pytest.approx(1.0) and row["rss_growth_bytes"] == 10_000_000
    out = io.StringIO()
    print_layout(Console(file=out, width=160), res)
    assert "haiscale-optbwd" in out.getvalue() and "0.25" in out.getvalue()
    cfg = FSDPBenchConfig(variants=variants, layouts=((1, 2),))
    write_png(str(tmp_path / "fsdp.png"), cfg, [res])
    assert (tmp_path / "fsdp.png").read_bytes()[:4] == b"\x89PNG"
    json.dumps(res)
