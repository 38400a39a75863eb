"""Checkpoints are data, never code: no pickle runs, no name read from disk leaves the step directory."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import os
import pickle
import subprocess
import sys
import zlib

import pytest
import torch

from fireflyer.checkpoint import (
    AllowlistUnpickler,
    CheckpointError,
    CheckpointManager,
    CorruptCheckpoint,
    NoCheckpoint,
    UnsafeCheckpoint,
    allow,
    disallow,
)
from fireflyer.checkpoint import codec
from fireflyer.checkpoint.manager import step_dir
from fireflyer.storage.backends.memory import MemoryBackend


class Evil:
    """What the security review wrote: unpickling it runs a shell command."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@dataclasses.dataclass
class LoaderPosition:  # a user object that is not plain data
    epoch: int
    index: int


def _edit(d: str, change) -> None:
    """Change a committed step's manifest with ``change(manifest)`` and re-seal it, as an attacker can."""
    with open(os.path.join(d, "manifest.json")) as f:
        manifest = json.load(f)
    change(manifest)
    raw = json.dumps(manifest).encode()
    with open(os.path.join(d, "manifest.json"), "wb") as f:
        f.write(raw)
    with open(os.path.join(d, "COMMIT")) as f:
        commit = json.load(f)
    commit["manifest_sha256"] = hashlib.sha256(raw).hexdigest()
    with open(os.path.join(d, "COMMIT"), "w") as f:
        json.dump(commit, f)


def _plant_skeleton(d: str, name: str, blob: bytes, *, legacy: bool) -> None:
    """Write ``blob`` as the skeleton named ``name``, fix its CRC in the part and the manifest, re-seal."""
    with open(os.path.join(d, name), "wb") as f:
        f.write(blob)

    def change(manifest):
        if legacy:  # the format an older fireflyer wrote: no "format" key, a pickled rank00000.skeleton
            manifest.pop("format")
        manifest["parts"][0]["skeleton"] = {"file": name, "crc32": zlib.crc32(blob), "bytes": len(blob)}
    _edit(d, change)


def _saved(tmp_path, state=None) -> tuple[CheckpointManager, str]:
    mgr = CheckpointManager(tmp_path / "ckpt", rank=0, world_size=1)
    mgr.save(1, state or {"w": torch.ones(4), "step": 1}, blocking=True)
    return mgr, step_dir(str(tmp_path / "ckpt"), 1)


# ---------------------------------------------------------------- the crafted pickle
def test_the_crafted_pickle_checkpoint_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    mgr, d = _saved(tmp_path)
    _plant_skeleton(d, "rank00000.skeleton", pickle.dumps(Evil(str(marker))), legacy=True)
    with pytest.raises(UnsafeCheckpoint, match="older fireflyer.*would unpickle.*allow_pickle=True"):
        mgr.load()
    # Even with the opt-in, the allowlisting unpickler refuses os.system, naming it.
    opted = CheckpointManager(tmp_path / "ckpt", rank=0, world_size=1, allow_pickle=True)
    with pytest.raises(UnsafeCheckpoint, match=r"posix\.system, which is not allowlisted"):
        opted.load()
    assert not marker.exists()


def test_a_pickle_in_place_of_the_json_skeleton_is_corrupt_not_code(tmp_path):
    marker = tmp_path / "pwned"
    mgr, d = _saved(tmp_path)
    _plant_skeleton(d, "rank00000.skeleton.json", pickle.dumps(Evil(str(marker))), legacy=False)
    with pytest.raises(CorruptCheckpoint, match="not a skeleton document"):
        mgr.load(step=1)
    with pytest.warns(UserWarning, match="damaged"), pytest.raises(NoCheckpoint):
        mgr.load()
    # ... and smuggled inside the JSON as an allowlisted-pickle value
    doc = {"format": codec.FORMAT, "version": codec.VERSION,
           "value": {"$pickle": base64.b64encode(pickle.dumps(Evil(str(marker)))).decode()}}
    _plant_skeleton(d, "rank00000.skeleton.json", json.dumps(doc).encode(), legacy=False)
    with pytest.raises(UnsafeCheckpoint, match=r"posix\.system"):
        mgr.load()
    assert not marker.exists()


def test_resume_from_the_crafted_checkpoint_is_one_line_and_non_zero(tmp_path):
    marker = tmp_path / "pwned"
    _, d = _saved(tmp_path)  # tmp_path/ckpt is the out directory's checkpoint folder
    _plant_skeleton(d, "rank00000.skeleton", pickle.dumps(Evil(str(marker))), legacy=True)
    r = subprocess.run([sys.executable, "-m", "fireflyer.cli", "train", "--out", str(tmp_path), "--resume"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "older fireflyer" in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert not marker.exists()


def test_a_legacy_pickle_of_plain_data_loads_only_with_the_opt_in(tmp_path):
    import numpy as np

    from fireflyer.checkpoint.state import flatten

    rng = np.random.RandomState(3).get_state()
    mgr, d = _saved(tmp_path)
    skeleton, _ = flatten({"w": torch.ones(4), "step": 1, "rng": rng, "shape": torch.Size([4]), "dt": torch.float16})
    _plant_skeleton(d, "rank00000.skeleton", pickle.dumps(skeleton), legacy=True)
    with pytest.raises(UnsafeCheckpoint):
        mgr.load()
    state = CheckpointManager(tmp_path / "ckpt", rank=0, world_size=1, allow_pickle=True).load()
    assert torch.equal(state["w"], torch.ones(4)) and state["step"] == 1 and state["dt"] is torch.float16
    assert state["rng"][0] == "MT19937" and np.array_equal(state["rng"][1], rng[1])


def test_a_newer_manifest_format_is_refused(tmp_path):
    mgr, d = _saved(tmp_path)
    _edit(d, lambda m: m.update(format=99))
    with pytest.raises(CheckpointError, match="manifest format 99.*newer"):
        mgr.load()


# ---------------------------------------------------------------- names from disk
@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/b", "..", "", "a\x00b", "x" * 300])
@pytest.mark.parametrize("field", ["file", "skeleton"])
def test_a_name_outside_the_step_directory_is_refused(tmp_path, monkeypatch, name, field):
    mgr, d = _saved(tmp_path)
    (tmp_path / "x").write_bytes(b"outside")

    def change(manifest):
        part = manifest["parts"][0]
        if field == "file":
            part["file"] = name
        else:
            part["skeleton"]["file"] = name
    _edit(d, change)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(os.fspath(path)) or real_open(path, *a, **k))
    with pytest.raises(CorruptCheckpoint, match=f"part 0 '{'file' if field == 'file' else 'skeleton.file'}' "
                                                "is .* not a plain file name"):
        mgr.load(step=1)
    assert opened and all(os.path.dirname(p) == d for p in opened), opened


def test_a_backend_key_outside_the_step_is_never_downloaded(tmp_path):
    store = MemoryBackend()
    CheckpointManager(tmp_path / "a", rank=0, world_size=1, backend=store).save(1, {"w": torch.ones(3)},
                                                                                 blocking=True)
    store.objects["step_0000000001/../../escaped"] = b"attacker"
    with pytest.warns(UserWarning, match="not a plain file name"), pytest.raises(NoCheckpoint):
        CheckpointManager(tmp_path / "b" / "c", rank=0, world_size=1, backend=store).load()
    assert not any(p.name == "escaped" for p in tmp_path.rglob("*"))


def test_a_malformed_tensor_entry_is_corrupt(tmp_path):
    mgr, d = _saved(tmp_path)
    _edit(d, lambda m: m["parts"][0]["entries"]["w"].update(offset=-8))
    with pytest.raises(CorruptCheckpoint, match="does not describe a tensor"):
        mgr.load(step=1)


# ---------------------------------------------------------------- the allowlist
def test_a_user_object_fails_the_save_naming_its_path_and_class(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    with pytest.raises(TypeError, match=r"'data/pos' is a test_checkpoint_safety\.LoaderPosition.*allow"):
        mgr.save(1, {"data": {"pos": LoaderPosition(1, 2)}})
    assert mgr.latest() is None


def test_an_allowlisted_class_round_trips_and_is_refused_elsewhere(tmp_path):
    state = {"pos": LoaderPosition(3, 40), "w": torch.zeros(2)}
    CheckpointManager(tmp_path, rank=0, world_size=1, allowed_classes=[LoaderPosition]).save(1, state, blocking=True)
    assert CheckpointManager(tmp_path, rank=0, world_size=1,
                             allowed_classes=[LoaderPosition]).load()["pos"] == LoaderPosition(3, 40)
    with pytest.raises(UnsafeCheckpoint, match=r"test_checkpoint_safety\.LoaderPosition, which is not allowlisted"):
        CheckpointManager(tmp_path, rank=0, world_size=1).load()
    allow(LoaderPosition)
    try:
        assert CheckpointManager(tmp_path, rank=0, world_size=1).load()["pos"] == LoaderPosition(3, 40)
    finally:
        disallow(LoaderPosition)


def test_the_unpickler_names_what_it_refuses():
    blob = pickle.dumps(LoaderPosition(1, 2))
    with pytest.raises(UnsafeCheckpoint, match=r"LoaderPosition, which is not allowlisted.*allowed_classes"):
        AllowlistUnpickler(io.BytesIO(blob), frozenset()).load()
    ok = AllowlistUnpickler(io.BytesIO(blob), frozenset({(LoaderPosition.__module__, "LoaderPosition")})).load()
    assert ok == LoaderPosition(1, 2)
    with pytest.raises(UnsafeCheckpoint, match=r"builtins\.eval"):
        AllowlistUnpickler(io.BytesIO(pickle.dumps(eval)), frozenset()).load()


def test_an_allowlisted_object_holding_another_class_fails_at_save(tmp_path):
    @dataclasses.dataclass
    class Box:  # noqa: not importable, so not allowlistable either
        inner: object

    with pytest.raises(TypeError, match=r"'p' refers to posix\.system"):
        CheckpointManager(tmp_path, rank=0, world_size=1, allowed_classes=[LoaderPosition]).save(
            1, {"p": LoaderPosition(1, Evil("x"))})
    with pytest.raises(TypeError, match="cannot be allowlisted"):
        CheckpointManager(tmp_path, rank=0, world_size=1, allowed_classes=[Box])
