"""`fireflyer bench allreduce --quick` and `fireflyer bench alltoall --quick` end to end: real ranks,
one small size, the table on stdout and the JSON and PNG where asked. No timing asserts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc


def fireflyer(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fireflyer.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def busy_loops() -> set[int]:
    """The pids of processes running ``--busy``'s loop."""
    found = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if b"while True: pass" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.add(int(pid))
            except OSError:
                continue
    return found


@pytest.mark.timeout(180)
def test_allreduce_quick_prints_each_sizes_path(tmp_path):
    out_json, out_png = tmp_path / "ar.json", tmp_path / "ar.png"
    done = fireflyer("bench", "allreduce", "--quick", "--layouts", "1x4", "--systems", "hfreduce,gloo",
                     "--dtypes", "fp32", "--sizes", "4K,1M", "--floor-ops", "50", "--timeout", "60",
                     "--json", str(out_json), "--png", str(out_png))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "hfreduce thresholds: one-shot up to" in done.stdout
    assert "one-shot" in done.stdout and "pipeline" in done.stdout and "traffic" in done.stdout
    doc = json.loads(out_json.read_text())
    rows = {r["bytes"]: r for r in doc["rows"]}
    assert rows[4096]["path"] == "one-shot" and rows[1 << 20]["path"] == "pipeline"
    assert rows[4096]["floor_x"] == 8 and rows[4096]["traffic_x"] > 8
    assert doc["config"]["thresholds"]["oneshot_bytes"] > 0
    assert all(r["candidate"]["wrong"] == 0 and r["gloo"]["wrong"] == 0 for r in doc["rows"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(180)
def test_alltoall_quick_on_a_busy_host(tmp_path):
    out_json, out_png = tmp_path / "a2a.json", tmp_path / "a2a.png"
    before = busy_loops()
    done = fireflyer("bench", "alltoall", "--quick", "--layouts", "1x4", "--sizes", "64K", "--timeout", "60",
                     "--busy", "1", "--json", str(out_json), "--png", str(out_png))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all_to_all_single fp32" in done.stdout and "64K" in done.stdout
    assert "a busy host: 1 CPU-bound process beside the ranks (--busy 1)" in done.stdout
    assert busy_loops() == before  # the busy process ended with the run
    doc = json.loads(out_json.read_text())
    assert doc["config"]["busy"] == 1
    (row,) = doc["rows"]
    assert row["bytes"] == 64 << 10 and row["candidate"]["ops"] == 5 and row["gloo"]["ops"] == 5
    assert row["candidate"]["wrong"] == 0 and row["gloo"]["wrong"] == 0
    assert row["speedup"]["gloo"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
