"""Cache policies shared by the simulator (``cachesim``) and the real cache (``cache.ShardCache``).

A *prefetcher* looks at the shard just demanded and names the shards worth loading
before they are asked for; an *admission filter* decides whether a shard may take a
full tier's slot from the least recently used one. Both are plain objects without I/O,
so the same instance type drives the model and the real data path.

* :class:`LocalityPrefetch`: the next ``distance`` shards after the current one (the
  exercise's locality guess: training walks the shard space forward).
* :class:`OraclePrefetch`: the exact next demands, read off the trace (an upper bound).
* :class:`ConfidencePrefetch`: a prefetch queue. Each lookahead offset ``k`` keeps a
  confidence, the running share of its guesses that were demanded within the next
  ``window`` accesses; only offsets at or above ``threshold`` are issued. The simulator
  charges a penalty for every speculative load that the next ``window`` accesses miss.
* :class:`SamplerPrefetch`: the shards a :class:`~fireflyer.storage.sampler.ResumableSampler`'s
  next ``lookahead`` batches will read, named once per step (the oracle for a training
  loop, since the sampler's order is known in advance).
* :class:`FrequencyAdmission`: scan-resistant admission in the TinyLFU manner. Demands
  are counted (halved every ``window`` demands so old popularity fades); a shard enters
  a full tier only if it was asked for at least as often as the victim, so a one-off
  jump cannot push out a shard in steady use.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Protocol, Sequence
from fireflyer.errors import UserError

if TYPE_CHECKING:
    from fireflyer.storage.sampler import ResumableSampler


class Prefetcher(Protocol):
    """What a prefetch policy answers; ``observe`` is told every demand, in order."""

    def observe(self, i: int, shard: int) -> None: ...

    def candidates(self, i: int, shard: int) -> list[int]: ...


@dataclass(kw_only=True)
class LocalityPrefetch:
    """Guess the ``distance`` shards after the one just demanded (wrapping at ``num_shards``)."""

    distance: int
    num_shards: int

    def __post_init__(self) -> None:
        if self.distance < 0:
            raise UserError(f"distance must be >= 0, got {self.distance}")
        if self.num_shards < 1:
            raise UserError(f"num_shards must be >= 1, got {self.num_shards}")

    def observe(self, i: int, shard: int) -> None:
        pass

    def candidates(self, i: int, shard: int) -> list[int]:
        return [(shard + d) % self.num_shards for d in range(1, self.distance + 1)]


@dataclass(kw_only=True)
class OraclePrefetch:
    """Prefetch exactly the next ``distance`` demands of a known trace."""

    trace: Sequence[int]
    distance: int

    def __post_init__(self) -> None:
        if self.distance < 0:
            raise UserError(f"distance must be >= 0, got {self.distance}")

    def observe(self, i: int, shard: int) -> None:
        pass

    def candidates(self, i: int, shard: int) -> list[int]:
        return list(self.trace[i + 1:i + 1 + self.distance])


class SamplerPrefetch:
    """Prefetch the shards of the sampler's next ``lookahead`` batches (sample ``i`` is in shard
    ``i // records_per_shard``, as in a record dataset).

    The training loop moves the sampler (``set_step``) before it reads a batch; the first
    demand at a new position names the shards of the ``lookahead`` batches after it,
    nearest first. Later demands at the same position name nothing, so a batch of many
    records queues its lookahead once, not once per record.
    """

    def __init__(self, sampler: ResumableSampler, *, records_per_shard: int, lookahead: int = 2) -> None:
        if records_per_shard < 1:
            raise UserError(f"records_per_shard must be >= 1, got {records_per_shard}")
        if lookahead < 0:
            raise UserError(f"lookahead must be >= 0, got {lookahead}")
        self.sampler = sampler
        self.records_per_shard = records_per_shard
        self.lookahead = lookahead
        self._named_at: int | None = None

    def upcoming(self, step: int) -> list[int]:
        """Distinct shards of the batches after ``step``, in the order they will be demanded."""
        out: dict[int, None] = {}
        for k in range(1, self.lookahead + 1):
            for i in self.sampler.batch(step + k):
                out.setdefault(i // self.records_per_shard)
        return list(out)

    def observe(self, i: int, shard: int) -> None:
        pass

    def candidates(self, i: int, shard: int) -> list[int]:
        step = self.sampler.step
        if step == self._named_at:
            return []
        self._named_at = step
        return self.upcoming(step)


@dataclass(kw_only=True)
class ConfidencePrefetch:
    """A prefetch queue gated by per-offset confidence (see the module docstring)."""

    max_distance: int
    num_shards: int
    threshold: float = 0.5
    """Issue offset ``k`` only while its confidence is at least this (0 issues everything)."""
    window: int = 4
    """A guess counts as right if the shard is demanded within this many next accesses."""
    decay: float = 0.05
    """Weight of each new outcome in the running confidence."""
    initial: float = 0.5

    def __post_init__(self) -> None:
        if self.max_distance < 1:
            raise UserError(f"max_distance must be >= 1, got {self.max_distance}")
        if not 0.0 <= self.threshold <= 1.0:
            raise UserError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.window < 1:
            raise UserError(f"window must be >= 1, got {self.window}")
        if not 0.0 < self.decay <= 1.0:
            raise UserError(f"decay must be in (0, 1], got {self.decay}")
        self.confidence = [self.initial] * (self.max_distance + 1)
        self._pending: deque[list] = deque()  # [issued at, offset, shard, resolved], oldest first
        self._open: dict[int, list[list]] = {}

    def _update(self, k: int, outcome: float) -> None:
        self.confidence[k] += self.decay * (outcome - self.confidence[k])

    def observe(self, i: int, shard: int) -> None:
        for entry in self._open.pop(shard, []):
            if not entry[3]:
                entry[3] = True
                self._update(entry[1], 1.0)
        while self._pending and self._pending[0][0] < i - self.window:
            entry = self._pending.popleft()
            if not entry[3]:
                entry[3] = True
                self._update(entry[1], 0.0)
                lst = self._open.get(entry[2])
                if lst is not None:
                    lst[:] = [e for e in lst if e is not entry]
                    if not lst:
                        del self._open[entry[2]]

    def candidates(self, i: int, shard: int) -> list[int]:
        out = []
        for k in range(1, self.max_distance + 1):
            s = (shard + k) % self.num_shards
            entry = [i, k, s, False]  # every guess is scored, issued or not, so confidence can recover
            self._pending.append(entry)
            self._open.setdefault(s, []).append(entry)
            if self.confidence[k] >= self.threshold:
                out.append(s)
        return out


@dataclass(kw_only=True)
class FrequencyAdmission:
    """Admit a shard into a full tier only if it was demanded at least as often as the victim."""

    window: int = 256
    """Every ``window`` recorded demands, all counts are halved."""
    filter_prefetches: bool = False
    """Also hold speculative loads to the frequency test (by default a prefetch, which the
    prefetcher predicts is needed next, is admitted like a fresh demand would be under LRU)."""

    def __post_init__(self) -> None:
        if self.window < 1:
            raise UserError(f"window must be >= 1, got {self.window}")
        self._counts: dict[Hashable, int] = {}
        self._seen = 0

    def record(self, key: Hashable) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1
        self._seen += 1
        if self._seen >= self.window:
            self._seen = 0
            self._counts = {k: c >> 1 for k, c in self._counts.items() if c > 1}

    def frequency(self, key: Hashable) -> int:
        return self._counts.get(key, 0)

    def admit(self, candidate: Hashable, victim: Hashable) -> bool:
        return self.frequency(candidate) >= self.frequency(victim)


class LRU:
    """Keys in recency order, bounded by a count of slots (the simulator's tiers)."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise UserError(f"a tier needs at least one slot, got {slots}")
        self.slots = slots
        self._d: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def touch(self, key: Hashable) -> None:
        self._d.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        del self._d[key]

    def victim(self) -> Hashable | None:
        """The key the next insert into a full tier would evict (None while there is room)."""
        return next(iter(self._d)) if len(self._d) >= self.slots else None

    def insert(self, key: Hashable) -> Hashable | None:
        """Add ``key`` as most recent; return the evicted key, if any."""
        self._d[key] = None
        if len(self._d) > self.slots:
            return self._d.popitem(last=False)[0]
        return None

    def keys(self) -> list[Hashable]:
        return list(self._d)
