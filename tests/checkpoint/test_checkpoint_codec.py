"""The skeleton's JSON format: every supported value comes back exactly, types and all."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fireflyer.checkpoint import CheckpointManager, CorruptCheckpoint, codec, rng_state
from fireflyer.checkpoint.codec import TensorRef


def _same(a, b) -> bool:
    """Equal and of the same types all the way down (nan equals nan, -0.0 is not 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


keys = st.one_of(st.text(max_size=8), st.integers(), st.tuples(st.integers(), st.text(max_size=3)), st.none(),
                 st.booleans(), st.sampled_from(["$int", "$tensor", "$dict"]))
leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(1 << 300), max_value=1 << 300),
    st.floats(allow_nan=True, allow_infinity=True), st.text(), st.binary(max_size=32),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn]),
    st.lists(st.integers(0, 9), max_size=4).map(torch.Size),
    st.sampled_from([torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")]),
    st.text(min_size=1, max_size=10).map(TensorRef),
    st.sampled_from([np.float64(0.1), np.float32(-0.0), np.int64(-7), np.uint32(4_000_000_000), np.bool_(True),
                     np.complex128(1 + 2j), np.float16(np.inf)]),
    st.lists(st.integers(0, 2**32 - 1), max_size=6).map(lambda x: np.array(x, dtype=np.uint32)),
    st.lists(st.floats(allow_nan=True), max_size=6).map(lambda x: np.array(x, dtype=">f8").reshape(-1, 1)),
    st.frozensets(st.integers(), max_size=4),
)
values = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.tuples(inner, inner), st.lists(inner, max_size=3).map(tuple),
    st.dictionaries(keys, inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=4),
    st.sets(st.integers(), max_size=4),
), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(values)
def test_every_supported_value_round_trips_exactly(value):
    assert _same(codec.loads(codec.dumps(value)), value)


def test_a_training_state_round_trips_through_the_manager(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW([{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias]}],
                            lr=1e-3, betas=(0.9, 0.95), foreach=True)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    random.seed(5), np.random.seed(5)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "rng": rng_state(), "step": 7, "history": {"loss": [2.5, float("nan")], "val": [(1, 2.0)]},
             "config": {"lr": 1e-3, "betas": (0.9, 0.95), "layers": None}, "big": 3 ** 90,
             "shape": torch.Size([3, 4]), "dtype": torch.bfloat16, "blob": b"\x00\xff"}
    CheckpointManager(tmp_path, rank=0, world_size=1).save(1, state, blocking=True)
    back = CheckpointManager(tmp_path, rank=0, world_size=1).load()
    for k in state:
        if k not in ("model", "optimizer"):
            assert _same(back[k], state[k]), k
    assert list(back["optimizer"]["state"]) == [0, 1]  # int keys stay int
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
    sched.load_state_dict(back["scheduler"])
    opt.load_state_dict(back["optimizer"])


@pytest.mark.parametrize("doc,needle", [
    (b"not json", "not a skeleton document"),
    (b'{"format": "fireflyer.skeleton", "version": 2, "value": 1}', "version 2"),
    (b'{"format": "fireflyer.skeleton", "version": 1, "value": {"$exec": "x"}}', "unknown tag '\\$exec'"),
    (b'{"format": "fireflyer.skeleton", "version": 1, "value": {"$dtype": "manual_seed"}}', "not a torch dtype"),
    (b'{"format": "fireflyer.skeleton", "version": 1, "value": {"$ndarray": {"dtype": "O", "shape": [1], '
     b'"data": ""}}}', "not a plain number type"),
    (b'{"format": "fireflyer.skeleton", "version": 1, "value": NaN}', "not a skeleton document"),
    (b'{"format": "fireflyer.skeleton", "version": 1, "value": {"$dict": [[[1], 2]]}}', "malformed"),
])
def test_a_malformed_skeleton_is_corrupt(doc, needle):
    with pytest.raises(CorruptCheckpoint, match=needle):
        codec.loads(doc)


@pytest.mark.parametrize("value,needle", [
    ({"a": [1, {"b": object()}]}, "'a/1/b' is a builtins.object"),
    ({"f": len}, "'f' is a builtins.builtin_function_or_method"),
    ({"arr": np.array([object()])}, "'arr' is a numpy.ndarray"),
    ({"s": {1: {"x": 1j}}}, "'s/1/x' is a builtins.complex"),
])
def test_what_the_format_cannot_hold_fails_naming_the_path(value, needle):
    with pytest.raises(TypeError, match=needle):
        codec.dumps(value)
