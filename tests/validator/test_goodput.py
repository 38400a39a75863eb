"""fireflyer simulate goodput: checkpoint-restart against fault-tolerant training, through the CLI door.

The FT-HSDP check (the job MTBF derived from its 44% point, its 80% point predicted within 10%),
Fire-Flyer 2's Tables VI-VII rates at 10,000 GPUs, Young's interval, monotonicity, and bad
input as one line and exit code 2.
"""

from __future__ import annotations

import json
import math

import pytest

from fireflyer import cli
from fireflyer.errors import UserError
from fireflyer.testing.cli import fireflyer, one_error_line
from fireflyer.validator import goodput as gp
from fireflyer.validator.xid import TABLE_VI


def run(capsys, *args: str) -> str:
    assert cli.main(["simulate", "goodput", *args]) == 0
    out = capsys.readouterr()
    return out.out


def run_json(capsys, *args: str) -> dict:
    return json.loads(run(capsys, *args, "--json"))


def refused(capsys, *args: str) -> str:
    assert cli.main(["simulate", "goodput", *args]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------- FT-HSDP's 44% -> 80%

def test_ft_hsdp_80_percent_is_predicted_within_10_percent_from_the_mtbf_of_its_44_percent(capsys):
    rep = run_json(capsys, "--reproduce", "ft-hsdp")["reproduction"]
    pub, model, err = rep["published"], rep["model"], rep["relative_error"]
    assert (pub["gpus"], pub["stall_s"], pub["ft_stall_s"]) == (100_000, 600, 180)
    assert (pub["goodput"], pub["ft_goodput"]) == (0.44, 0.80)
    assert model["goodput"] == pytest.approx(0.44, abs=1e-9)  # fitted: the MTBF comes from this point
    assert abs(err["ft_goodput"]) < 0.10  # predicted: the check
    assert model["ft_goodput"] == pytest.approx(0.44 ** (180 / 600), rel=1e-6)  # e^(-S/M) at the fitted M
    m = rep["derived"]["job_mtbf_s"]
    assert m == pytest.approx(-600 / math.log(0.44), rel=1e-6)
    assert rep["derived"]["gpu_mtbf_hours"] == pytest.approx(m * 100_000 / 3600)


def test_the_derivation_uses_the_synchronous_point_only():
    honest = gp.reproduce(gp.FT_HSDP)
    other = gp.reproduce(gp.Published(**{**gp.FT_HSDP.__dict__, "ft_goodput": 0.5}))
    assert other.job_mtbf_s == honest.job_mtbf_s and other.ft_goodput == honest.ft_goodput
    assert other.ft_error == pytest.approx(honest.ft_goodput / 0.5 - 1)


def test_reproduction_text_says_what_is_published_derived_and_checked(capsys, tmp_path):
    png = tmp_path / "ft-hsdp.png"
    out = run(capsys, "--reproduce", "ft-hsdp", "--plot", str(png))
    assert "published: 100,000 GPUs" in out and "not published: the failure rate" in out
    assert "derived from the 44% point alone" in out
    assert "fitted" in out and "the check" in out and "-2.3%" in out
    assert "1/(1+S/M) 72.4%" in out  # the simpler stall model, shown rather than hidden
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- the paper's rates

def test_fire_flyer_tables_vi_vii_at_10000_gpus(capsys):
    doc = run_json(capsys, "--gpus", "10000")
    paper = doc["failures"]["paper"]
    interrupting = sum(n for code, n in TABLE_VI.items() if code not in (43, 45, 63))
    assert paper["per_year"]["InfiniBand flash cuts"] == 178 and paper["per_year"]["CPU memory ECC"] == 108
    assert paper["total_per_year"] == interrupting + 178 + 108 == 8429
    assert doc["failures"]["gpu_mtbf_hours"] == pytest.approx(10_000 * 8760 / 8429)
    (row,) = doc["rows"]
    m = 8760 / 8429 * 3600  # the whole cluster as one job: its MTBF is the cluster's
    assert row["job_mtbf_s"] == pytest.approx(m) and row["failures_per_day"] == pytest.approx(8429 / 365)
    c, r = gp.DEFAULT_CHECKPOINT_WRITE_S, gp.DEFAULT_RESTART_S
    tau = math.sqrt(2 * c * m)
    assert row["checkpoint_restart"] == pytest.approx(tau / (m * math.exp(r / m) * math.expm1((tau + c) / m)))
    assert row["fault_tolerant"] == pytest.approx(math.exp(-gp.DEFAULT_FT_STALL_S / m))
    hw = run_json(capsys, "--gpus", "10000", "--hardware-only")["failures"]["paper"]
    assert hw["total_per_year"] == 8429 - 45 - 2487


def test_default_text_names_its_sources_and_warns_the_recovery_times_are_small(capsys):
    out = run(capsys)
    assert "Tables VI-VII" in out and "8,429 a year on 10,000 GPUs" in out
    assert "measured on this 2-core host" in out and "--reproduce ft-hsdp" in out
    assert "100,000" in out and "ckpt-restart" in out and "fault-tolerant" in out


# ---------------------------------------------------------------- the model

def test_young_interval_matches_the_formula_and_can_be_overridden(capsys):
    rows = run_json(capsys, "--mtbf-gpu-hours", "50000", "--checkpoint-write-s", "7", "--gpus", "1000,16000")["rows"]
    for row in rows:
        assert row["job_mtbf_s"] == pytest.approx(50_000 * 3600 / row["gpus"])
        assert row["checkpoint_interval_s"] == pytest.approx(math.sqrt(2 * 7 * row["job_mtbf_s"]))
        assert row["lost_per_failure_s"] == pytest.approx(row["checkpoint_interval_s"] / 2 + gp.DEFAULT_RESTART_S)
    fixed = run_json(capsys, "--mtbf-gpu-hours", "50000", "--checkpoint-interval-s", "300")["rows"]
    assert {r["checkpoint_interval_s"] for r in fixed} == {300}


def test_more_gpus_lower_goodput_and_fault_tolerance_helps(capsys):
    rows = run_json(capsys, "--restart-s", "600", "--ft-stall-s", "180", "--checkpoint-write-s", "5",
                    "--gpus", "1000,2000,4000,8000,16000,32000,64000,128000")["rows"]
    cr = [r["checkpoint_restart"] for r in rows]
    ft = [r["fault_tolerant"] for r in rows]
    assert all(a > b for a, b in zip(cr, cr[1:])) and all(a > b for a, b in zip(ft, ft[1:]))
    assert all(f > c for f, c in zip(ft, cr)) and all(0 < c < 1 for c in cr)


def test_first_order_limit_is_half_an_interval_plus_the_restart():
    rec = gp.Recovery(restart_s=30.0, checkpoint_write_s=2.0)
    m = 1e6
    tau = gp.checkpoint_interval(m, rec)
    assert gp.checkpoint_restart_goodput(m, rec) == pytest.approx(1 - 2 / tau - (30 + tau / 2) / m, abs=1e-5)
    # no overflow where failures come far faster than restarts: goodput goes to 0, not an error
    assert gp.checkpoint_restart_goodput(0.01, gp.Recovery(restart_s=600.0)) == 0.0


def test_replicas_out_healing_cost_their_share_and_one_replica_is_no_fault_tolerance(capsys):
    doc = run_json(capsys, "--mtbf-node-hours", "2000", "--gpus-per-node", "8", "--gpus", "1000,8000",
                   "--replica-gpus", "2000", "--rejoin-s", "900", "--ft-stall-s", "60")
    small, big = doc["rows"]
    assert small["replicas"] == 0 and small["fault_tolerant"] is None
    m = 2000 * 8 * 3600 / 8000
    assert big["replicas"] == 4
    assert big["fault_tolerant"] == pytest.approx(math.exp(-60 / m) * (1 - 900 / (m * 4)))
    assert "-: fewer than 2 replicas of 2,000 GPUs" in run(capsys, "--gpus", "1000", "--replica-gpus", "2000")


def test_measured_file_sets_the_ft_recovery_and_flags_win(capsys, tmp_path):
    measured = tmp_path / "recovery.json"
    measured.write_text(json.dumps({"stall_s": 7.5, "rejoin_s": 40, "machine": {"cpu": "x"}}))
    rec = run_json(capsys, "--measured", str(measured))["recovery"]
    assert (rec["ft_stall_s"], rec["rejoin_s"]) == (7.5, 40)
    assert rec["sources"]["ft_stall_s"] == str(measured) and rec["sources"]["restart_s"] == "default"
    rec = run_json(capsys, "--measured", str(measured), "--ft-stall-s", "1")["recovery"]
    assert (rec["ft_stall_s"], rec["rejoin_s"], rec["sources"]["ft_stall_s"]) == (1, 40, "--ft-stall-s")


def test_plot_and_simulate_usage(capsys, tmp_path):
    png = tmp_path / "goodput.png"
    out = run(capsys, "--plot", str(png))
    assert f"wrote {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["simulate", "--help"]) == 0
    assert "goodput" in capsys.readouterr().out


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("args, words", [
    (["--mtbf-gpu-hours", "-5"], "--mtbf-gpu-hours"),
    (["--mtbf-gpu-hours", "0"], "> 0"),
    (["--mtbf-node-hours", "0"], "--mtbf-node-hours"),
    (["--mtbf-node-hours", "inf"], "--mtbf-node-hours"),
    (["--gpus", "0"], "1..1,000,000"),
    (["--gpus", "1000,1000001"], "1..1,000,000"),
    (["--gpus", "10k"], "--gpus"),
    (["--restart-s", "-1"], "--restart-s"),
    (["--replica-gpus", "0"], "--replica-gpus"),
    (["--gpus-per-node", "4"], "--mtbf-node-hours"),
    (["--hardware-only", "--mtbf-gpu-hours", "9"], "--hardware-only"),
    (["--reproduce", "ft-hsdp", "--ft-stall-s", "1"], "drop --ft-stall-s"),
])
def test_bad_flags_are_one_line_and_exit_2(capsys, args, words):
    assert words in refused(capsys, *args)


@pytest.mark.parametrize("content, words", [
    (None, "No such file"),
    ("{stall_s: 1", "not JSON"),
    (b"\x89PNG\r\n", "not JSON"),
    ("[1, 2]", "a JSON object"),
    ('{"stall_s": 1}', "no rejoin_s"),
    ('{"stall_s": -1, "rejoin_s": 2}', "stall_s must be"),
    ('{"stall_s": "2", "rejoin_s": 2}', "stall_s must be"),
    ('{"stall_s": true, "rejoin_s": 2}', "stall_s must be"),
])
def test_bad_measured_files_are_one_line_and_exit_2(capsys, tmp_path, content, words):
    path = tmp_path / "recovery.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    line = refused(capsys, "--measured", str(path))
    assert line.startswith("fireflyer simulate: error: --measured") and words in line


def test_bad_input_in_a_real_process_is_one_line_without_traceback():
    done = fireflyer("simulate", "goodput", "--mtbf-gpu-hours", "-1", timeout=60)
    assert done.returncode == 2 and "--mtbf-gpu-hours" in one_error_line(done)


def test_the_model_checks_its_own_inputs():
    with pytest.raises(UserError, match="gpu_mtbf_hours"):
        gp.GoodputConfig(gpu_mtbf_hours=0)
    with pytest.raises(UserError, match="restart_s"):
        gp.Recovery(restart_s=float("nan"))
    with pytest.raises(UserError, match="1..1,000,000"):
        gp.simulate([2_000_000], gp.GoodputConfig(gpu_mtbf_hours=1000))
    with pytest.raises(UserError, match="2 replicas"):
        gp.fault_tolerant_goodput(100.0, gp.Recovery(), replicas=1)
