"""The C++ door (``backend/door.cpp``): the same bits, records and errors as the Python door, and a clear
fallback where it cannot be built.

The rest of the suite goes through the C++ door wherever it applies (it is the default), the
fault matrix of ``test_torch_faults.py`` included; these tests pin what is the door's own.
"""

from __future__ import annotations

import fcntl
import logging

import pytest

from fireflyer.errors import UserError
from fireflyer.hfreduce.backend import cpp_door
from fireflyer.hfreduce.config import HFReduceConfig
from fireflyer.testing.cases.cpp_door import every_allreduce, late_peer, unbuildable_door
from fireflyer.testing.cluster import LocalCluster

ENV = {"FIREFLYER_TEST_COMM": "0", "OMP_NUM_THREADS": "1"}


def _run(door: str, layout: list[int], fn, *args):
    with LocalCluster(layout, env={**ENV, "FIREFLYER_HFREDUCE_DOOR": door}) as cluster:
        return cluster.run(fn, *args, timeout=240)


@pytest.mark.multiproc
@pytest.mark.skipif(cpp_door.built() is None, reason="the C++ door is not built here (no C++ compiler at install)")
@pytest.mark.parametrize("layout", [[4], [2]], ids=["1x4", "1x2"])
def test_the_cpp_door_gives_the_python_doors_bits_for_every_dtype_op_and_shape(layout):
    cpp = _run("cpp", layout, every_allreduce, "cpp")
    python = _run("python", layout, every_allreduce, "python")
    for rank, (c, p) in enumerate(zip(cpp, python)):
        assert c["door"] == "cpp" and p["door"] == "python", rank
        assert p["calls"] == 0 and c["calls"] >= c["cases"] + 1, (rank, c["calls"], c["cases"])
        assert c["digests"] == p["digests"], rank
    # and every rank holds the same result
    assert all(r["digests"] == cpp[0]["digests"] for r in cpp)
    world = len(cpp)
    assert cpp[0]["digests"]["per-call-timeout"] == [world * (world + 1) / 2] * 5
    assert cpp[0]["digests"]["async"] == [float(world)] * 3


@pytest.mark.multiproc
@pytest.mark.skipif(cpp_door.built() is None, reason="the C++ door is not built here (no C++ compiler at install)")
def test_a_per_call_timeout_through_the_cpp_door_raises_the_named_error_and_the_group_stays_failed():
    results = _run("cpp", [3], late_peer, "late", 2, 1.0)
    for r in results[:2]:
        assert r["door"] == "cpp"
        assert r["error"] is not None and "CollectiveTimeout" in r["error"], r
        assert "rank 2" in r["error"], r["error"]
        assert r["took"] < 30, "a 1 s timeout must not wait for the group's default"
        assert r["again"] is not None and r["again"].split(":")[0] == r["error"].split(":")[0], r
        # The flight record: the first allreduce completed in the door's own ledger, the timed-out one moved to
        # the recorder and failed there, and nothing is left in flight.
        first, failed = r["records"][0], r["records"][1]
        assert first["state"] == "completed" and first["error"] is None, r["records"]
        assert failed["error"] is not None and failed["time_failed_ns"] is not None, r["records"]
        assert failed["record_id"] > first["record_id"]
        assert r["in_flight"] == 0 and r["settled"] >= 2, r


def test_the_choice_of_door_is_range_checked(monkeypatch):
    monkeypatch.setenv("FIREFLYER_HFREDUCE_DOOR", "rust")
    with pytest.raises(UserError, match="choose cpp or python"):
        HFReduceConfig.from_env()
    with pytest.raises(UserError, match="choose cpp or python"):
        HFReduceConfig(door="rust")
    monkeypatch.setenv("FIREFLYER_HFREDUCE_DOOR", "python")
    assert HFReduceConfig.from_env().door == "python"


@pytest.mark.multiproc
def test_a_group_whose_door_does_not_build_works_through_the_python_door_after_one_line(tmp_path):
    results = _run("cpp", [2], unbuildable_door, "unbuildable", str(tmp_path))
    for r in results:
        assert r["door"] == "python" and r["calls"] == 0, r
        assert r["sum"] == [4.0] * 8, r
        assert len(r["warnings"]) == 1 and "using the Python door" in r["warnings"][0], r["warnings"]


def test_a_door_that_does_not_build_leaves_the_python_door_with_one_warning_line(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "door.cpp"
    broken.write_text('#include "no_such_header_anywhere.h"\n')
    monkeypatch.setattr(cpp_door, "SOURCE", broken)
    monkeypatch.setattr(cpp_door, "ROOT", tmp_path / "built")
    monkeypatch.setenv("FIREFLYER_HFREDUCE_DOOR", "cpp")
    monkeypatch.setattr(cpp_door, "_loaded", {})
    monkeypatch.setattr(cpp_door, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="fireflyer.hfreduce"):
        assert cpp_door.load() is None
        assert cpp_door.load() is None  # remembered: no second build, no second line
    lines = [r.getMessage() for r in caplog.records if "C++ door" in r.getMessage()]
    assert len(lines) == 1 and "using the Python door" in lines[0] and "\n" not in lines[0], lines
    assert cpp_door.main([]) == 1  # the install step says so in one line and goes on


def test_a_build_waits_for_the_lock_only_as_long_as_its_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(cpp_door, "ROOT", tmp_path)
    with open(tmp_path / f"{cpp_door.name()}.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(TimeoutError, match="build lock"):
            cpp_door.build(timeout=0.5)


def test_the_built_door_is_keyed_by_its_sources_and_torch(tmp_path, monkeypatch):
    first = cpp_door.name()
    changed = tmp_path / "door.cpp"
    changed.write_text(cpp_door.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(cpp_door, "SOURCE", changed)
    assert cpp_door.name() != first and cpp_door.name().startswith("hfreduce_door_")
