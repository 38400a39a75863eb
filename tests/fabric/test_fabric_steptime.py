"""The step-time model (Figs. 8 and 9, ``simulate train``, ``plan --job``): one set of constants,
properties that must hold at any scale, and the CLI's errors."""

import ast
import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fireflyer import cli
from fireflyer.errors import UserError
from fireflyer.fabric import catalog, constants, paper, steptime
from fireflyer.fabric.steptime import Job, step_time
from fireflyer.fabric.workloads import DEEPSEEKMOE_16B, GPT2_MEDIUM, LLAMA_13B, VGG16, ModelSpec, model

FABRIC = Path(steptime.__file__).parent


@pytest.fixture(scope="module")
def a100():
    return catalog.default().node("pcie-a100")


@pytest.fixture(scope="module")
def nvl():
    return catalog.default().node("pcie-a100-nvlink")


# -- one set of constants -----------------------------------------------------------------------

def test_constants_live_in_one_place_and_no_figure_overrides_them():
    names = {f.name for f in dataclasses.fields(constants.StepConstants)}
    for path in FABRIC.glob("*.py"):
        if path.name == "constants.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func
                called = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
                assert called != "StepConstants", f"{path.name} builds its own constants"
                first = ast.unparse(node.args[0]) if node.args else ""
                assert not (called == "replace" and "CONSTANTS" in first), f"{path.name} replaces a constant"
                kws = {k.arg for k in node.keywords}
                assert not kws & names, f"{path.name} passes a step constant ({kws & names}) by hand"
                assert "constants" not in kws, f"{path.name} passes its own constants"
            if isinstance(node, ast.Assign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Attribute):
                        assert t.attr not in names | {"CONSTANTS"}, f"{path.name} assigns {t.attr}"


def test_the_rates_are_read_off_the_figures_they_say(a100, nvl):
    gpt2 = step_time(Job(model=GPT2_MEDIUM, gpus=16, strategy="fsdp", batch_per_gpu=32), a100)
    assert gpt2.seconds == pytest.approx(paper.FIG8B["HaiScale FSDP"][16], rel=0.01)
    assert sum(gpt2.parts.values()) == 0  # all compute: the rate is read off a hidden-communication point
    llama = step_time(Job(model=LLAMA_13B, gpus=64, pp=4, global_batch=4096), nvl)
    assert llama.seconds == pytest.approx(paper.FIG9A[64], rel=0.01)


def test_constants_check_themselves():
    with pytest.raises(UserError):
        constants.StepConstants(nccl_overlap=1.5)
    with pytest.raises(UserError):
        constants.StepConstants(bf16_train_tflops=0)
    with pytest.raises(UserError):
        constants.CONSTANTS.rate_flops("fp64")


# -- properties -----------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(nodes=st.sampled_from([1, 2, 4, 8, 16, 64, 128]), system=st.sampled_from(["haiscale", "torch"]),
       strategy=st.sampled_from(["ddp", "fsdp"]), m=st.sampled_from([VGG16, GPT2_MEDIUM]))
def test_weak_scaling_is_never_faster_than_its_compute(a100, nodes, system, strategy, m):
    r = step_time(Job(model=m, gpus=8 * nodes, strategy=strategy, system=system, batch_per_gpu=32), a100)
    alone = step_time(Job(model=m, gpus=1, strategy=strategy, system=system, batch_per_gpu=32), a100)
    assert r.seconds >= r.compute == pytest.approx(alone.compute)
    assert r.seconds >= alone.seconds - 1e-12


@settings(max_examples=25, deadline=None)
@given(field=st.sampled_from(["nic_gbps", "pcie_gb_s", "memory_gb_s", "gpu_nic_p2p_gb_s", "root_port_gb_s",
                              "nvlink_gb_s"]),
       factor=st.sampled_from([1.25, 2.0, 4.0]), gpus=st.sampled_from([40, 80, 320, 640]),
       moe=st.booleans(), ep=st.sampled_from([0, 8, 64]))
def test_more_bandwidth_never_makes_a_step_slower(nvl, field, factor, gpus, moe, ep):
    faster = dataclasses.replace(nvl, **{field: getattr(nvl, field) * factor})
    if moe:
        ep = ep if (gpus // 10) % max(ep, 1) == 0 else 0
        job = Job(model=DEEPSEEKMOE_16B, gpus=gpus, pp=10, global_batch=4608, ep=ep)
    else:
        job = Job(model=LLAMA_13B, gpus=64 * (gpus // 40), pp=4, global_batch=4096)
    assert step_time(job, faster).seconds <= step_time(job, nvl).seconds + 1e-12


def test_strong_scaling_gets_faster_and_less_efficient(nvl):
    times = [step_time(Job(model=LLAMA_13B, gpus=g, pp=4, global_batch=4096), nvl).seconds for g in (64, 128, 256, 512)]
    assert times == sorted(times, reverse=True)
    eff = [times[0] * 64 / (t * g) for t, g in zip(times, (64, 128, 256, 512))]
    assert eff == sorted(eff, reverse=True)


def test_staggered_placement_is_what_keeps_stage_sends_cheap(nvl):
    job = Job(model=LLAMA_13B, gpus=512, pp=4, global_batch=4096)
    packed = dataclasses.replace(job, stagger=False)
    assert step_time(packed, nvl).seconds > step_time(job, nvl).seconds


def test_haiscale_overlaps_and_torch_does_not(a100):
    hs = step_time(Job(model=VGG16, gpus=512, strategy="ddp", batch_per_gpu=50), a100)
    tc = step_time(Job(model=VGG16, gpus=512, strategy="ddp", system="torch", batch_per_gpu=50), a100)
    assert hs.seconds == pytest.approx(hs.compute) and tc.seconds > 1.5 * hs.seconds


# -- bad input, CLI ---------------------------------------------------------------------------------

def test_bad_specs_raise_user_errors(tmp_path):
    with pytest.raises(UserError):
        ModelSpec(name="x", params=1e9)  # neither flops nor shape
    with pytest.raises(UserError):
        Job(model=LLAMA_13B, gpus=66, pp=4, global_batch=8)
    with pytest.raises(UserError):
        Job(model=VGG16, gpus=8, strategy="ddp")
    f = tmp_path / "m.toml"
    f.write_text('params = 7e9\nlayers = 32\nhidden = 4096\nseq = 4096\n')
    assert model(str(f)).name == "m"
    f.write_text('params = 7e9\nwidth = 3\n')
    with pytest.raises(UserError, match="unknown field"):
        model(str(f))


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv, message", [
    (["simulate", "train", "--model", "nope", "--gpus", "64"], "unknown model 'nope'"),
    (["simulate", "train", "--model", "llama-13b", "--gpus", "66"], "multiple of 4"),
    (["simulate", "train", "--model", "llama-13b", "--gpus", "0"], "positive whole numbers"),
    (["simulate", "train", "--model", "llama-13b", "--gpus", "72"], "whole number of 8-GPU nodes"),
    (["simulate", "train", "--model", "llama-13b", "--gpus", "64", "--pp", "0"], "--pp must be at least 1"),
    (["simulate", "train", "--model", "missing.toml", "--gpus", "64"], "cannot read model"),
    (["simulate", "train", "--gpus", "64"], "--model"),
    (["plan", "--gpus", "640", "--job", "nope"], "unknown model 'nope'"),
    (["plan", "--gpus", "640", "--job", "deepseekmoe-16b", "--baseline-node", "nope"], "unknown node preset"),
])
def test_train_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_simulate_train_forecasts_any_count(capsys):
    rc, out, _ = run(capsys, "simulate", "train", "--model", "deepseekmoe-16b", "--gpus", "40,640,2560")
    assert rc == 0 and "expert all-to-all" in out and "2560" in out
    rc, out, _ = run(capsys, "simulate", "train", "--model", "llama-13b", "--gpus", "64,8192", "--json")
    data = json.loads(out)
    assert rc == 0 and [r["gpus"] for r in data["results"]] == [64, 8192]
    assert data["results"][1]["seconds"] < data["results"][0]["seconds"]
    rc, out, _ = run(capsys, "simulate", "train", "--model", "vgg16", "--gpus", "32,512", "--system", "torch")
    assert rc == 0 and "ddp" in out


def test_plan_prices_the_section_ix_moe_design_against_todays_node(capsys):
    rc, out, _ = run(capsys, "plan", "--gpus", "640", "--node", "pcie-nextgen", "--switch", "roce128", "--planes", "4",
                     "--job", "deepseekmoe-16b", "--json")
    job = json.loads(out)["job"]
    assert rc == 0 and job["ep"] == 64
    assert job["speedup"] > 2 and job["cost_per_step_ratio"] < 1
    assert job["baseline"]["parts"]["expert all-to-all"] > 5 * job["design"]["parts"]["expert all-to-all"]
