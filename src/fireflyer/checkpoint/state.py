"""A training state split into tensors (for the shard file) and a skeleton (everything else).

``state`` is any nest of dicts, lists and tuples: model and optimizer state dicts, an LR
scheduler's, a GradScaler's, RNG states, a data-loader position, a user dict. Every
tensor in it becomes a named entry (its path, e.g. ``model/blocks.0.fc.weight``); the
rest of the structure, with a placeholder where each tensor was, is pickled as the
skeleton. Objects with ``state_dict()`` (modules, optimizers, schedulers) are saved
through it, so the state can be passed as it is.
"""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor stood in the skeleton: its entry name."""

    name: str


def flatten(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(skeleton, tensors by name). Tensors are returned as they are (no copy)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided:
                raise TypeError(f"checkpoint entry {path!r} is a {obj.layout} tensor; only dense tensors are supported")
            name = path or "tensor"
            if name in tensors:
                raise ValueError(f"two tensors would share the checkpoint name {name!r}; rename a key")
            tensors[name] = obj.detach()
            return TensorRef(name)
        if hasattr(obj, "state_dict") and callable(obj.state_dict) and not isinstance(obj, type):
            return walk(obj.state_dict(), path)
        if isinstance(obj, dict):
            return {k: walk(v, f"{path}/{k}" if path else str(k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [walk(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return obj

    return walk(state, ""), tensors


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state again, with each placeholder replaced by its tensor."""
    def walk(obj: Any) -> Any:
        if isinstance(obj, TensorRef):
            return tensors[obj.name]
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(walk(v) for v in obj)
        return obj

    return walk(skeleton)


def dumps_skeleton(skeleton: Any) -> bytes:
    try:
        return pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"the checkpoint state holds something that cannot be saved: {exc}") from None


def loads_skeleton(data: bytes) -> Any:
    return pickle.loads(data)  # noqa: S301 - our own file, checksummed before this runs


def rng_state() -> dict[str, Any]:
    """Every random generator a training loop touches: python, numpy, torch CPU and CUDA."""
    out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        out["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (CUDA only where the device count matches)."""
    if "python" in state:
        random.setstate(state["python"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
