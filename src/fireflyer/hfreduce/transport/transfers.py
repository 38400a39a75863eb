"""What the exchange moves: transfers, the calls they belong to, and the digest each frame carries.

A *transfer* is one byte range that this rank sends to, or receives from, one peer.
A *call* (:class:`Op`: an ``isend``, an ``all_to_all``, a ``gather``) is done when all
its transfers are, and failed when any fails. Tensors travel as flat ``uint8`` views
(or staging copies, for non-contiguous and CUDA tensors), so any dtype moves as bytes.

Each frame carries a 16-byte digest of what its sender believes the transfer is (which
call, dtype, element count, root); a receiver whose own belief differs raises
:class:`~fireflyer.hfreduce.errors.CollectiveMismatch` before a byte lands in its tensor.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from enum import IntEnum
from typing import Callable

import torch

from fireflyer.hfreduce.errors import HFReduceError, fresh

P2P, COLLECTIVE = 1, 2  # the matching spaces of a frame's key: (P2P, user tag) or (COLLECTIVE, call number)


class Kind(IntEnum):
    P2P = 1
    ALL_TO_ALL = 2
    GATHER = 3
    SCATTER = 4
    ALL_GATHER = 16  # the steps of spread.py's collectives across nodes
    BROADCAST = 17
    REDUCE_SCATTER = 32  # + the op, so ranks that reduce with different ops do not match


_KIND_NAMES = {Kind.P2P: "send/recv", Kind.ALL_TO_ALL: "all_to_all", Kind.GATHER: "gather", Kind.SCATTER: "scatter",
               Kind.ALL_GATHER: "all_gather", Kind.BROADCAST: "broadcast"}


def _kind_name(kind: int) -> str:
    if kind in _KIND_NAMES:
        return _KIND_NAMES[kind]
    if Kind.REDUCE_SCATTER <= kind < Kind.REDUCE_SCATTER + 32:
        from fireflyer.hfreduce.plans.plan import Op as ReduceOp  # the reduction's op travels in the kind

        op = kind - Kind.REDUCE_SCATTER
        return f"reduce_scatter ({ReduceOp(op).name})" if op in ReduceOp._value2member_map_ else "reduce_scatter"
    return f"kind {kind}"
_DIGEST = struct.Struct("<BBxxiq")  # kind, dtype code, root, elements: 16 bytes, the frame's digest field
_DTYPES = [getattr(torch, name) for name in (
    "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64", "complex64", "complex128", "complex32",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "bits8", "bits16",
) if hasattr(torch, name)]
_CODE = {d: i + 1 for i, d in enumerate(_DTYPES)}
_UNKNOWN = 255


def digest(kind: Kind, dtype: torch.dtype, numel: int, root: int = -1) -> bytes:
    return _DIGEST.pack(int(kind), _CODE.get(dtype, _UNKNOWN), root, numel)


def describe_digest(raw: bytes) -> str:
    """``"all_to_all of 12 x float32"``: a digest in words, for error messages."""
    kind, code, root, numel = _DIGEST.unpack(raw)
    name = _kind_name(kind)
    dtype = str(_DTYPES[code - 1]).replace("torch.", "") if 0 < code <= len(_DTYPES) else "an unknown dtype"
    where = f" (root {root})" if kind in (Kind.GATHER, Kind.SCATTER) else ""
    return f"{name}{where} of {numel} x {dtype}"


# -- tensors as bytes ---------------------------------------------------------------------------


def source_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a flat uint8 CPU tensor: a view when it can be, else a copy made now."""
    t = t.detach()
    if t.is_cuda:
        t = t.cpu()
    return byte_view(t if t.is_contiguous() else t.contiguous())


def dest_bytes(t: torch.Tensor, finish: list[Callable[[], None]]) -> torch.Tensor:
    """Where received bytes for ``t`` go: a view of it, or a staging buffer that ``finish`` copies into it."""
    if not t.is_cuda and t.is_contiguous():
        return byte_view(t.detach())
    tmp = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)

    def copy_back() -> None:
        with torch.no_grad():
            t.copy_(tmp.view(t.dtype).view(t.shape))
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()

    finish.append(copy_back)
    return tmp


def byte_view(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    if flat.numel() == 1 and flat.stride(0) != 1:  # one element is contiguous with any stride; a byte view is not
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


# -- transfers and calls -----------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class Transfer:
    op: "Op"
    peer: int
    send: bool
    key: tuple[int, int]
    data: torch.Tensor  # flat uint8: what is sent, or where it is received
    digest: bytes
    me: str  # this rank, described (for messages)
    # Progress of a transfer that a channel has begun: its stage and the bytes of it moved so far.
    stage: int = 0
    pos: int = 0
    _what: str | None = None

    @property
    def what(self) -> str:
        """For messages: ``receiving all_to_all of 12 x float32 (all_to_all #3, timeout 60s) on rank 1 (...)``.
        Made when first asked for: most transfers never need it."""
        if self._what is None:
            verb, where = ("sending", "from") if self.send else ("receiving", "on")
            self._what = (f"{verb} {describe_digest(self.digest)} ({self.op.name} #{self.op.id}, timeout "
                          f"{self.op.timeout:g}s) {where} {self.me}")
        return self._what


class Op:
    """One call: done when all its transfers are, failed when any is (then the whole group has failed)."""

    def __init__(self, op_id: int, name: str, deadline: float, timeout: float, result: list[torch.Tensor],
                 finish: list[Callable[[], None]], forget: Callable[["Op"], None]) -> None:
        self.id = op_id
        self.name = name
        self.deadline = deadline
        self.timeout = timeout
        self.future: torch.futures.Future = torch.futures.Future()
        self._result = result
        self._finish = finish
        self._forget = forget
        self._pending: set[Transfer] = set()
        self._lock = threading.Lock()
        self.settled = False
        self.record: int | None = None  # the flight record of the call, or of the collective it is a step of
        self.on_settled: Callable[["Op", str | None], None] | None = None  # told once: None, or the error

    def add(self, tr: Transfer) -> None:
        self._pending.add(tr)

    def add_all(self, transfers: list[Transfer]) -> None:
        self._pending.update(transfers)

    def waiting_on(self) -> list[str]:
        """``["receiving from rank 2", "sending to rank 3"]``: what is left, for timeout messages."""
        with self._lock:
            return sorted({f"{'sending to' if tr.send else 'receiving from'} rank {tr.peer}" for tr in self._pending})

    def peers(self) -> set[int]:
        """The peers of the transfers not done yet."""
        with self._lock:
            return {tr.peer for tr in self._pending}

    def done(self, tr: Transfer | None) -> None:
        """Transfer ``tr`` is done (None: just check); the last one completes the call."""
        with self._lock:
            if tr is not None:
                self._pending.discard(tr)
            last = not self._pending and not self.settled
            if last:
                self.settled = True
        if not last:
            return
        self._forget(self)
        if self.on_settled is not None:  # before the future: its callbacks may look at the record
            self.on_settled(self, None)
        settle(self.future, self.name, self._finish, self._result)

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.settled:
                return
            self.settled = True
        self._forget(self)
        if self.on_settled is not None:
            self.on_settled(self, str(error))
        self.future.set_exception(fresh(error))


def settle(future: torch.futures.Future, name: str, finish: list[Callable[[], None]], result: object) -> bool:
    """Run a finished call's ``finish`` copies, then complete its future with ``result``; False if a
    copy failed (the future then holds that error)."""
    try:
        for fn in finish:
            fn()
    except BaseException as exc:  # noqa: BLE001 - e.g. a CUDA copy failed: the caller must see it
        future.set_exception(HFReduceError(f"hfreduce {name}: copying the result out failed: {exc}"))
        return False
    future.set_result(result)
    return True
