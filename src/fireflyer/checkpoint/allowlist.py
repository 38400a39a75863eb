"""The only pickle a checkpoint may hold: one whose globals are all on an explicit allowlist.

A pickle names classes and functions by module and qualified name, and loading it calls
them, so a pickle from someone else is code. Checkpoints therefore keep their structure
as data (see :mod:`fireflyer.checkpoint.codec`), and nothing is allowlisted by default:
torch's model, optimizer and scheduler state and the RNG states are all plain data. A
user object that is not data (an instance of your own class) can be saved only after you
allow its class, here for every manager::

    fireflyer.checkpoint.allow(MyDataLoaderState)

or for one manager, ``CheckpointManager(..., allowed_classes=[MyDataLoaderState])``.
Loading such a value uses :class:`AllowlistUnpickler`, which refuses every other global
with :class:`~fireflyer.checkpoint.errors.UnsafeCheckpoint`, naming it.
"""

from __future__ import annotations

import io
import pickle
import threading
from collections.abc import Iterable
from typing import Any

from fireflyer.checkpoint.errors import CorruptCheckpoint, UnsafeCheckpoint
from fireflyer.errors import UserTypeError

_lock = threading.Lock()
_registered: set[tuple[str, str]] = set()


def qualname(obj: Any) -> tuple[str, str]:
    """(module, qualified name) of a class or function, as a pickle names it."""
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(name, str) or "<locals>" in name:
        raise UserTypeError(f"{obj!r} cannot be allowlisted: it is not a class or function importable by name")
    return module, name


def allow(*objs: type | Any) -> None:
    """Allow these classes (or functions) in every checkpoint this process saves or loads.

    Allow only what you trust: loading a checkpoint that holds an allowed class calls it
    (its ``__reduce__`` constructor and ``__setstate__``) with data from the file.
    """
    names = [qualname(o) for o in objs]
    with _lock:
        _registered.update(names)


def disallow(*objs: type | Any) -> None:
    """Undo :func:`allow`."""
    names = [qualname(o) for o in objs]
    with _lock:
        _registered.difference_update(names)


def allowed(extra: Iterable[type | Any] = ()) -> frozenset[tuple[str, str]]:
    """The registered names plus ``extra`` (a manager's ``allowed_classes``)."""
    with _lock:
        return frozenset(_registered) | frozenset(qualname(o) for o in extra)


class AllowlistUnpickler(pickle.Unpickler):
    """An unpickler that resolves only allowlisted globals and refuses everything else."""

    def __init__(self, file: Any, allow: frozenset[tuple[str, str]], *, what: str = "checkpoint") -> None:
        super().__init__(file)
        self._allow = allow
        self._what = what

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._allow:
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"{self._what} refers to {module}.{name}, which is not allowlisted, so it was not loaded "
            f"(loading it would run that code). If you trust this file and {module}.{name}, allow it with "
            f"fireflyer.checkpoint.allow({name.rsplit('.', 1)[-1]}) or "
            f"CheckpointManager(..., allowed_classes=[{name.rsplit('.', 1)[-1]}])")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint(f"{self._what} holds a persistent reference, which checkpoints never use")


def loads(data: bytes, allow: frozenset[tuple[str, str]], *, what: str = "checkpoint") -> Any:
    """Unpickle ``data`` resolving only the globals in ``allow``."""
    try:
        return AllowlistUnpickler(io.BytesIO(data), allow, what=what).load()
    except UnsafeCheckpoint:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of a damaged pickle is the same answer
        raise CorruptCheckpoint(f"{what} is not a readable pickle ({type(exc).__name__}: {exc})") from None


def _legacy() -> frozenset[tuple[str, str]]:
    import torch

    names = {("fireflyer.checkpoint.state", "TensorRef"), ("fireflyer.checkpoint.codec", "TensorRef"),
             ("collections", "OrderedDict"), ("torch", "Size"), ("torch", "device"), ("numpy", "dtype"), ("numpy", "ndarray")}
    names |= {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
    for core in ("numpy.core", "numpy._core"):
        names |= {(f"{core}.multiarray", "_reconstruct"), (f"{core}.multiarray", "scalar"),
                  (f"{core}.numeric", "_frombuffer")}
    return frozenset(names)


LEGACY = _legacy()
"""What a skeleton pickled by an older fireflyer legitimately names: its tensor placeholder, torch
dtypes, Size and device, and numpy's array and scalar constructors (the numpy RNG state). Used only
with ``CheckpointManager(..., allow_pickle=True)``, together with the user's allowlist."""
