"""The skeleton's file format: JSON with tagged values, read without running any code.

The skeleton is everything in a state that is not a tensor (the tensors are in the
safetensors shard, and the skeleton names each one). It is written as a JSON document
``{"format": "fireflyer.skeleton", "version": 1, "value": V}`` where ``V`` is:

==========================  ==================================================
Python value                JSON
==========================  ==================================================
None, bool, str             itself
int                         a number; beyond 64 bits ``{"$int": "0x..."}``
float                       a number (exact: repr round-trips);
                            ``{"$float": "nan" | "inf" | "-inf"}``
list                        an array
dict, all keys str          an object (unless it is one ``$``-key, see below)
other dict                  ``{"$dict": [[key, value], ...]}`` (int keys stay int)
tuple, set, frozenset       ``{"$tuple": [...]}``, ``{"$set": [...]}``, ``{"$frozenset": [...]}``
bytes                       ``{"$bytes": base64}``
torch.dtype / Size / device ``{"$dtype": "float32"}``, ``{"$size": [2, 3]}``, ``{"$device": "cuda:0"}``
tensor (in the shard)       ``{"$tensor": entry name}``
numpy array / scalar        ``{"$ndarray": {"dtype": "<u4", "shape": [...], "data": base64}}``,
                            ``{"$npscalar": {"dtype": "<f8", "data": base64}}`` (numbers only)
allowlisted object          ``{"$pickle": base64}``, loaded by the allowlisting unpickler
==========================  ==================================================

An object with exactly one key that starts with ``$`` is a tag; every other object is
a dict. Types are exact: a tuple comes back a tuple, an ``np.float64`` an ``np.float64``.
Anything else fails the save with a TypeError naming its key path, unless its class is
allowlisted (:func:`fireflyer.checkpoint.allow`).
"""

from __future__ import annotations

import base64
import json
import math
import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fireflyer.checkpoint import allowlist
from fireflyer.checkpoint.errors import CorruptCheckpoint, UnsafeCheckpoint
from fireflyer.errors import UserError, UserTypeError

FORMAT = "fireflyer.skeleton"
VERSION = 1
_NUMERIC_KINDS = "biufc"  # numpy dtypes that are plain numbers (no objects, strings or records)
_INT64 = 1 << 63


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor stood in the skeleton: its entry name in the shard."""

    name: str


def dumps(value: Any, allow: frozenset[tuple[str, str]] = frozenset()) -> bytes:
    """The JSON bytes of ``value``; TypeError naming the key path of anything it cannot hold."""
    doc = {"format": FORMAT, "version": VERSION, "value": _encode(value, "", allow)}
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()


def loads(data: bytes, allow: frozenset[tuple[str, str]] = frozenset(), *, what: str = "skeleton") -> Any:
    """The value of a skeleton document; CorruptCheckpoint if it is not one, UnsafeCheckpoint if it needs code."""
    try:
        doc = json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpoint(f"{what} is not a skeleton document ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "value" not in doc:
        raise CorruptCheckpoint(f"{what} is not a skeleton document")
    if doc.get("version") != VERSION:
        raise CorruptCheckpoint(f"{what} has skeleton version {doc.get('version')!r}; this fireflyer reads "
                                f"version {VERSION} (was it written by a newer one?)")
    try:
        return _decode(doc["value"], allow, what)
    except (CorruptCheckpoint, UnsafeCheckpoint):
        raise
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError, RuntimeError) as exc:
        raise CorruptCheckpoint(f"{what} holds a malformed value ({type(exc).__name__}: {exc})") from None


def _no_constant(name: str) -> Any:
    raise UserError(f"bare {name} (this format tags it as $float)")


# ---------------------------------------------------------------------- encoding
def _encode(obj: Any, path: str, allow: frozenset[tuple[str, str]]) -> Any:
    t = type(obj)
    if obj is None or t is bool or t is str:
        return obj
    if t is int:
        return obj if -_INT64 <= obj < _INT64 else {"$int": hex(obj)}
    if t is float:
        return obj if math.isfinite(obj) else {"$float": repr(obj)}
    if t is list:
        return [_encode(v, f"{path}/{i}", allow) for i, v in enumerate(obj)]
    if t is dict:
        if all(type(k) is str for k in obj) and not (len(obj) == 1 and next(iter(obj)).startswith("$")):
            return {k: _encode(v, f"{path}/{k}", allow) for k, v in obj.items()}
        return {"$dict": [[_encode(k, f"{path}/<key {k!r}>", allow), _encode(v, f"{path}/{k}", allow)]
                          for k, v in obj.items()]}
    if t in (tuple, set, frozenset):
        items = obj if t is tuple else _stable(obj)
        return {f"${t.__name__}": [_encode(v, f"{path}/{i}", allow) for i, v in enumerate(items)]}
    if t is bytes:
        return {"$bytes": base64.b64encode(obj).decode()}
    if t is TensorRef:
        return {"$tensor": obj.name}
    if t is torch.dtype:
        return {"$dtype": str(obj).removeprefix("torch.")}
    if t is torch.Size:
        return {"$size": list(obj)}
    if t is torch.device:
        return {"$device": str(obj)}
    if t is np.ndarray and obj.dtype.kind in _NUMERIC_KINDS:
        return {"$ndarray": {"dtype": obj.dtype.str, "shape": list(obj.shape),
                             "data": base64.b64encode(np.ascontiguousarray(obj).tobytes()).decode()}}
    if isinstance(obj, np.generic) and obj.dtype.kind in _NUMERIC_KINDS and type(obj) is obj.dtype.type:
        return {"$npscalar": {"dtype": obj.dtype.str, "data": base64.b64encode(obj.tobytes()).decode()}}
    return _encode_pickled(obj, path, allow)


def _stable(items: Any) -> list:
    try:
        return sorted(items)
    except TypeError:
        return list(items)


def _encode_pickled(obj: Any, path: str, allow: frozenset[tuple[str, str]]) -> Any:
    where = path.lstrip("/") or "(the state itself)"
    try:
        name = allowlist.qualname(t := type(obj))
    except TypeError:
        name = None
    if name is None or name not in allow:
        shown = f"{t.__module__}.{t.__qualname__}"
        raise UserTypeError(
            f"checkpoint entry {where!r} is a {shown}, which a checkpoint cannot hold as data (it holds None, "
            "bool, int, float, str, bytes, list, tuple, set, dict, tensors, torch dtype/Size/device and numpy "
            "numbers). Turn it into plain data (a dict, dataclasses.asdict, a state_dict() method), or, if it "
            f"must stay an object, allowlist its class: fireflyer.checkpoint.allow({t.__qualname__}) or "
            f"CheckpointManager(..., allowed_classes=[{t.__qualname__}])")
    try:
        blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise UserTypeError(f"checkpoint entry {where!r} ({name[0]}.{name[1]}) cannot be pickled: {exc}") from None
    # Load it back the way a reader will, so a class it refers to that is not allowlisted fails now, not at resume.
    try:
        allowlist.loads(blob, allow, what=f"checkpoint entry {where!r}")
    except UnsafeCheckpoint as exc:
        raise UserTypeError(str(exc)) from None
    return {"$pickle": base64.b64encode(blob).decode()}


# ---------------------------------------------------------------------- decoding
def _decode(v: Any, allow: frozenset[tuple[str, str]], what: str) -> Any:
    if v is None or type(v) in (bool, int, float, str):
        return v
    if type(v) is list:
        return [_decode(x, allow, what) for x in v]
    if type(v) is not dict:
        raise CorruptCheckpoint(f"{what} holds an unexpected {type(v).__name__}")
    if len(v) != 1 or not next(iter(v)).startswith("$"):
        return {k: _decode(x, allow, what) for k, x in v.items()}
    (tag, body), = v.items()
    decode = _TAGS.get(tag)
    if decode is None:
        raise CorruptCheckpoint(f"{what} holds an unknown tag {tag!r}")
    return decode(body, allow, what)


def _items(body: Any, allow: frozenset, what: str) -> list:
    if type(body) is not list:
        raise UserError("expected an array")
    return [_decode(x, allow, what) for x in body]


def _dict(body: Any, allow: frozenset, what: str) -> dict:
    if type(body) is not list or not all(type(p) is list and len(p) == 2 for p in body):
        raise UserError("$dict expects [key, value] pairs")
    return {_decode(k, allow, what): _decode(x, allow, what) for k, x in body}


def _str(body: Any) -> str:
    if type(body) is not str:
        raise UserError("expected a string")
    return body


def _float(body: Any, allow: frozenset, what: str) -> float:
    if body not in ("nan", "inf", "-inf"):
        raise UserError(f"$float expects nan, inf or -inf, got {body!r}")
    return float(body)


def _dtype(body: Any, allow: frozenset, what: str) -> torch.dtype:
    dtype = getattr(torch, _str(body), None)
    if type(dtype) is not torch.dtype:
        raise UserError(f"{body!r} is not a torch dtype")
    return dtype


def _np_dtype(name: Any) -> np.dtype:
    dtype = np.dtype(_str(name))
    if dtype.kind not in _NUMERIC_KINDS or dtype.hasobject or dtype.fields is not None:
        raise UserError(f"numpy dtype {name!r} is not a plain number type")
    return dtype


def _ndarray(body: Any, allow: frozenset, what: str) -> np.ndarray:
    dtype = _np_dtype(body["dtype"])
    shape = tuple(body["shape"])
    if not all(type(n) is int and n >= 0 for n in shape):
        raise UserError(f"bad array shape {shape}")
    return np.frombuffer(base64.b64decode(_str(body["data"]), validate=True), dtype=dtype).reshape(shape).copy()


def _npscalar(body: Any, allow: frozenset, what: str) -> np.generic:
    dtype = _np_dtype(body["dtype"])
    data = base64.b64decode(_str(body["data"]), validate=True)
    if len(data) != dtype.itemsize:
        raise UserError("numpy scalar of the wrong size")
    return np.frombuffer(data, dtype=dtype)[0]


def _size(body: Any, allow: frozenset, what: str) -> torch.Size:
    if type(body) is not list or not all(type(n) is int and n >= 0 for n in body):
        raise UserError("$size expects an array of non-negative ints")
    return torch.Size(body)


_TAGS = {
    "$int": lambda b, a, w: int(_str(b), 16),
    "$float": _float,
    "$dict": _dict,
    "$tuple": lambda b, a, w: tuple(_items(b, a, w)),
    "$set": lambda b, a, w: set(_items(b, a, w)),
    "$frozenset": lambda b, a, w: frozenset(_items(b, a, w)),
    "$bytes": lambda b, a, w: base64.b64decode(_str(b), validate=True),
    "$tensor": lambda b, a, w: TensorRef(_str(b)),
    "$dtype": _dtype,
    "$size": _size,
    "$device": lambda b, a, w: torch.device(_str(b)),
    "$ndarray": _ndarray,
    "$npscalar": _npscalar,
    "$pickle": lambda b, a, w: allowlist.loads(base64.b64decode(_str(b), validate=True), a, what=w),
}

