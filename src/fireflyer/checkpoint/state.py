"""A training state split into tensors (for the shard file) and a skeleton (everything else).

``state`` is any nest of dicts, lists and tuples: model and optimizer state dicts, an LR
scheduler's, a GradScaler's, RNG states, a data-loader position, a user dict. Every
tensor in it becomes a named entry (its path, e.g. ``model/blocks.0.fc.weight``); the
rest of the structure, with a placeholder where each tensor was, is the skeleton, which
is saved as data (JSON with tagged values, :mod:`fireflyer.checkpoint.codec`), never as
a pickle. Objects with ``state_dict()`` (modules, optimizers, schedulers) are saved
through it, so the state can be passed as it is. A DTensor (an FSDP2 parameter or its
optimizer state) is saved as this rank's local shard, so an FSDP model is saved with
``kind="per_rank"`` and loaded back with :func:`load_into`.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from fireflyer.checkpoint import codec
from fireflyer.checkpoint.codec import TensorRef
from fireflyer.errors import UserError, UserTypeError

__all__ = ["TensorRef", "dumps_skeleton", "flatten", "load_into", "loads_skeleton", "rng_state", "set_rng_state",
           "unflatten"]


def flatten(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(skeleton, tensors by name). Tensors are returned as they are (no copy)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            local = getattr(obj, "to_local", None)
            if callable(local):  # a DTensor (FSDP2): this rank's shard is what it saves (kind="per_rank")
                obj = local()
            if obj.layout != torch.strided:
                raise UserTypeError(f"checkpoint entry {path!r} is a {obj.layout} tensor; only dense tensors are supported")
            name = path or "tensor"
            if name in tensors:
                raise UserError(f"two tensors would share the checkpoint name {name!r}; rename a key")
            tensors[name] = obj.detach()
            return TensorRef(name)
        if hasattr(obj, "state_dict") and callable(obj.state_dict) and not isinstance(obj, type):
            return walk(obj.state_dict(), path)
        if isinstance(obj, torch.Size):
            return obj
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
        if type(obj) is tuple:
            return tuple(walk(v) for v in obj)
        return obj

    return walk(skeleton)


def load_into(target: Any, saved: Any) -> None:
    """Put a loaded state back into live objects in place.

    Modules: every parameter and buffer gets its saved value (for a DTensor, its local
    shard). Optimizers: ``load_state_dict``, with saved shards turned back into DTensors
    shaped like their parameters. Anything else: tensors in a nest of dicts and lists are
    copied into. This is what an FSDP2 model needs, since ``load_state_dict`` with plain
    tensors does not fit DTensor parameters; it works for ordinary models too.
    """
    if isinstance(target, torch.optim.Optimizer):
        target.load_state_dict(_optimizer_state(target, saved))
    elif isinstance(target, torch.nn.Module):
        _copy_tree(target.state_dict(), saved, type(target).__name__)
    else:
        _copy_tree(target, saved, "state")


def _optimizer_state(opt: torch.optim.Optimizer, saved: dict) -> dict:
    params = [p for group in opt.param_groups for p in group["params"]]
    state = {}
    for idx, entry in saved.get("state", {}).items():
        p = params[int(idx)] if int(idx) < len(params) else None
        mesh = getattr(p, "device_mesh", None)
        if mesh is None:
            state[idx] = entry
            continue
        from torch.distributed.tensor import DTensor

        local_shape = p.to_local().shape
        state[idx] = {k: DTensor.from_local(v.to(p.device), mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
                      if isinstance(v, torch.Tensor) and v.shape == local_shape and v.dim() > 0 else v
                      for k, v in entry.items()}
    return {"state": state, "param_groups": saved["param_groups"]}


def _copy_tree(live: Any, saved: Any, path: str) -> None:
    if isinstance(live, torch.Tensor):
        dst = live.to_local() if callable(getattr(live, "to_local", None)) else live
        if not isinstance(saved, torch.Tensor) or saved.shape != dst.shape:
            raise UserError(f"checkpoint entry {path!r} has shape {tuple(getattr(saved, 'shape', ()))} but the live "
                             f"tensor (its shard) has {tuple(dst.shape)}; was it saved with another world size or model?")
        with torch.no_grad():
            dst.copy_(saved)
    elif isinstance(live, dict):
        if not isinstance(saved, dict) or set(live) - set(saved):
            raise UserError(f"checkpoint entry {path!r} lacks "
                             f"{sorted(map(str, set(live) - set(saved or {})))[:5]} that the live object has")
        for k in live:
            _copy_tree(live[k], saved[k], f"{path}/{k}")
    elif isinstance(live, (list, tuple)):
        for i, (a, b) in enumerate(zip(live, saved)):
            _copy_tree(a, b, f"{path}/{i}")


def dumps_skeleton(skeleton: Any, allow: frozenset[tuple[str, str]] = frozenset()) -> bytes:
    """The skeleton as a JSON document; TypeError naming the key path of a value that is not data."""
    return codec.dumps(skeleton, allow)


def loads_skeleton(data: bytes, allow: frozenset[tuple[str, str]] = frozenset(), *, what: str = "skeleton") -> Any:
    """The skeleton from its JSON document; runs no code (a ``$pickle`` value only with its classes allowed)."""
    return codec.loads(data, allow, what=what)


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
