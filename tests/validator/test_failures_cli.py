"""fireflyer failures through the real CLI: --synthesize, text and --json output, --plot, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fireflyer import cli
from fireflyer.errors import UserError
from fireflyer.validator import failures_cli


def fireflyer(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fireflyer.cli", "failures", *args],
                          capture_output=True, text=True, timeout=60, cwd=cwd, check=False)


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    out = tmp_path_factory.mktemp("logs")
    assert cli.main(["failures", "--synthesize", "800", "--nodes", "3", "--seed", "4", "--malformed", "3", "--out", str(out)]) == 0
    return out, json.loads((out / "truth.json").read_text())


def test_json_output_recovers_the_truth_and_has_every_section(synth, tmp_path):
    out, truth = synth
    png = tmp_path / "timeline.png"
    done = fireflyer(str(out), "--json", "--boot-time", truth["boot_time"], "--year", str(truth["year"]),
                     "--save-cost", "8", "--plot", str(png))
    assert done.returncode == 0, done.stderr
    rep = json.loads(done.stdout)
    assert set(rep) >= {"clock", "lines", "noise", "malformed", "logs", "total", "nodes", "actions", "mtbf", "checkpoint"}
    assert rep["clock"] == "wall" and rep["malformed"] == 3
    assert rep["total"]["xids"] == truth["xids"]
    for name, t in truth["nodes"].items():
        node = rep["nodes"][name]
        assert node["xids"] == t["xids"] and node["flash_cuts"] == t["flash_cuts"] and node["outages"] == t["outages"]
        assert {"table", "classes", "hours", "mtbf_hours", "interruptions"} <= set(node)
    assert abs(sum(r["percent"] for r in rep["total"]["table"]) - 100) < 1e-6
    assert rep["actions"]["74"]["action"] == "drain" and rep["actions"]["31"]["action"] == "restart app"
    m, c = rep["mtbf"], rep["checkpoint"]
    assert m["job_nodes"] == 3 and m["job_hours"] == pytest.approx(m["per_node_hours"] / 3)
    assert c["save_cost_s"] == 8 and c["young_interval_s"] == pytest.approx((2 * 8 * m["job_hours"] * 3600) ** 0.5)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_output_has_the_table_and_the_interval(synth):
    out, truth = synth
    done = fireflyer(str(out), "--boot-time", truth["boot_time"], "--year", str(truth["year"]))
    assert done.returncode == 0, done.stderr
    assert "NVLink Error" in done.stdout and "WORKFLOW_NVLINK_ERR" in done.stdout
    assert "Young" in done.stdout and "flash cuts" in done.stdout


def test_save_cost_comes_from_the_checkpoint_benchmark_or_a_default(tmp_path):
    bench = tmp_path / "checkpoint.json"
    bench.write_text(json.dumps({"runs": [{"sync_save_s": 3.5}]}))
    assert failures_cli.save_cost(None, bench) == (3.5, f"{bench}: sync_save_s")
    bench.write_text(json.dumps({"stall_s": 0.2, "sync_save_s": 3.5}))
    assert failures_cli.save_cost(None, bench)[0] == 0.2
    assert failures_cli.save_cost(9.0, bench) == (9.0, "--save-cost")
    # a JSON the user named must be readable; only the default one may be missing
    bench.write_text("{not json")
    with pytest.raises(UserError, match="not JSON"):
        failures_cli.save_cost(None, bench)
    with pytest.raises(UserError, match="missing.json"):
        failures_cli.save_cost(None, tmp_path / "missing.json")
    default = failures_cli.CHECKPOINT_JSON
    expected = failures_cli.DEFAULT_SAVE_COST_S if not default.is_file() else failures_cli.save_cost(None, default)[0]
    assert failures_cli.save_cost(None, None)[0] == expected


def test_node_name_from_the_file_name_or_the_flag(tmp_path):
    log = tmp_path / "gpu17.dmesg.txt"
    log.write_text("[ 10.0] NVRM: Xid (PCI:0000:65:00): 74, pid=1, name=x, link 3\n")
    assert list(json.loads(fireflyer(str(log), "--json").stdout)["nodes"]) == ["gpu17"]
    assert list(json.loads(fireflyer(str(log), "--json", "--node", "rack3-n2").stdout)["nodes"]) == ["rack3-n2"]


@pytest.mark.parametrize("args,needle", [
    (["/no/such/kern.log"], "cannot read log /no/such/kern.log"),
    ([], "give at least one LOG"),
    (["x.log", "--boot-time", "yesterday"], "--boot-time"),
    (["x.log", "--save-cost", "-1"], ">= 0"),
    (["--synthesize", "10"], "--out"),
    (["--synthesize", "10", "--nodes", "0", "--out", "d"], "nodes"),
])
def test_bad_input_is_one_line_and_non_zero(args, needle, tmp_path):
    done = fireflyer(*args, cwd=tmp_path)
    assert done.returncode != 0
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_an_unreadable_file_is_a_user_error(tmp_path):
    d = tmp_path / "a.log"
    d.mkdir()
    (d / "x.txt").write_text("")
    with pytest.raises(failures_cli.UserError, match="no \\*.log files"):
        failures_cli.main([str(d)])


def _event_hours(analysis) -> dict[str, list[float]]:
    """Each node's event times on their own clock, in hours: what the timeline draws."""
    out: dict[str, list[float]] = {}
    for e in analysis.xid_events:
        out.setdefault(e.node, []).append(e.time / 3600)
    for i in analysis.incidents:
        out.setdefault(i.node, []).append(i.down / 3600)
    return out


def test_without_boot_time_or_year_the_timeline_spans_each_node_s_own_events(synth):
    """No --boot-time/--year: dmesg stays on the boot clock and a journal's year is a guess from its file's
    date (years from the dmesg -T log's), so each node counts from its own first event and the axis spans
    the events, not the years between two clocks."""
    from fireflyer.validator.failures import analyse
    from fireflyer.validator.timeline import timeline_axis

    out, _ = synth
    analysis = analyse(failures_cli.read_logs([str(out)], node=None, boot_time=None, year=None))
    assert analysis.clocks == {"boot", "wall"}
    axis = timeline_axis(analysis, aligned=False)
    widest = max(max(h) - min(h) for h in _event_hours(analysis).values())
    lo, hi = axis.xlim
    assert -0.05 * widest - 0.1 <= lo <= 0 and widest <= hi <= 1.05 * widest + 0.1, (axis.xlim, widest)
    for e in analysis.xid_events:
        assert lo <= axis.hours(e.node, e.time, e.clock) <= hi
    assert "each node's first event" in axis.label and "--boot-time and --year" in axis.label


def test_with_boot_time_and_year_the_nodes_share_one_wall_clock(synth):
    from fireflyer.validator.failures import analyse
    from fireflyer.validator.timeline import SHARED, timeline_axis

    out, truth = synth
    analysis = analyse(failures_cli.read_logs([str(out)], node=None, boot_time=failures_cli._iso(truth["boot_time"]),
                                              year=truth["year"]))
    axis = timeline_axis(analysis, aligned=True)
    assert set(axis.origins) == {SHARED} and axis.label.startswith("hours since 2023-") and not axis.own_clock
    every = [h for hs in _event_hours(analysis).values() for h in hs]
    span = max(every) - min(every)
    assert axis.xlim[0] <= 0 and span <= axis.xlim[1] <= 1.05 * span + 0.1


def test_plot_without_boot_time_or_year_through_the_cli(synth, tmp_path):
    out, _ = synth
    png = tmp_path / "timeline.png"
    done = fireflyer(str(out), "--plot", str(png))
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
