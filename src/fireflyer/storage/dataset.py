"""``RecordDataset``: a record dataset as a torch ``Dataset`` with batched fetches.

torch is imported only here, and only when the class is used. ``__getitems__`` lets a
``DataLoader`` fetch a whole batch with one parallel :meth:`RecordReader.read_many`.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from fireflyer.storage.backends import Backend
from fireflyer.storage.records import RecordReader


def _torch_dataset_base() -> type:
    try:
        from torch.utils.data import Dataset
    except ImportError:  # pragma: no cover - torch is a core dependency of fireflyer, optional for storage
        return object
    return Dataset


class RecordDataset(_torch_dataset_base()):  # type: ignore[misc]
    """Sample ``i`` of a record dataset, decoded (numpy datasets become tensors) and transformed."""

    def __init__(self, root: str | os.PathLike | Backend, *, transform: Callable[[Any], Any] | None = None,
                 threads: int = 4, as_tensor: bool = True) -> None:
        self.root = root
        self.transform = transform
        self.threads = threads
        self.as_tensor = as_tensor
        self._reader: RecordReader | None = None
        self._pid = -1
        self._len = len(self.reader)

    @property
    def reader(self) -> RecordReader:
        # One reader per process: DataLoader workers fork, and file descriptors and pools must not be shared.
        if self._reader is None or self._pid != os.getpid():
            self._reader = RecordReader(self.root, threads=self.threads)
            self._pid = os.getpid()
        return self._reader

    def __len__(self) -> int:
        return self._len

    def _decode(self, data: bytes) -> Any:
        x = self.reader.decode(data)
        if self.as_tensor and not isinstance(x, bytes):
            import torch

            x = torch.from_numpy(x.copy())
        return self.transform(x) if self.transform else x

    def __getitem__(self, i: int) -> Any:
        return self._decode(self.reader.read(int(i)))

    def __getitems__(self, ids: Sequence[int]) -> list[Any]:
        return [self._decode(d) for d in self.reader.read_many([int(i) for i in ids])]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_reader"] = None
        return state
