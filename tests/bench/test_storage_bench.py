"""``fireflyer bench storage`` on a tiny config: it runs, checks bytes, writes JSON and PNG (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from fireflyer.cli import main as cli_main


def test_tiny_run_writes_json_and_png(tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli_main(["bench", "storage", "--samples", "64", "--reads", "128", "--batch", "16", "--trace-len", "40",
                   "--shard-kb", "8", "--latency-ms", "0.5", "--compute-ms", "0", "--distances", "2",
                   "--dir", str(tmp_path), "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "storage.json").read_text())
    assert {(r["layout"], r["threads"], r["cache"]) for r in doc["random_reads"]} == {
        (lay, t, c) for lay in ("records", "files", "memmap") for t in (1, 4) for c in ("warm", "cold")}
    assert all(r["samples_per_s"] > 0 for r in doc["random_reads"])
    assert [r["prefetch_distance"] for r in doc["shard_cache"]] == [0, 2]
    assert sum(doc["shard_cache"][0]["hits"][k] for k in ("dram", "ssd", "backend")) == 40
    assert (out / "storage.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("fireflyer-storage-bench-")]  # scratch removed


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--threads", "a"], ["--samples", "0"], ["--dir", "/nonexistent"],
                                  ["--backend-mbps", "0"]])
def test_bad_flags(argv, capsys):
    assert cli_main(["bench", "storage", *argv]) == 2
    assert "error" in capsys.readouterr().err
