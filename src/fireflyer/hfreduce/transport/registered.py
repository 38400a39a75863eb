"""Registered buffers: tensors in shared memory that the node's other ranks read directly.

A normal collective copies each rank's input into its slot of the arena (stage-in)
and the result back out (stage-out). A tensor made by :meth:`SharedBuffers.alloc`
lives in memory every local rank has mapped, so an allreduce on it needs neither:
the owner of each slice reads the peers' inputs straight from their buffers, and on
a single node writes the finished slice straight into every peer's buffer. That
removes about a third of the bytes an allreduce moves through memory on one node,
and half of what is left, for DDP's gradient buckets, which are reduced every step.

Allocation is collective among a node's ranks: each calls ``alloc`` with the same
sizes in the same order (DDP does, since every rank builds the same buckets). Local
rank 0 makes one ``memfd`` segment with a slot per local rank and hands it to the
others as a descriptor, as for the arena. Without memfd (or on one rank per node)
``alloc`` returns an ordinary tensor and collectives on it take the usual path.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from fireflyer.hfreduce.transport import fdshare
from fireflyer.hfreduce.errors import CollectiveTimeout, HFReduceError
from fireflyer.errors import UserError

_ALIGN = 4096


@dataclass
class _Segment:
    slot_bytes: int
    peers: list[torch.Tensor]  # uint8 view of every local rank's slot, by local rank
    base: int  # address of this rank's slot


class SharedBuffers:
    """The registered buffers of one communicator on one node."""

    def __init__(self, *, store, node: int, local_rank: int, local_size: int, secret: bytes, timeout: float,
                 enabled: bool) -> None:
        self._store = store
        self._node, self._local_rank, self._local_size = node, local_rank, local_size
        self._secret, self._timeout = secret, timeout
        self.enabled = enabled and local_size > 1 and fdshare.SUPPORTED
        self._count = 0
        self._segments: dict[int, _Segment] = {}
        self.version = 0
        """Changes whenever this rank's registered buffers do: a reader of :meth:`spans` may keep them until then."""
        self._servers: list[fdshare.FdServer] = []  # rank 0's descriptor servers, until close

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed flat tensor of ``numel`` elements; registered when the node can share it."""
        if numel < 0:
            raise UserError(f"numel must be non-negative, got {numel}")
        if not self.enabled or numel == 0:
            return torch.zeros(numel, dtype=dtype)
        index = self._count
        self._count += 1
        slot = -(-numel * dtype.itemsize // _ALIGN) * _ALIGN
        total = slot * self._local_size
        key = f"shared/{self._node}/{index}"
        name = f"fireflyer-hfr-shared-{hashlib.sha256(self._secret).hexdigest()[:12]}-{self._node}-{index}-{os.getpid()}"
        deadline = time.monotonic() + self._timeout
        if self._local_rank == 0:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, total)
                server = fdshare.FdServer(name, fd, self._secret, self._local_size - 1)
                self._store.set(key, json.dumps({"name": name, "bytes": total}))
                mm = mmap.mmap(fd, total)
            finally:
                os.close(fd)
            # The server hands the descriptor to the others and stops by itself; don't wait for it here.
            self._servers.append(server)
        else:
            try:
                self._store.wait([key], timedelta(seconds=max(1.0, deadline - time.monotonic())))
            except Exception as exc:  # torch raises its own store error flavours
                raise CollectiveTimeout(f"local rank 0 never shared registered buffer #{index}; "
                                        "do all local ranks allocate the same buffers in the same order?") from exc
            info = json.loads(self._store.get(key))
            fd = fdshare.fetch_fd(info["name"], self._secret, deadline)
            try:
                if info["bytes"] != total or os.fstat(fd).st_size != total:
                    raise HFReduceError(f"registered buffer #{index} has {info['bytes']} bytes on local rank 0 but "
                                        f"{total} here; every local rank must allocate the same sizes in the same order")
                mm = mmap.mmap(fd, total)
            finally:
                os.close(fd)
        # One tensor per slot, so each rank's buffer has a storage of its own size.
        peers = [torch.frombuffer(mm, dtype=torch.uint8, count=slot, offset=k * slot) for k in range(self._local_size)]
        mine = peers[self._local_rank]
        self._segments[index] = _Segment(slot, peers, mine.data_ptr())
        self.version += 1
        return mine[: numel * dtype.itemsize].view(dtype)

    def release(self, tensor: torch.Tensor) -> None:
        """Forget a registered buffer on this rank (its memory goes when every tensor on it is gone)."""
        found = self.locate(tensor)
        if found is not None:
            self._segments.pop(found[0], None)
            self.version += 1

    def locate(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """(buffer index, byte offset) when ``tensor`` is a contiguous CPU tensor inside one of this rank's slots."""
        if not self._segments or tensor.is_cuda or not tensor.is_contiguous():
            return None
        return self.locate_bytes(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    def locate_bytes(self, ptr: int, nbytes: int) -> tuple[int, int] | None:
        """:meth:`locate` for the ``nbytes`` bytes at address ``ptr``."""
        for index, seg in self._segments.items():
            if seg.base <= ptr and ptr + nbytes <= seg.base + seg.slot_bytes:
                return index, ptr - seg.base
        return None

    def spans(self) -> list[tuple[int, int]]:
        """(address, bytes) of each of this rank's registered buffers: what :meth:`locate_bytes` finds in."""
        return [(seg.base, seg.slot_bytes) for seg in self._segments.values()]

    def peer_view(self, index: int, local_rank: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Local rank ``local_rank``'s registered buffer ``index`` as a flat tensor, from byte ``offset``."""
        seg = self._segments.get(index)
        if seg is None or offset + numel * dtype.itemsize > seg.slot_bytes:
            raise HFReduceError(f"local rank {local_rank} named registered buffer #{index}, which this rank does not "
                                "have; every local rank must allocate the same buffers in the same order")
        return seg.peers[local_rank][offset : offset + numel * dtype.itemsize].view(dtype)

    def close(self) -> None:
        for server in self._servers:
            server.close()
        self._servers = []
        self._segments.clear()
        self.version += 1
