"""The reproduction table (``fireflyer simulate paper``): every row within 10% of the paper (or
exact, or inside its band), except the named misses, each with its reason; the count within
10% cannot fall."""

import pytest

from fireflyer import cli
from fireflyer.fabric import reproduce

#: What the model reaches today; raise it when a row comes in, never lower it.
WITHIN_10_FLOOR = 65
WITHIN_5_FLOOR = 58

NAMED_MISSES = {
    "NCCL, 1024 GPUs (GB/s)", "NCCL, 1440 GPUs (GB/s)", "HFReduce, 1440 GPUs (GB/s)",
    "HFReduce+NVLink, 16 GPUs (GB/s)", "HFReduce+NVLink, 32 GPUs (GB/s)", "HFReduce+NVLink, 64 GPUs (GB/s)",
    "HaiScale DDP (HFReduce), 32 GPUs (s)", "Torch FSDP, 16 GPUs (s)", "Torch FSDP, 64 GPUs (s)",
    "DeepSeekMoE-16B PP=10, 80 GPUs (s)", "DeepSeekMoE-16B PP=10, 160 GPUs (s)",
    "DeepSeekMoE-16B PP=10, 320 GPUs (s)",
}


@pytest.fixture(scope="module")
def rows():
    return reproduce.rows()


def test_every_row_within_its_tolerance_but_the_named_misses(rows):
    missed = {r.what for r in rows if not r.ok}
    assert missed == NAMED_MISSES
    for r in rows:
        if not r.ok:
            assert r.why, f"{r.what} misses without a reason"
    figures = {r.figure for r in rows}
    assert {"Table II", "Table III", "III-C", "IV-B", "IV-D3", "IX", "Fig. 7a", "Fig. 7b",
            "Fig. 8a", "Fig. 8b", "Fig. 9a", "Fig. 9b"} <= figures


def test_no_row_is_held_looser_than_10_percent(rows):
    assert max(r.tolerance for r in rows) <= reproduce.WITHIN == 0.10


def test_the_count_within_10_and_5_percent_cannot_fall(rows):
    assert len(rows) == 77
    assert reproduce.within(rows, 0.10) >= WITHIN_10_FLOOR
    assert reproduce.within(rows, 0.05) >= WITHIN_5_FLOOR
    assert reproduce.within(rows, 0.10) >= 52  # the bar


@pytest.mark.parametrize("figure, minimum", [("Fig. 8a", 3), ("Fig. 8b", 6), ("Fig. 9a", 4), ("Fig. 9b", 2)])
def test_training_figures_are_in_the_count(rows, figure, minimum):
    assert sum(r.ok for r in rows if r.figure == figure) >= minimum


def test_row_error_for_bands():
    r = reproduce.Row("x", "y", 5.0, (3.0, 4.0), 0.2)
    assert round(r.error, 3) == 0.25 and not r.ok
    assert reproduce.Row("x", "y", 3.5, (3.0, 4.0), 0.0).ok


def test_cli_paper_table(capsys, tmp_path):
    png = tmp_path / "fig7.png"
    png9 = tmp_path / "fig9.png"
    assert cli.main(["simulate", "paper", "--plot", str(png), "--plot-training", str(png9)]) == 0
    out = capsys.readouterr().out
    assert "65 of 77 within 10%, 58 within 5%" in out
    assert "worst rows:" in out and out.count("NCCL's cliff") >= 2
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert png9.read_bytes()[:4] == b"\x89PNG"
