"""The flight recorder: a ring buffer of a group's recent collectives, dumped when one fails or hangs.

torch's NCCL backend keeps such a buffer (its "Flight Recorder") and dumps it on a timeout;
this one writes the same dump format, so torch's own analyzer reads hfreduce's dumps::

    python -m torch.distributed.flight_recorder.fr_trace DIR --allow-incomplete-ranks

Next to each pickle it writes a JSON file with the same content plus what only hfreduce
knows: whom each rank was waiting on and for what, the error, why it dumped, the host and
pid. ``fireflyer hfreduce trace DIR`` reads those and never unpickles: a trace file is data,
not code.

One file pair per process (global rank ``R``) in the dump directory:

- ``hfreduce_trace_rank_R``: torch's Flight Recorder pickle, every hfreduce group of the process;
- ``hfreduce_rank_R.json``: the same entries and groups, plus hfreduce's extras.

torch's analyzer wants one file per rank holding all of that rank's groups, so the recorders
of one process that share a dump directory and a global rank write one merged pair; a later
dump by any of them rewrites it. The ring buffer itself is per group.

Environment:

- ``FIREFLYER_HFREDUCE_TRACE_BUFFER``: entries per group (default 2000; 0 turns recording off);
- ``FIREFLYER_HFREDUCE_TRACE_DIR``: where dumps go; see :func:`default_dump_dir` for the default;
- ``FIREFLYER_HFREDUCE_TRACE_STACK=1``: also keep the Python stack of each ``record`` call
  (torch's ``frames``; costs a few µs per collective, so it is off by default).

Every method but :meth:`FlightRecorder.dump` and :meth:`FlightRecorder.entries` is on the
collective's hot path: one lock, a dict lookup and a few stores, about a microsecond. All are
thread-safe. Only the standard library is imported.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import re
import socket
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any, Mapping, Protocol

from fireflyer.fsutil import atomic_write
from fireflyer.hfreduce import env as names
from fireflyer.hfreduce.config import read, read_int
from fireflyer.errors import UserError

BUFFER_ENV = names.TRACE_BUFFER
DIR_ENV = names.TRACE_DIR
STACK_ENV = names.TRACE_STACK
DEFAULT_CAPACITY = 2000
"""Entries per group when ``FIREFLYER_HFREDUCE_TRACE_BUFFER`` is unset (torch's default too)."""

FR_VERSION = "2.10"
"""The Flight Recorder dump version written: torch 2.13's own. Its analyzer checks that every rank
wrote the same one and picks its matching rules by it."""
FORMAT = "fireflyer.hfreduce.trace"
FORMAT_VERSION = 1
PICKLE_PREFIX = "hfreduce_trace_rank_"
"""torch's analyzer takes the rank from what follows this prefix in the file name."""
JSON_PREFIX = "hfreduce_rank_"
JSON_SUFFIX = ".json"
# torch's loader reads every file whose name contains the pickle prefix and infers the prefix
# from names that end in digits, so neither the JSON twin nor a temporary file may do either.

PROFILING_NAMES = {
    "allreduce": "nccl:all_reduce",
    "reduce": "nccl:reduce",
    "broadcast": "nccl:broadcast",
    "allgather": "nccl:all_gather",
    "reduce_scatter": "nccl:reduce_scatter",
    "barrier": "nccl:barrier",
    "all_to_all": "nccl:all_to_all",
    "gather": "nccl:gather",
    "scatter": "nccl:scatter",
    "send": "nccl:send",
    "recv": "nccl:recv",
}
"""The engine's collective names, and the ``profiling_name`` torch's analyzer matches on. It only
knows the ``nccl:`` (and a few other vendors') prefix. It checks that an all_gather's
``output_sizes[0]`` is world_size times its input, and a reduce_scatter's input world_size times
its output: record the whole flat buffer on that side. A send or a receive is named with its
two group ranks, as torch's analyzer parses them: ``nccl:send 0->1``, ``nccl:recv 1<-0``."""
P2P_OPS = ("send", "recv")

SCHEDULED, STARTED, COMPLETED = "scheduled", "started", "completed"
_MAX_FRAMES = 32
_MAX_OPEN = 100_000


def capacity_from_env(env: Mapping[str, str] | None = None) -> int:
    """Entries per group: ``FIREFLYER_HFREDUCE_TRACE_BUFFER`` (in ``env``, default this process's), else 2000."""
    value = read_int(BUFFER_ENV, DEFAULT_CAPACITY, "an integer (entries per group; 0 turns recording off)", env)
    if value < 0:
        raise UserError(f"{BUFFER_ENV} must be 0 or more entries, got {value}")
    return value


def job_id(env: Mapping[str, str] | None = None) -> str:
    """A name every rank of one job computes alike: the Slurm job, the torchrun run, or the rendezvous address."""
    if read(names.SLURM_JOB_ID, env=env):
        job = f"slurm-{read(names.SLURM_JOB_ID, env=env)}"
        restarts = read(names.SLURM_RESTART_COUNT, "0", env)
        if restarts not in ("", "0"):
            job += f"-restart{restarts}"
    elif read(names.TORCHELASTIC_RUN_ID, "none", env) not in ("", "none"):
        job = f"torchrun-{read(names.TORCHELASTIC_RUN_ID, env=env)}"
    elif read(names.MASTER_ADDR, env=env) and read(names.MASTER_PORT, env=env):
        job = f"{read(names.MASTER_ADDR, env=env)}-{read(names.MASTER_PORT, env=env)}"
    else:
        job = f"pid-{os.getpid()}"
    return re.sub(r"[^\w.-]", "_", job)


def default_dump_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where dumps go: one folder per job, shared by all its ranks (on one host, or on a shared filesystem).

    1. ``$FIREFLYER_HFREDUCE_TRACE_DIR`` when set;
    2. in a platform task, ``$FIREFLYER_TASK_DIR/hfreduce-trace/attempt-N``, beside the task's logs;
    3. else ``<tmp>/fireflyer-hfreduce-trace/<job>``, ``<job>`` from :func:`job_id`
       (torch's NCCL default, ``/tmp/nccl_trace_rank_R``, mixes every job of a host in one place).
    """
    explicit = read(DIR_ENV, env=env)
    if explicit:
        return Path(explicit)
    task_dir = read(names.TASK_DIR, env=env)
    if task_dir:
        return Path(task_dir) / "hfreduce-trace" / f"attempt-{read(names.ATTEMPT, env=env) or 0}"
    return Path(tempfile.gettempdir()) / "fireflyer-hfreduce-trace" / job_id(env)


def pickle_path(dump_dir: str | os.PathLike, global_rank: int) -> Path:
    return Path(dump_dir) / f"{PICKLE_PREFIX}{global_rank}"


def json_path(dump_dir: str | os.PathLike, global_rank: int) -> Path:
    return Path(dump_dir) / f"{JSON_PREFIX}{global_rank}{JSON_SUFFIX}"


_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """A torch dtype as the dump names it ("float32")."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def trace_of(tensors: list) -> tuple[list[list[int]], list[str]]:
    """The sizes and dtypes of a collective's tensors, as :meth:`FlightRecorder.record` takes them."""
    return [list(t.shape) for t in tensors], [dtype_name(t.dtype) for t in tensors]


class _Entry:
    """One collective as this rank saw it. Mutated only under its recorder's lock."""

    __slots__ = ("record_id", "seq", "p2p_seq", "peer", "op", "input_sizes", "input_dtypes", "output_sizes", "output_dtypes",
                 "timeout_ms", "created_ns", "started_ns", "completed_ns", "failed_ns", "waiting_on",
                 "waiting_for", "waiting_since_ns", "error", "thread_id", "thread_name", "frames")

    def __init__(self, record_id: int, seq: int, op: str, input_sizes: list, input_dtypes: list,
                 output_sizes: list, output_dtypes: list, timeout_ms: int, frames: list | None,
                 p2p_seq: int = 0, peer: int = -1) -> None:
        self.reset(record_id, seq, op, input_sizes, input_dtypes, output_sizes, output_dtypes, timeout_ms, frames,
                   p2p_seq, peer)

    def reset(self, record_id: int, seq: int, op: str, input_sizes: list, input_dtypes: list,
              output_sizes: list, output_dtypes: list, timeout_ms: int, frames: list | None,
              p2p_seq: int = 0, peer: int = -1) -> None:
        """Make this entry a new collective's (the ring reuses its entries: a collective then
        leaves no new long-lived object behind, which would bring on the cycle collector's full
        passes, tens of ms each in a process that holds torch)."""
        self.record_id = record_id
        self.seq = seq  # a send or receive: the group's last collective when it was posted (torch's convention)
        self.p2p_seq = p2p_seq  # a send or receive: its number among this rank's (from 1); 0 for a collective
        self.peer = peer
        self.op = op
        self.input_sizes = input_sizes
        self.input_dtypes = input_dtypes
        self.output_sizes = output_sizes
        self.output_dtypes = output_dtypes
        self.timeout_ms = timeout_ms
        self.created_ns = time.time_ns()
        self.started_ns = self.completed_ns = self.failed_ns = self.waiting_since_ns = None
        self.waiting_on: tuple = ()
        self.waiting_for = self.error = None
        self.thread_id = threading.get_ident()
        self.thread_name = None  # looked up when dumped (a name per collective would cost on the hot path)
        self.frames = frames


class Ledger(Protocol):
    """Collectives that another keeper recorded for a recorder: the C++ door's own ring of the allreduces it
    claimed and ran without Python (``backend/door.cpp``). :meth:`FlightRecorder.attach` merges it into
    everything the recorder reports and dumps. Every method is read with the GIL held, the ledger's writer
    holding it too, so each answer is whole."""

    def counts(self) -> tuple[int, int, int]:
        """(in flight, settled, recorded)."""

    def last(self) -> tuple[int, int, int]:
        """The last (scheduled, started, completed) collective numbers, -1 for none."""

    def open_collectives(self) -> list[tuple[int, str]]:
        """``(seq, op)`` of those in flight, oldest first."""

    def records(self) -> list[tuple]:
        """Oldest first: (record_id, seq, created_ns, started_ns, completed_ns or None, timeout_ms, thread_id,
        (input sizes, input dtypes, output sizes, output dtypes)); the last :attr:`FlightRecorder.capacity`
        at most, each with a record id from :attr:`FlightRecorder.record_ids`."""


class FlightRecorder:
    """A ring buffer of one process group's recent collectives on this rank, and its dumps.

    ``rank``/``world_size`` are this rank's place in the group; ``global_ranks[i]`` is the
    global rank of group rank ``i`` (the dump names global ranks, as torch's does).
    ``capacity`` defaults to ``$FIREFLYER_HFREDUCE_TRACE_BUFFER`` (2000; 0 records nothing and
    dumps nothing), ``dump_dir`` to :func:`default_dump_dir`. ``group_name`` and ``group_desc``
    may be set later (torch names a group after its backend exists).

    Per collective, with ``seq`` its 0-based sequence number in the group (the same on every
    rank): :meth:`record` when it is queued, :meth:`started`, :meth:`waiting` whenever it blocks
    on peers, then :meth:`completed` or :meth:`failed`. Calls for a ``seq`` the buffer no
    longer holds are ignored. A send or a receive is entered by :meth:`record_p2p`, whose
    returned key stands for ``seq`` in those calls. The recorder keeps the lists it is given;
    do not mutate them.

    It also knows, even with recording off, which collectives are in flight on this rank
    (:meth:`in_flight`, :meth:`open_collectives`) and how many it has settled (:attr:`settled`):
    what a timeout's diagnosis and the group's watch (:mod:`~fireflyer.hfreduce.engine.watch`) read.

    A :class:`Ledger` attached with :meth:`attach` (the C++ door's) is part of all of these: its
    collectives are counted, listed and dumped with the recorder's own.
    """

    def __init__(self, *, rank: int, world_size: int, global_ranks: list[int], group_name: str,
                 group_desc: str = "", capacity: int | None = None,
                 dump_dir: str | os.PathLike | None = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise UserError(f"rank must be in 0..world_size-1, got rank {rank} of {world_size}")
        if len(global_ranks) != world_size or len(set(global_ranks)) != world_size:
            raise UserError(f"global_ranks must list {world_size} distinct global ranks, got {list(global_ranks)}")
        if capacity is None:
            capacity = capacity_from_env()
        if capacity < 0:
            raise UserError(f"capacity must be 0 or more entries, got {capacity}")
        self.rank = rank
        self.world_size = world_size
        self.global_ranks = [int(r) for r in global_ranks]
        self.global_rank = self.global_ranks[rank]
        self.capacity = capacity
        self.dump_dir = Path(dump_dir) if dump_dir is not None else default_dump_dir()
        self._name = str(group_name)
        self._desc = str(group_desc)
        self._stack = read(STACK_ENV, "") not in ("", "0")
        self._lock = threading.Lock()
        self._ring: list[_Entry | None] = [None] * capacity
        self._next = 0
        self._by_seq: dict[int, _Entry] = {}  # a collective's seq, or minus a send's or receive's p2p number
        self._open: dict[int, str] = {}  # keys recorded and not yet settled, oldest first -> op
        self._p2p = 0
        self._settled = 0  # records completed or failed so far
        self._ledger: Callable[[], Ledger | None] | None = None
        self._recorded = 0
        self._last = {SCHEDULED: -1, STARTED: -1, COMPLETED: -1}
        self._file: _RankFile | None = None
        self.pg_id = -1
        if capacity:
            self._file = _RankFile.of(self.dump_dir, self.global_rank)
            self.pg_id = self._file.join(self)

    # ------------------------------------------------------------------ a ledger
    def attach(self, ledger: Ledger) -> None:
        """Merge ``ledger``'s collectives into this recorder's (held weakly: the ledger's owner holds the
        recorder)."""
        self._ledger = weakref.ref(ledger)

    def _kept(self) -> Ledger | None:
        return self._ledger() if self._ledger is not None else None

    @property
    def keeps_stacks(self) -> bool:
        """Each record keeps its caller's Python stack (``FIREFLYER_HFREDUCE_TRACE_STACK``): a ledger cannot."""
        return self._stack

    @property
    def record_ids(self) -> Iterator[int] | None:
        """The process-wide record ids a ledger's records take theirs from (``next()``); None when recording
        is off."""
        return self._file.ids if self._file is not None else None

    @property
    def settled(self) -> int:
        """Collectives completed or failed so far on this rank."""
        ledger = self._kept()
        return self._settled + (ledger.counts()[1] if ledger is not None else 0)

    # ------------------------------------------------------------------ identity
    @property
    def group_name(self) -> str:
        return self._name

    @group_name.setter
    def group_name(self, name: str) -> None:
        old, self._name = self._name, str(name)
        if self._file is not None and old != self._name:
            self._file.rename(self, old)

    @property
    def group_desc(self) -> str:
        return self._desc

    @group_desc.setter
    def group_desc(self, desc: str) -> None:
        self._desc = str(desc)

    # ------------------------------------------------------------------ hot path
    def record(self, seq: int, op: str, *, input_sizes: list[list[int]], input_dtypes: list[str],
               output_sizes: list[list[int]], output_dtypes: list[str], timeout_s: float) -> None:
        """Collective ``seq`` was queued on this rank (state "scheduled")."""
        if op not in PROFILING_NAMES or op in P2P_OPS:
            raise UserError(f"unknown collective {op!r}; the flight recorder knows "
                            f"{', '.join(o for o in PROFILING_NAMES if o not in P2P_OPS)}")
        self._enter(seq, seq, op, input_sizes, input_dtypes, output_sizes, output_dtypes, timeout_s)

    def record_p2p(self, op: str, peer: int, *, sizes: list[list[int]], dtypes: list[str], timeout_s: float) -> int:
        """A send to (``op="send"``) or a receive from group rank ``peer`` was posted on this rank; returns the
        key that stands for its ``seq`` in :meth:`started`, :meth:`waiting`, :meth:`completed` and :meth:`failed`."""
        if op not in P2P_OPS:
            raise UserError(f"a point-to-point record is a send or a recv, not {op!r}")
        with self._lock:
            self._p2p += 1
            number, last = self._p2p, self._last[SCHEDULED]
        self._enter(-number, max(0, last), op, sizes, dtypes, sizes, dtypes, timeout_s, number, peer)
        return -number

    def _enter(self, key: int, seq: int, op: str, input_sizes: list, input_dtypes: list, output_sizes: list,
               output_dtypes: list, timeout_s: float, p2p_seq: int = 0, peer: int = -1) -> None:
        if not self.capacity:
            with self._lock:
                self._opened(key, op)
            return
        args = (next(self._file.ids), seq, op, input_sizes, input_dtypes, output_sizes, output_dtypes,
                int(timeout_s * 1000), _frames(sys._getframe(2)) if self._stack else None, p2p_seq, peer)
        with self._lock:
            self._opened(key, op)
            i = self._next
            e = self._ring[i]
            if e is None:
                e = self._ring[i] = _Entry(*args)
            else:
                old = -e.p2p_seq if e.p2p_seq else e.seq
                if self._by_seq.get(old) is e:
                    del self._by_seq[old]
                e.reset(*args)
            self._next = i + 1 if i + 1 < self.capacity else 0
            self._by_seq[key] = e
            self._recorded += 1
            if not p2p_seq and seq > self._last[SCHEDULED]:
                self._last[SCHEDULED] = seq

    def _opened(self, key: int, op: str) -> None:  # under the lock
        self._open[key] = op
        if len(self._open) > _MAX_OPEN:  # a record nobody settles must not make it grow for ever
            del self._open[next(iter(self._open))]

    def _closed(self, key: int) -> None:  # under the lock
        if self._open.pop(key, None) is not None:
            self._settled += 1

    def in_flight(self) -> int:
        """How many recorded collectives, sends and receives have not yet completed or failed on this rank."""
        ledger = self._kept()
        return len(self._open) + (ledger.counts()[0] if ledger is not None else 0)

    def open_collectives(self) -> list[tuple[int, str]]:
        """``(seq, op)`` of the collectives (not sends or receives) in flight on this rank, oldest first."""
        ledger = self._kept()
        with self._lock:
            ours = [(k, op) for k, op in self._open.items() if k >= 0]
        return sorted(ours + ledger.open_collectives()) if ledger is not None else ours

    def started(self, seq: int) -> None:
        with self._lock:
            e = self._by_seq.get(seq)
            if e is not None:
                self._start(e)

    def waiting(self, seq: int, ranks: list[int], what: str) -> None:
        """Collective ``seq`` now waits on these group ranks, for ``what`` (e.g. "reduce of chunk 3 of 8")."""
        with self._lock:
            e = self._by_seq.get(seq)
            if e is not None:
                self._start(e)
                e.waiting_on = tuple(ranks)
                e.waiting_for = what
                e.waiting_since_ns = time.time_ns()

    def completed(self, seq: int) -> None:
        with self._lock:
            self._closed(seq)
            e = self._by_seq.get(seq)
            if e is not None and e.completed_ns is None:
                self._start(e)
                e.completed_ns = time.time_ns()
                e.waiting_on, e.waiting_for, e.waiting_since_ns = (), None, None
                if not e.p2p_seq and seq > self._last[COMPLETED]:
                    self._last[COMPLETED] = seq

    def failed(self, seq: int, error: str) -> None:
        """Collective ``seq`` failed here; whom it was waiting on is kept, for the diagnosis."""
        with self._lock:
            self._closed(seq)
            e = self._by_seq.get(seq)
            if e is not None and e.failed_ns is None:
                e.failed_ns = time.time_ns()
                e.error = str(error)

    def _start(self, e: _Entry) -> None:
        if e.started_ns is None:
            e.started_ns = time.time_ns()
            if not e.p2p_seq and e.seq > self._last[STARTED]:
                self._last[STARTED] = e.seq

    # ------------------------------------------------------------------ reading and dumping
    def entries(self) -> list[dict]:
        """The buffer, oldest first, as the JSON dump's entries (torch's fields and hfreduce's extras); copies."""
        ledger = self._kept()
        with self._lock:
            ring = [e for e in self._ring[self._next:] + self._ring[: self._next] if e is not None]
            if ledger is not None and self.capacity:
                ring = sorted(ring + [self._ledger_entry(r) for r in ledger.records()],
                              key=lambda e: e.record_id)[-self.capacity:]
            return [self._entry_dict(e) for e in ring]

    @staticmethod
    def _ledger_entry(record: tuple) -> _Entry:
        record_id, seq, created_ns, started_ns, completed_ns, timeout_ms, thread_id, trace = record
        e = _Entry(record_id, seq, "allreduce", trace[0], trace[1], trace[2], trace[3], timeout_ms, None)
        e.created_ns, e.started_ns, e.completed_ns, e.thread_id = created_ns, started_ns, completed_ns, thread_id
        return e

    def dump(self, reason: str) -> Path | None:
        """Write this rank's dump (every group of this process that shares the folder); return the pickle's path.

        Each file is written atomically (temporary file, fsync, rename), so readers see a whole
        dump or the previous one. None when recording is off. Raises OSError when the folder
        cannot be written.
        """
        if self._file is None:
            return None
        return self._file.dump(str(reason))

    def _group_info(self) -> dict:
        ledger = self._kept()
        held, last = ((ledger.counts()[2], ledger.last()) if ledger is not None else (0, (-1, -1, -1)))
        with self._lock:
            recorded = self._recorded + held
            return {
                "name": self._name, "desc": self._desc, "pg_id": self.pg_id, "rank": self.rank,
                "world_size": self.world_size, "global_ranks": list(self.global_ranks),
                "capacity": self.capacity, "recorded": recorded,
                "dropped": max(0, recorded - self.capacity),
                "last_enqueued_collective": max(self._last[SCHEDULED], last[0]),
                "last_started_collective": max(self._last[STARTED], last[1]),
                "last_completed_collective": max(self._last[COMPLETED], last[2]),
            }

    def _entry_dict(self, e: _Entry) -> dict:
        """torch's entry fields (in its order), then hfreduce's extras. Caller holds the lock."""
        if e.completed_ns is not None:
            state = COMPLETED
        elif e.started_ns is not None:
            state = STARTED
        else:
            state = SCHEDULED
        d = {
            "record_id": e.record_id,
            "pg_id": self.pg_id,
            "process_group": (self._name, self._desc or "undefined"),
            "thread_name": e.thread_name or _thread_name(e.thread_id),
            "thread_id": str(e.thread_id),
            "collective_seq_id": e.seq,
            "p2p_seq_id": e.p2p_seq,
            "op_id": e.seq,
            "profiling_name": _profiling_name(e, self.rank),
            "time_created_ns": e.created_ns,
            # torch's analyzer indexes sizes[0]; a collective always has at least one tensor.
            "input_sizes": [list(s) for s in e.input_sizes] or [[]],
            "input_dtypes": list(e.input_dtypes),
            "output_sizes": [list(s) for s in e.output_sizes] or [[]],
            "output_dtypes": list(e.output_dtypes),
            "state": state,
            "time_discovered_started_ns": e.started_ns,
            "time_discovered_completed_ns": e.completed_ns,
            # torch: "a retired but not completed event has timed out"; ours failed.
            "retired": e.completed_ns is not None or e.failed_ns is not None,
            "timeout_ms": e.timeout_ms,
            "is_p2p": bool(e.p2p_seq),
            "frames": [{"name": n, "filename": f, "line": ln} for n, f, ln in e.frames or ()],
        }
        if e.completed_ns is not None and e.started_ns is not None:
            d["duration_ms"] = (e.completed_ns - e.started_ns) / 1e6  # wall time here, not a GPU event's
        d.update({
            "op": e.op,
            "peer": e.peer if e.p2p_seq else None,
            "group_rank": self.rank,
            "waiting_on": list(e.waiting_on),
            "waiting_on_global": [self.global_ranks[r] for r in e.waiting_on if 0 <= r < self.world_size],
            "waiting_for": e.waiting_for,
            "waiting_since_ns": e.waiting_since_ns,
            "error": e.error,
            "time_failed_ns": e.failed_ns,
        })
        return d


_EXTRAS = ("op", "peer", "group_rank", "waiting_on", "waiting_on_global", "waiting_for", "waiting_since_ns", "error",
           "time_failed_ns")


def _profiling_name(e: _Entry, rank: int) -> str:
    if e.op == "send":
        return f"{PROFILING_NAMES['send']} {rank}->{e.peer}"
    if e.op == "recv":
        return f"{PROFILING_NAMES['recv']} {rank}<-{e.peer}"
    return PROFILING_NAMES[e.op]


def _thread_name(ident: int) -> str:
    thread = threading._active.get(ident)  # noqa: SLF001 - the name of a live thread, by its ident
    return thread.name if thread is not None else f"thread-{ident}"


def _frames(frame: Any) -> list[tuple[str, str, int]]:
    """The stack from ``frame`` outwards, innermost first (torch's order)."""
    out = []
    while frame is not None and len(out) < _MAX_FRAMES:
        code = frame.f_code
        out.append((code.co_name, code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return out


class _RankFile:
    """The dump file pair of one global rank in one folder, and the live recorders that write it."""

    _all: dict[tuple[str, int], "_RankFile"] = {}
    _all_lock = threading.Lock()

    @classmethod
    def of(cls, dump_dir: Path, global_rank: int) -> "_RankFile":
        key = (os.path.abspath(dump_dir), global_rank)
        with cls._all_lock:
            if key not in cls._all:
                cls._all[key] = cls(Path(key[0]), global_rank)
            return cls._all[key]

    def __init__(self, folder: Path, global_rank: int) -> None:
        self.folder = folder
        self.global_rank = global_rank
        self.ids = itertools.count()  # record ids, process-wide per rank as torch's (next() is atomic)
        self._pg_ids = itertools.count()
        self._recorders: dict[str, weakref.ref] = {}  # group name -> recorder; a re-created group replaces its old self
        self._lock = threading.Lock()
        self._tmp = itertools.count()

    def join(self, recorder: FlightRecorder) -> int:
        with self._lock:
            self._recorders[recorder.group_name] = weakref.ref(recorder)
            return next(self._pg_ids)

    def rename(self, recorder: FlightRecorder, old: str) -> None:
        with self._lock:
            ref = self._recorders.get(old)
            if ref is not None and ref() is recorder:
                del self._recorders[old]
            self._recorders[recorder.group_name] = weakref.ref(recorder)

    def _live(self) -> list[FlightRecorder]:
        with self._lock:
            live = [r for r in (ref() for ref in self._recorders.values()) if r is not None]
        return sorted(live, key=lambda r: r.pg_id)

    def dump(self, reason: str) -> Path:
        recorders = self._live()
        groups = {r.group_name: r._group_info() for r in recorders}
        entries = sorted((e for r in recorders for e in r.entries()), key=lambda e: e["record_id"])
        pg_config = {name: {"name": name, "desc": g["desc"] or "undefined", "ranks": str(g["global_ranks"])}
                     for name, g in groups.items()}
        pg_status = {str(g["pg_id"]): {k: g[k] for k in ("last_enqueued_collective", "last_started_collective",
                                                          "last_completed_collective")} for g in groups.values()}
        common = {"version": FR_VERSION, "comm_lib_version": f"fireflyer-hfreduce {FORMAT_VERSION}",
                  "pg_config": pg_config, "pg_status": pg_status}
        torch_dump = {**common, "entries": [{k: v for k, v in e.items() if k not in _EXTRAS} for e in entries]}
        ours = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "rank": self.global_rank,
            "hostname": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "reason": reason,
            "dumped_at_ns": time.time_ns(), "groups": groups, **common, "entries": entries,
        }
        with self._lock:  # one dump at a time per file pair; each rename is atomic for readers
            self.folder.mkdir(parents=True, exist_ok=True)
            self._write(json_path(self.folder, self.global_rank),
                        json.dumps(ours, separators=(",", ":"), default=str).encode() + b"\n")
            target = pickle_path(self.folder, self.global_rank)
            self._write(target, pickle.dumps(torch_dump, protocol=4))
        return target

    def _write(self, path: Path, data: bytes) -> None:
        # The temporary name holds neither the pickle prefix nor trailing digits (see JSON_SUFFIX).
        tmp = f".partial-{os.getpid()}-{threading.get_ident()}-{next(self._tmp)}.tmp"
        atomic_write(str(path), lambda f: f.write(data), tmp_name=tmp)
