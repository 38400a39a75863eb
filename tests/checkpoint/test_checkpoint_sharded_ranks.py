"""Sharded-expert checkpoints (kind="sharded") on real ranks (2 emulated nodes x 2), loaded on other world sizes.

EP groups {0, 1} and {2, 3}: rank r holds the experts of EP rank r % 2, so ranks {0, 2} hold experts
0-3 and ranks {1, 3} experts 4-7; the dense tensors are on every rank, ``own/rankR`` on rank R only.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from fireflyer.checkpoint import CheckpointManager, CorruptCheckpoint
from fireflyer.testing.cases import ckpt_sharded as cases
from fireflyer.testing.cluster import LocalCluster

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster([2, 2], env={"FIREFLYER_TEST_COMM": "0"}) as c:
        yield c


def _global_state() -> dict:
    """The union of what the four ranks hold."""
    out = cases.held_state(0)
    for r in range(1, 4):
        held = cases.held_state(r)
        out["model"].update(held["model"])
        out["own"].update(held["own"])
    return out


def test_each_tensor_is_written_once_by_a_holder_and_the_union_loads_anywhere(cluster, tmp_path):
    assert cluster.run(cases.save_held, str(tmp_path)) == [True] * 4
    step = tmp_path / "step_0000000003"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["kind"] == "sharded" and manifest["world_size"] == 4
    written = {name: part["rank"] for part in manifest["parts"] for name in part["entries"]}
    assert sum(len(p["entries"]) for p in manifest["parts"]) == len(written)  # nothing written twice
    want = _global_state()
    assert sorted(written) == sorted([f"model/{k}" for k in want["model"]] + [f"own/{k}" for k in want["own"]])
    for name, rank in written.items():
        if name.startswith("own/rank"):
            assert rank == int(name[len("own/rank"):])  # the only holder
        elif "/experts." in name:
            expert = int(name.split(".")[1])
            assert rank in ((0, 2) if expert < 4 else (1, 3)), (name, rank)  # one of its two replicas
    assert all(p["entries"] for p in manifest["parts"])  # every rank wrote a share
    assert sum("skeleton" in p for p in manifest["parts"]) == 1  # one merged skeleton, rank 0's
    for world, rank in ((1, 0), (2, 1), (3, 2)):  # other world sizes read the whole global state
        got = CheckpointManager(tmp_path, kind="sharded", rank=rank, world_size=world).load()
        assert got["step"] == 7 and got["layout"] == {"ep": 2, "experts": 8}
        assert list(got["model"]) == list(want["model"])  # rank 0's keys first, then the others' new ones
        for k, v in want["model"].items():
            assert torch.equal(got["model"][k], v), k
        assert {k: v.tolist() for k, v in got["own"].items()} == {k: v.tolist() for k, v in want["own"].items()}
    # an EP=4 layout on 4 ranks takes its slice: rank 3 holds experts 6 and 7
    for e in (6, 7):
        assert torch.equal(got["model"][f"experts.{e}.w1"], cases.expert_tensor(e))


def test_conflicting_shapes_or_values_fail_the_save_on_every_rank(cluster, tmp_path):
    for msg in cluster.run(cases.conflicting, str(tmp_path / "shape"), "shape"):
        assert "'model/experts.5.w1' is held with different shapes" in msg, msg
        assert "rank 1 has F32 (16, 8), rank 3 has F32 (8, 16)" in msg, msg
    for msg in cluster.run(cases.conflicting, str(tmp_path / "value"), "value"):
        assert "differs between ranks at 'step'" in msg and "rank 2 has 8" in msg, msg
    assert not (tmp_path / "shape" / "step_0000000001").exists()  # nothing was written


def test_a_sharded_expert_checkpoint_resumes_bitwise_and_falls_back_when_damaged(cluster, tmp_path):
    results = cluster.run(cases.resume_matches, str(tmp_path))
    for r in results:
        assert r["step"] == 4 and r["moved"] and r["bitwise"], {k: r[k] for k in ("step", "moved", "bitwise")}
        assert r["global_names"] == sorted(
            [f"dense.{p}" for p in ("weight", "bias")] + [f"experts.{e}.{p}" for e in range(4) for p in ("weight", "bias")])
    # a 2-rank layout (EP=2, one replica) loads the same step and takes its slice, bitwise
    for rank in (0, 1):
        saved = CheckpointManager(tmp_path, kind="sharded", rank=rank, world_size=2).load()["model"]
        for holder in (rank, rank + 2):  # the replicas it replaces
            for name, value in results[holder]["at_save"].items():
                assert torch.equal(saved[name], value), name

    # flip one byte inside an expert tensor of step 4: load() names it and falls back to step 2
    step = tmp_path / "step_0000000004"
    manifest = json.loads((step / "manifest.json").read_text())
    part, name = next((p, n) for p in manifest["parts"] for n in p["entries"] if "/experts." in n)
    path = step / part["file"]
    with open(path, "r+b") as f:
        f.seek(part["entries"][name]["offset"])
        byte = f.read(1)
        f.seek(part["entries"][name]["offset"])
        f.write(bytes([byte[0] ^ 0x40]))
    mgr = CheckpointManager(tmp_path, kind="sharded", rank=0, world_size=1)
    with pytest.warns(UserWarning, match="step 4 is damaged"):
        assert mgr.load()["step"] == 2
    with pytest.raises(CorruptCheckpoint, match="fails its checksum"):
        mgr.load(4)
    assert os.path.exists(step / "COMMIT")  # loading never deletes: the damaged step is left for a person


def test_ranks_skip_together_and_fail_together(cluster, tmp_path):
    results = cluster.run(cases.skip_and_fail_together, str(tmp_path))
    for rank, r in enumerate(results):
        assert (r["first"], r["while_busy"], r["after"]) == (True, False, True), (rank, r)
        assert r["latest"] == 3, (rank, r)  # step 4 never committed, step 5 never started
    assert "no space left on device" in results[2]["next"]  # its own failure
    assert "did not finish its part of step 4" in results[0]["next"]  # rank 0 could not commit
    for rank in (1, 3):
        assert "rank 0's previous checkpoint save failed" in results[rank]["next"], results[rank]
        assert "no rank started this one" in results[rank]["next"]
