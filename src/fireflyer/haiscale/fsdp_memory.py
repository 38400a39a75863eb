"""What a rank holds: tensor bytes by category (parameters, gradients, optimizer state) and peak RSS.

ZeRO-3's promise is that each of the three categories is about 1/N of what DDP keeps
on every rank. :func:`tensor_bytes` counts the bytes of the storages behind each
category exactly: a DTensor counts only its local shard, padding included, and
storages shared by several tensors (gradient buckets, FSDP2's flat reduce-scatter
output) count once. What it does not see is transient: gathered parameters during a
unit's forward and backward, activations, communication buffers. :class:`PeakRSS`
measures those too, as the growth of the process's resident set over a phase.
(CPU tensors; on a GPU, ``torch.cuda.max_memory_allocated`` is the counterpart.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


@dataclass(frozen=True, kw_only=True)
class TensorBytes:
    """Bytes one rank holds, by category."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor: its local shard's)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = _local(t).untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def tensor_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> TensorBytes:
    """Parameter, gradient and optimizer-state bytes this rank holds for ``module`` right now."""
    params = list(module.parameters())
    state: list[torch.Tensor] = []
    if optimizer is not None:
        for per_param in optimizer.state.values():
            state += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return TensorBytes(params=storage_bytes(params), grads=storage_bytes(p.grad for p in params),
                       optimizer=storage_bytes(state))


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _trim_heap() -> None:
    """Give freed heap pages back to the OS, so RSS reflects live memory."""
    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):
            pass


class PeakRSS:
    """Growth of this process's resident set: ``m = PeakRSS()``, work, ``m.growth_bytes()``.

    The baseline is the resident set at construction (after giving freed heap back to
    the OS); the peak is reset there and again by :meth:`restart_peak`, so a phase
    that first builds something large and frees it can exclude that from the peak.
    Linux only (``/proc/self``). Where the peak cannot be reset (``/proc/self/clear_refs``
    not writable), ``reset`` is False and the peak may be an older one.
    """

    def __init__(self) -> None:
        self.reset = False
        self.restart_peak()
        rss = _status_kib("VmRSS")
        self.start_bytes: int | None = None if rss is None else rss * 1024

    def restart_peak(self) -> None:
        """Forget the peak so far (the baseline stays)."""
        _trim_heap()
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            self.reset = True
        except OSError:
            self.reset = False

    def growth_bytes(self) -> int | None:
        """Peak resident bytes since the last reset, minus the baseline; None where unreadable."""
        hwm = _status_kib("VmHWM")
        if self.start_bytes is None or hwm is None:
            return None
        return max(0, hwm * 1024 - self.start_bytes)
