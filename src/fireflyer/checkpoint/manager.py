"""The checkpoint manager: snapshot in the step, persist in the background, commit last (paper §VII-A).

``save(step, state)`` copies this rank's tensors to host buffers (the only part the
training step waits for) and returns; background threads write them as a safetensors
shard in parallel chunks, fsync it, and record each tensor's file, offset, shape,
dtype and CRC-32. Rank 0 commits the checkpoint once every rank's part is on disk: it
writes the manifest, then the ``COMMIT`` marker (temporary file, fsync, rename,
fsync of the directory). ``load()`` only trusts committed checkpoints, verifies every
byte it reads, and falls back to the previous committed checkpoint, with a warning,
when one is damaged; a step folder whose commit marker and manifest record another step
(another step's files copied into it) is damaged too.

Layout::

    ROOT/step_0000001200/rank00000.safetensors   this rank's tensors
                         rank00000.json          their entries and the skeleton's CRC
                         rank00000.skeleton.json the rest of the state, as data (JSON; checkpoint/codec.py)
                         manifest.json           every rank's entries (rank 0, at commit; "format": 2)
                         COMMIT                  written last

Loading never runs code from the checkpoint: the skeleton is JSON with tagged values,
every file name read from the manifest must be a plain name inside the step directory,
and the only pickle read is an allowlisted object's (``allowed_classes``, or
:func:`fireflyer.checkpoint.allow`), through an unpickler that refuses every other
class. Checkpoints of manifest format 1 (older fireflyer) hold a pickled skeleton and
are refused unless ``allow_pickle=True``.

Three kinds of state: ``replicated`` (data parallel: every rank holds the same state, so
the ranks write disjoint shares of it, and any world size can load it), ``sharded``
(expert parallel: each rank holds part of one global state under global names, some
names on several ranks; each name is written once, and ``load()`` returns the whole
global state on any world size; see checkpoint/sharding.py) and ``per_rank`` (FSDP
shards, or anything that differs by rank: each rank writes and loads its own, and the
world size must match).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
import warnings
import zlib
from dataclasses import dataclass
from datetime import timedelta
from collections.abc import Iterable
from typing import Any

import torch

from fireflyer.checkpoint import allowlist, remote, shard, sharding
from fireflyer.checkpoint.errors import CheckpointError, CorruptCheckpoint, NoCheckpoint, UnsafeCheckpoint
from fireflyer.checkpoint.names import plain_name
from fireflyer.checkpoint.state import dumps_skeleton, flatten, loads_skeleton, unflatten
from fireflyer.fsutil import atomic_write_bytes
from fireflyer.errors import TimedOut, UsageError, UserError

_STEP_DIR = re.compile(r"^step_(\d{10})$")
COMMIT = "COMMIT"
PERSIST_DELAY_ENV = "FIREFLYER_CHECKPOINT_PERSIST_DELAY"
"""Fault injection: seconds each save's background part waits once its step folder exists, before it writes
(tests stop a run while a save is in flight with it). Unset, or 0, in any real run."""
MANIFEST = "manifest.json"
FORMAT = 2
"""Manifest format: 2 has a JSON skeleton (``rankNNNNN.skeleton.json``); 1 (no ``format`` key) a pickled one."""
KINDS = ("replicated", "sharded", "per_rank")
POLICIES = ("wait", "skip")
SNAPSHOTS = ("overlap", "sync")
_SMALL = 1 << 20  # tensors below this are always copied inside save()


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When and how checkpoints are written."""

    every: timedelta | int = timedelta(minutes=5)
    """Save period for ``maybe_save``: a timedelta, or a number of steps."""
    keep_last: int = 2
    """Committed checkpoints kept; older ones are deleted only after a newer one commits."""
    kind: str = "replicated"
    """``replicated`` (DDP: ranks write disjoint shares), ``sharded`` (expert parallel: each rank holds part
    of one global state under global names; every name written once, loaded whole) or ``per_rank``
    (FSDP shards: each rank its own)."""
    policy: str = "wait"
    """What a save does while the previous one is still persisting: ``wait`` for it or ``skip`` this one."""
    threads: int = 4
    """Writer threads per rank."""
    chunk_bytes: int = 64 << 20
    """Bytes per write call."""
    commit_timeout: float = 600.0
    """Seconds rank 0 waits for the other ranks' parts before the save fails."""
    snapshot: str = "overlap"
    """``overlap``: large CPU tensors are copied in the background while the next step's forward
    and backward run, and the next ``optimizer.step()`` (any optimizer) waits until the copy is
    done, so ``save()`` returns almost at once. CUDA tensors are copied on their stream, which
    orders them before any later update. ``sync``: everything is copied inside ``save()``; use it
    if your loop changes parameters in place outside ``optimizer.step()`` (an EMA, clamping)."""

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, (timedelta, int)):
            raise UserError(f"every must be a timedelta or a step count, got {self.every!r}")
        if (self.every.total_seconds() if isinstance(self.every, timedelta) else self.every) <= 0:
            raise UserError(f"every must be positive, got {self.every!r}")
        if self.keep_last < 1:
            raise UserError(f"keep_last must be at least 1, got {self.keep_last}")
        if self.kind not in KINDS:
            raise UserError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.policy not in POLICIES:
            raise UserError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.threads < 1 or self.chunk_bytes < 4096:
            raise UserError("threads must be at least 1 and chunk_bytes at least 4096")
        if not self.commit_timeout > 0:
            raise UserError(f"commit_timeout must be positive seconds, got {self.commit_timeout}")
        if self.snapshot not in SNAPSHOTS:
            raise UserError(f"snapshot must be one of {SNAPSHOTS}, got {self.snapshot!r}")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:010d}")


def committed_steps(root: str) -> list[int]:
    """Steps with a COMMIT marker, oldest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    steps = []
    for name in names:
        m = _STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(root, name, COMMIT)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def _share(tensors: dict[str, torch.Tensor], rank: int, world: int) -> list[str]:
    """This rank's names of a replicated state: greedy by size, so shares are about equal."""
    loads = [0] * world
    owner: dict[str, int] = {}
    for name in sorted(tensors, key=lambda n: (-tensors[n].numel() * tensors[n].element_size(), n)):
        r = loads.index(min(loads))
        owner[name] = r
        loads[r] += tensors[name].numel() * tensors[name].element_size()
    return [n for n in tensors if owner[n] == rank]


class CheckpointManager:
    """Asynchronous, crash-consistent checkpoints under ``root`` (one directory per step)."""

    def __init__(self, root: str | os.PathLike, *, every: timedelta | int = timedelta(minutes=5), keep_last: int = 2,
                 kind: str = "replicated", policy: str = "wait", threads: int = 4, chunk_bytes: int = 64 << 20,
                 commit_timeout: float = 600.0, snapshot: str = "overlap", rank: int | None = None,
                 world_size: int | None = None, backend: Any = None, allowed_classes: Iterable[type] = (),
                 allow_pickle: bool = False) -> None:
        """``allowed_classes``: classes this manager may save and load as (allowlisted) pickles, besides those
        registered with :func:`fireflyer.checkpoint.allow`. ``allow_pickle``: load checkpoints of an older
        fireflyer, whose skeleton is a pickle, through the allowlisting unpickler; only for checkpoints you
        wrote yourself."""
        self.config = CheckpointConfig(every=every, keep_last=keep_last, kind=kind, policy=policy, threads=threads,
                                       chunk_bytes=chunk_bytes, commit_timeout=commit_timeout, snapshot=snapshot)
        self.root = os.fspath(root)
        self.allowed_classes = tuple(allowed_classes)
        allowlist.allowed(self.allowed_classes)  # a bad entry fails here, not at the first save
        self.allow_pickle = bool(allow_pickle)
        # With a storage backend (a Backend or a URL such as s3://bucket/prefix), ``root`` is the local
        # staging directory and the backend holds the checkpoints (see checkpoint/remote.py).
        self.backend = None
        if backend is not None:
            from fireflyer.storage.backends import open_backend

            self.backend = open_backend(backend)
        if rank is None or world_size is None:
            import torch.distributed as dist

            initialised = dist.is_available() and dist.is_initialized()
            rank = dist.get_rank() if initialised and rank is None else (rank or 0)
            world_size = dist.get_world_size() if initialised and world_size is None else (world_size or 1)
        if not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is outside 0..{world_size - 1}")
        self.rank, self.world_size = rank, world_size
        os.makedirs(self.root, exist_ok=True)
        self._thread: threading.Thread | None = None
        # Set when no save is in flight. Waited on instead of Thread.join: a join that a signal handler's
        # exception interrupts (a rank's stop) marks the still-running thread as ended (CPython 3.11,
        # bpo-45274), and every later join, the interpreter's at exit included, returns at once.
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._failed_step: int | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._copied = threading.Event()  # the background part of the current snapshot is done
        self._copied.set()
        self._hook = None
        self._last_save_time = time.monotonic()
        self.stats = {"saves": 0, "skipped": 0, "snapshot_seconds": 0.0, "persist_seconds": 0.0, "bytes": 0}

    # ------------------------------------------------------------------ saving
    def maybe_save(self, step: int, state: Any) -> bool:
        """Save if the period has passed (steps, or time as rank 0 sees it); returns whether a save started."""
        self._raise_failure()
        every = self.config.every
        if isinstance(every, int):
            due = step % every == 0
        else:
            due = time.monotonic() - self._last_save_time >= every.total_seconds()
            if self.world_size > 1:  # clocks differ: rank 0 decides for everyone
                import torch.distributed as dist

                flag = torch.tensor([1 if due else 0], dtype=torch.int32)
                dist.broadcast(flag, src=0)
                due = bool(flag.item())
        return self.save(step, state) if due else False

    def save(self, step: int, state: Any, *, blocking: bool = False) -> bool:
        """Snapshot ``state`` now and persist it in the background; returns False if skipped by policy."""
        if not isinstance(step, int) or step < 0:
            raise UserError(f"step must be a non-negative int, got {step!r}")
        if self.config.kind == "sharded":
            t_agree = time.perf_counter()
            agreed = self._agree_sharded(state)  # a collective: the ranks go on, skip or fail together
            self.stats["exchange_seconds"] = self.stats.get("exchange_seconds", 0.0) + time.perf_counter() - t_agree
            if agreed is None:
                self.stats["skipped"] += 1
                return False
        else:
            self._raise_failure()
            if self._in_flight() and self.config.policy == "skip":
                self.stats["skipped"] += 1
                return False
        if self._in_flight():
            self.wait()
        t0 = time.perf_counter()
        if self.config.kind == "sharded":
            skeleton, tensors, names, all_names = agreed
            write_skeleton = self.rank == 0
        else:
            skeleton, tensors = flatten(state)
            all_names = sorted(tensors)
            if self.config.kind == "replicated":
                names = _share(tensors, self.rank, self.world_size)
                write_skeleton = self.rank == 0
            else:
                names = list(tensors)
                write_skeleton = True
        snapshot, deferred, events = self._snapshot({n: tensors[n] for n in names})
        blob = dumps_skeleton(skeleton, allowlist.allowed(self.allowed_classes)) if write_skeleton else None
        if deferred or events:
            self._copied.clear()
            self._guard_optimizers()
        self.stats["snapshot_seconds"] += time.perf_counter() - t0
        self._last_save_time = time.monotonic()
        self._thread = threading.Thread(target=self._persist, args=(step, snapshot, deferred, events, blob, all_names),
                                        name=f"ckpt-persist-{step}", daemon=False)
        self._idle.clear()
        try:
            self._thread.start()
        except BaseException:
            self._idle.set()
            raise
        self.stats["saves"] += 1
        if blocking:
            self.wait()
        return True

    def _agree_sharded(self, state: Any) -> tuple[Any, dict[str, torch.Tensor], list[str], list[str]] | None:
        """(merged skeleton, this rank's tensors, the names it writes, every name), agreed with all ranks.

        One exchange (an allgather over the default group) tells every rank what every rank
        holds, its skeleton, whether its previous save is still persisting and whether it
        failed. The rest is computed alike everywhere, so the ranks skip together (None, with
        ``policy="skip"``), fail together, and a conflict fails the save on every rank with
        the same message.
        """
        skeleton, tensors = flatten(state)
        allowed = allowlist.allowed(self.allowed_classes)
        held = {n: (shard.st_dtype(t.dtype), tuple(t.shape)) for n, t in tensors.items()}
        error = self._error
        mine = {"held": held, "skeleton": dumps_skeleton(skeleton, allowed),
                "busy": self._in_flight(),
                "failed": None if error is None else f"step {self._failed_step}: {type(error).__name__}: {error}"}
        everyone = self._exchange(mine)
        if error is not None:
            self._raise_failure()
        failed = [(r, e["failed"]) for r, e in enumerate(everyone) if e["failed"]]
        if failed:
            raise CheckpointError(f"rank {failed[0][0]}'s previous checkpoint save failed ({failed[0][1]}); "
                                  "no rank started this one")
        if self.config.policy == "skip" and any(e["busy"] for e in everyone):
            return None
        owner = sharding.plan_owners([e["held"] for e in everyone])
        # Every rank merges the same decoded documents (its own too), so all reach the same result or error.
        merged = sharding.merge_skeletons([loads_skeleton(e["skeleton"], allowed, what=f"rank {r}'s skeleton")
                                           for r, e in enumerate(everyone)])
        return merged, tensors, [n for n in tensors if owner[n] == self.rank], sorted(owner)

    def _exchange(self, mine: Any) -> list[Any]:
        """Every rank's ``mine``, in rank order (a collective on torch.distributed's default group)."""
        if self.world_size == 1:
            return [mine]
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise UsageError(f'kind="sharded" with {self.world_size} ranks needs torch.distributed: the ranks agree '
                             "on who writes each tensor in save(); call dist.init_process_group first")
        if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
            raise UsageError(f'kind="sharded": this manager is rank {self.rank} of {self.world_size} but '
                             f"torch.distributed is rank {dist.get_rank()} of {dist.get_world_size()}; "
                             "leave rank and world_size unset")
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        return everyone

    def _snapshot(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[tuple], list]:
        """Host buffers for ``tensors`` (pinned for CUDA, reused across saves) and the copies left to do.

        Small tensors are copied now; CUDA tensors are queued on their stream (later updates
        on that stream run after the copy); with ``snapshot="overlap"`` large CPU tensors are
        returned as (buffer, source) pairs for the persist thread to copy before it writes,
        and the CUDA copies as events it waits for.
        """
        out, deferred = {}, []
        events = []
        for name, t in tensors.items():
            buf = self._buffers.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
                self._buffers[name] = buf
            if t.is_cuda:
                buf.copy_(t, non_blocking=True)
                events.append(torch.cuda.Event())
                events[-1].record(torch.cuda.current_stream(t.device))
            elif self.config.snapshot == "overlap" and t.numel() * t.element_size() >= _SMALL:
                deferred.append((buf, t))
            else:
                buf.copy_(t)
            out[name] = buf
        for stale in set(self._buffers) - set(tensors):
            del self._buffers[stale]
        return out, deferred, events

    def _guard_optimizers(self) -> None:
        """Make every optimizer's next step wait for the background copy (registered once)."""
        if self._hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            copied = self._copied

            def wait_for_snapshot(optimizer: Any, args: Any, kwargs: Any) -> None:
                if not copied.is_set():
                    t0 = time.perf_counter()
                    copied.wait()
                    self.stats["hook_wait_seconds"] = self.stats.get("hook_wait_seconds", 0.0) + time.perf_counter() - t0

            self._hook = register_optimizer_step_pre_hook(wait_for_snapshot)

    @staticmethod
    def _finish_copies(deferred: list[tuple], events: list) -> None:
        for buf, src in deferred:
            buf.copy_(src)
        for event in events:
            event.synchronize()

    def _persist(self, step: int, tensors: dict[str, torch.Tensor], deferred: list[tuple], events: list,
                 skeleton: bytes | None, all_names: list[str]) -> None:
        t0 = time.perf_counter()
        try:
            try:
                self._finish_copies(deferred, events)
            finally:
                self._copied.set()  # never leave an optimizer waiting, even if the copy failed
            d = step_dir(self.root, step)
            os.makedirs(d, exist_ok=True)
            if os.path.exists(os.path.join(d, COMMIT)):
                raise CheckpointError(f"step {step} is already committed in {d}; steps must increase")
            _injected_delay(step, self.rank)
            me = f"rank{self.rank:05d}"
            entries = shard.write(os.path.join(d, f"{me}.safetensors"), tensors, threads=self.config.threads,
                                  chunk_bytes=self.config.chunk_bytes)
            part: dict[str, Any] = {"rank": self.rank, "world_size": self.world_size, "kind": self.config.kind,
                                    "file": f"{me}.safetensors", "entries": {e.name: e.to_json() for e in entries}}
            if skeleton is not None:
                atomic_write_bytes(os.path.join(d, f"{me}.skeleton.json"), skeleton)
                part["skeleton"] = {"file": f"{me}.skeleton.json", "format": "json", "crc32": zlib.crc32(skeleton),
                                    "bytes": len(skeleton)}
            atomic_write_bytes(os.path.join(d, f"{me}.json"), json.dumps(part).encode())  # this rank's part is on disk
            if self.backend is not None:
                files = [part["file"]] + ([part["skeleton"]["file"]] if "skeleton" in part else []) + [f"{me}.json"]
                remote.upload_part(self.backend, os.path.basename(d), d, files)
                if self.rank != 0:  # rank 0's _retain tidies the staging; on other nodes it is ours to tidy
                    self._retain_staging(step)
            if self.rank == 0:
                self._commit(step, d, all_names)
                self._retain()
            self.stats["bytes"] += sum(e.nbytes for e in entries)
        except BaseException as exc:  # noqa: BLE001 - surfaced on the next call
            self._error, self._failed_step = exc, step
        finally:
            self.stats["persist_seconds"] += time.perf_counter() - t0
            self._idle.set()

    def _commit(self, step: int, d: str, all_names: list[str]) -> None:
        deadline = time.monotonic() + self.config.commit_timeout
        parts = []
        for r in range(self.world_size):
            path = os.path.join(d, f"rank{r:05d}.json")
            if self.backend is not None:
                parts.append(json.loads(remote.wait_part(self.backend, os.path.basename(d), f"rank{r:05d}.json",
                                                         deadline, f"rank {r}'s part of step {step}")))
                continue
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise CheckpointError(f"rank {r} did not finish its part of step {step} within "
                                          f"{self.config.commit_timeout:.0f}s; the checkpoint was not committed")
                time.sleep(0.02)
            with open(path) as f:
                parts.append(json.load(f))
        if self.config.kind in ("replicated", "sharded"):
            have = sorted(n for p in parts for n in p["entries"])
            if have != all_names:
                raise CheckpointError(f"step {step}: the ranks' shares do not add up to the state "
                                      f"(do all ranks save the same {self.config.kind} state?)")
        manifest = json.dumps({"format": FORMAT, "step": step, "world_size": self.world_size,
                               "kind": self.config.kind, "parts": parts}).encode()
        atomic_write_bytes(os.path.join(d, MANIFEST), manifest)
        commit = {"step": step, "manifest_sha256": hashlib.sha256(manifest).hexdigest(), "time": time.time()}
        atomic_write_bytes(os.path.join(d, COMMIT), json.dumps(commit).encode())
        if self.backend is not None:  # the manifest, then the marker that makes the step count
            self.backend.write(f"{os.path.basename(d)}/{MANIFEST}", manifest)
            self.backend.write(f"{os.path.basename(d)}/{COMMIT}", json.dumps(commit).encode())

    def _where(self) -> str:
        return repr(self.backend) if self.backend is not None else self.root

    def _committed(self) -> list[int]:
        if self.backend is not None:
            return remote.committed_steps(self.backend)
        return committed_steps(self.root)

    def _retain_staging(self, newest: int) -> None:
        staged = sorted(int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(self.root)) if m)
        for s in [s for s in staged if s < newest][:-self.config.keep_last or None]:
            shutil.rmtree(step_dir(self.root, s), ignore_errors=True)

    def _retain(self) -> None:
        if self.backend is not None:
            steps = remote.committed_steps(self.backend)
            for s in steps[:-self.config.keep_last]:
                remote.delete_step(self.backend, os.path.basename(step_dir(self.root, s)))
        steps = committed_steps(self.root)
        keep = set(steps[-self.config.keep_last:])
        newest = steps[-1] if steps else None
        for name in os.listdir(self.root):
            m = _STEP_DIR.match(name)
            if not m:
                continue
            s = int(m.group(1))
            # Committed ones beyond keep_last, and uncommitted leftovers older than the newest commit.
            if s not in keep and newest is not None and s < newest:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save in flight is persisted (and, on rank 0, committed); raise if it failed."""
        if not self._idle.wait(timeout):
            raise TimedOut(f"the checkpoint save in flight did not finish within {timeout:.0f}s")
        self._raise_failure()

    def _in_flight(self) -> bool:
        return not self._idle.is_set()

    def _raise_failure(self) -> None:
        if self._error is not None:
            exc, step = self._error, self._failed_step
            self._error = self._failed_step = None
            raise CheckpointError(f"the checkpoint save of step {step} failed: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Wait for the save in flight and stop guarding optimizers; raise if the save failed."""
        try:
            self.wait()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None

    # ------------------------------------------------------------------ loading
    def latest(self) -> int | None:
        """The newest committed step, or None."""
        steps = self._committed()
        return steps[-1] if steps else None

    def load(self, step: int | None = None) -> Any:
        """The saved state of ``step`` (default: the newest committed one that is intact).

        A damaged checkpoint (bytes that fail their checks, or a folder whose commit marker and
        manifest record another step) is named in a warning and the previous committed one is
        tried; with an explicit ``step``, damage raises CorruptCheckpoint instead.
        """
        if step is not None:
            if step not in self._committed():
                raise NoCheckpoint(f"there is no committed checkpoint of step {step} in {self._where()}")
            return self._load(step)
        steps = self._committed()
        if not steps:
            raise NoCheckpoint(f"there is no committed checkpoint in {self._where()}")
        problems = []
        for s in reversed(steps):
            try:
                return self._load(s)
            except CorruptCheckpoint as exc:
                problems.append(str(exc))
                warnings.warn(f"checkpoint of step {s} is damaged ({exc}); trying the previous one", stacklevel=2)
        raise NoCheckpoint("no intact committed checkpoint in " + self._where() + ": " + "; ".join(problems))

    def _load(self, step: int) -> Any:
        d = step_dir(self.root, step)
        if self.backend is not None and not os.path.exists(os.path.join(d, COMMIT)):
            remote.fetch_step(self.backend, os.path.basename(d), d)  # not staged here: download it first
        try:
            commit = json.loads(_read(os.path.join(d, COMMIT)))
            raw = _read(os.path.join(d, MANIFEST))
        except (CorruptCheckpoint, ValueError) as exc:
            raise CorruptCheckpoint(f"step {step}: cannot read its commit marker or manifest ({exc})") from None
        if not isinstance(commit, dict) or hashlib.sha256(raw).hexdigest() != commit.get("manifest_sha256"):
            raise CorruptCheckpoint(f"step {step}: {MANIFEST} does not match its commit marker")
        _check_step(step, commit.get("step"), f"{os.path.basename(d)}/{COMMIT}")
        try:
            manifest = json.loads(raw)
            _check_step(step, manifest.get("step"), f"{os.path.basename(d)}/{MANIFEST}")
            version = manifest.get("format", 1)
            if version not in (1, FORMAT):
                raise CheckpointError(f"step {step} has manifest format {version!r}; this fireflyer reads formats "
                                      f"1 and {FORMAT}: load it with the newer fireflyer that wrote it")
            parts = manifest["parts"]
            if manifest["kind"] == "per_rank":
                if manifest["world_size"] != self.world_size:
                    raise CheckpointError(f"step {step} was saved per rank by {manifest['world_size']} ranks and "
                                          f"cannot be loaded by {self.world_size}; load it with the same world size")
                parts = [p for p in parts if p["rank"] == self.rank]
            tensors: dict[str, torch.Tensor] = {}
            skeleton: Any = None
            found = False
            for i, p in enumerate(parts):
                where = f"step {step}: {MANIFEST} part {i}"
                file = plain_name(p["file"], f"{where} 'file'")
                entries = [shard.Entry.from_json(n, e) for n, e in p["entries"].items()]
                tensors.update(shard.read(os.path.join(d, file), entries))
                if "skeleton" in p:
                    skeleton = self._read_skeleton(d, p["skeleton"], version, f"{where} 'skeleton.file'")
                    found = True
            if not found:
                raise CorruptCheckpoint(f"step {step} has no skeleton for rank {self.rank}")
            return unflatten(skeleton, tensors)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptCheckpoint(f"step {step}: {MANIFEST} is malformed ({type(exc).__name__}: {exc})") from None

    def _read_skeleton(self, d: str, meta: dict, version: int, field: str) -> Any:
        path = os.path.join(d, plain_name(meta["file"], field))
        blob = _read(path)
        if zlib.crc32(blob) != meta["crc32"]:
            raise CorruptCheckpoint(f"{path} fails its checksum")
        allowed = allowlist.allowed(self.allowed_classes)
        if version == FORMAT:
            return loads_skeleton(blob, allowed, what=path)
        if not self.allow_pickle:
            raise UnsafeCheckpoint(
                f"{path} was written by an older fireflyer (manifest format 1), whose skeleton is a pickle; "
                "loading it would unpickle it, and a pickle can run any code. It was not loaded. If you wrote "
                "this checkpoint yourself, load it with CheckpointManager(..., allow_pickle=True), which reads it "
                "through an unpickler that refuses every class not allowlisted, and save it again")
        return allowlist.loads(blob, allowed | allowlist.LEGACY, what=path)


def _check_step(step: int, recorded: Any, what: str) -> None:
    """A step folder must hold its own step: files copied in whole from another step's folder (or a folder
    renamed) carry that step in their commit marker and manifest, and would load as the wrong state."""
    if type(recorded) is not int or recorded != step:
        raise CorruptCheckpoint(f"step {step}: {what} records step {recorded!r}, not {step}: the folder holds "
                                f"another step's checkpoint (copied or renamed into it?)")


def _read(path: str) -> bytes:
    """The bytes of ``path``, never through a symbolic link; CorruptCheckpoint if it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise CorruptCheckpoint(f"{path} is missing or unreadable ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _injected_delay(step: int, rank: int) -> None:
    """Sleep for ``FIREFLYER_CHECKPOINT_PERSIST_DELAY`` seconds before writing this rank's part (fault
    injection; 0 to 60, else ignored), saying so on stderr: the line is also how a test knows that
    every rank has the save in flight."""
    try:
        delay = float(os.environ.get(PERSIST_DELAY_ENV) or 0)
    except ValueError:
        return
    if 0 < delay <= 60:
        print(f"checkpoint: rank {rank} holds its part of step {step} back {delay:g} s ({PERSIST_DELAY_ENV})",
              file=sys.stderr, flush=True)
        time.sleep(delay)
