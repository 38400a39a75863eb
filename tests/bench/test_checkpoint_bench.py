"""fireflyer bench checkpoint: flags, and a tiny run that fills every field (timings are not checked)."""

from __future__ import annotations

import json

import pytest

from fireflyer.bench import checkpoint as bench
from fireflyer.errors import UserError


@pytest.mark.parametrize("argv,needle", [(["--gb", "0"], "--gb"), (["--threads", "0"], "--threads"),
                                         (["--dir", "/no/such/dir"], "not a directory")])
def test_bad_flags(argv, needle):
    with pytest.raises(UserError, match=needle):
        bench.build_config(argv)


def test_state_has_the_asked_size_and_mixed_tensors():
    state = bench.make_state(200 << 20)
    assert abs(bench.state_bytes(state) - (200 << 20)) < 1 << 20
    dtypes = {t.dtype for part in ("model", "optimizer") for t in state[part].values()}
    assert len(dtypes) == 2 and len(state["model"]) + len(state["optimizer"]) > 5


def test_a_tiny_run_writes_json_and_png(tmp_path):
    out = tmp_path / "out"
    assert bench.main(["--gb", "0.02", "--rounds", "1", "--dir", str(tmp_path), "--out", str(out)]) == 0
    doc = json.loads((out / "checkpoint.json").read_text())
    for key in ("stall_s", "sync_save_s", "persist_gbps", "load_gbps", "stall_fraction_of_sync",
                "persist_fraction_of_disk", "stall_if_step_at_once_s"):
        assert doc[key] > 0
    assert (out / "checkpoint.png").read_bytes()[:4] == b"\x89PNG"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the scratch directory is gone
