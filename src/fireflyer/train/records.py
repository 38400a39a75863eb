"""The training text as record shards: read and checked, tokenised, cut into windows, written
once with :mod:`fireflyer.storage.records`, and reused by every later run that reads the same text.

**Text:** the shipped Shakespeare (``corpus/shakespeare.txt``), or the ``data`` field: a
UTF-8 text file, or a folder whose ``.txt`` files (hidden ones skipped) are read in the
sorted order of their relative paths and joined, each ending in a newline. A missing path,
an empty text, bytes that are not UTF-8 or a folder without ``.txt`` files is a one-line
:class:`~fireflyer.errors.UserError`.

**Records:** one record per training window: ``context + 1`` token ids (uint8 for up to
256 characters). Window ``i`` of a split is tokens ``[i * context, i * context + context + 1)``,
so neighbouring windows share one token and an epoch predicts every token of the split
but the first exactly once. The train and val splits (:func:`split`) are two record
datasets, ``train/`` and ``val/``. Shards are small (about :data:`SHARD_BYTES`), so that
the demo's 490 KB make several and the shard cache has work to do.

**Cache:** ``CACHE/<hash>/`` holds ``train/``, ``val/`` and ``data.json`` (what was built
from what). ``<hash>`` is the sha256 of the text's own sha256, the tokenizer, the record
layout's version and its parameters (context, val_fraction, the split's block, the shard
size), so a change to any of them builds anew and nothing else does. ``CACHE`` is the
``data_cache`` field, else ``FIREFLYER_DATA_CACHE``, else ``~/.cache/fireflyer/data``
(:func:`fireflyer.train.env.data_cache_dir`).

**Building is atomic and runs once:** the builder holds a lock file (``CACHE/.<hash>.lock``,
``flock``; others wait for it, up to a timeout), writes into a temporary folder beside
the final one and renames it into place when complete. A reader sees the whole dataset or
none; a crashed build leaves a temporary folder, which the next builder removes (the
lock dies with its process).

This module needs no torch: the launcher builds the records before it starts the ranks,
so a bad ``--data`` fails before any process is started.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from fireflyer.errors import TimedOut, UserError
from fireflyer.fsutil import durable_replace, make_dirs, write_json
from fireflyer.storage.records import from_numpy
from fireflyer.train.config import TrainConfig
from fireflyer.train.env import data_cache_dir

LAYOUT_VERSION = 1
"""The record layout (windows of context + 1 tokens at stride context, split by blocks); raise it
when the layout changes, so caches built the old way are not read the new way."""
TOKENIZER = "char"
"""One token per character, the vocabulary being the sorted set of the text's characters."""
SPLIT_BLOCK = 8192
"""Tokens per block of the train/val split."""
SHARD_BYTES = 64 << 10
"""About this many bytes of records per shard."""
DESCRIPTION = "data.json"
SPLITS = ("train", "val")
SHIPPED = "shakespeare.txt (shipped)"
TEXT_SUFFIX = ".txt"


def load_corpus() -> str:
    """The text shipped with the package (four of Shakespeare's plays)."""
    return (resources.files("fireflyer.train") / "corpus" / "shakespeare.txt").read_text(encoding="utf-8")


@dataclass(frozen=True)
class Corpus:
    """The text a run trains on, read and checked, and where it came from."""

    source: str
    """The shipped corpus, or the absolute path given as ``data``."""
    text: str
    files: int
    """Text files read (1 for a file)."""
    sha256: str
    """Of the text's UTF-8 bytes (a folder's: of the joined text)."""


def read_corpus(path: str | os.PathLike = "") -> Corpus:
    """The text at ``path`` (a file, or a folder of ``.txt`` files), or the shipped one for ``""``."""
    if not os.fspath(path):
        text = load_corpus()
        return Corpus(SHIPPED, text, 1, hashlib.sha256(text.encode()).hexdigest())
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"data {os.fspath(path)!r} does not exist; give a UTF-8 text file or a folder of "
                        f"{TEXT_SUFFIX} files")
    if p.is_dir():
        files = sorted((f for f in p.rglob(f"*{TEXT_SUFFIX}") if f.is_file()
                        and not any(part.startswith(".") for part in f.relative_to(p).parts)),
                       key=lambda f: f.relative_to(p).as_posix())
        if not files:
            raise UserError(f"data folder {os.fspath(path)!r} holds no {TEXT_SUFFIX} files (hidden ones are skipped)")
        texts = [_read_text(f) for f in files]
        text = "".join(t if t.endswith("\n") else t + "\n" for t in texts if t)
        if not text:
            raise UserError(f"data folder {os.fspath(path)!r}: its {len(files)} {TEXT_SUFFIX} file(s) are all empty")
    elif p.is_file():
        files = [p]
        text = _read_text(p)
        if not text:
            raise UserError(f"data file {os.fspath(path)!r} is empty")
    else:
        raise UserError(f"data {os.fspath(path)!r} is neither a file nor a folder")
    return Corpus(str(p.resolve()), text, len(files), hashlib.sha256(text.encode()).hexdigest())


def _read_text(f: Path) -> str:
    try:
        raw = f.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read data file {str(f)!r}: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"data file {str(f)!r} is not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset "
                        f"{exc.start} ({exc.reason}); convert it to UTF-8") from None


def tokenize(text: str) -> tuple[str, np.ndarray]:
    """(vocabulary, token ids): ``vocab[i]`` is token ``i``; ids in the smallest unsigned dtype that holds them."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    chars, ids = np.unique(codes, return_inverse=True)
    dtype = np.uint8 if len(chars) <= 1 << 8 else np.uint16 if len(chars) <= 1 << 16 else np.uint32
    return "".join(map(chr, chars.tolist())), ids.reshape(-1).astype(dtype)


def split(tokens: np.ndarray, val_fraction: float, *, block: int = SPLIT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Hold out about ``val_fraction`` of ``tokens``: every ``round(1 / val_fraction)``-th block of
    ``block`` tokens, so validation text comes from the whole corpus. Returns (train, val)."""
    n = len(tokens)
    every = max(2, round(1 / val_fraction))
    if -(-n // block) < every:  # a text shorter than `every` blocks: hold out its tail instead
        cut = int(n * (1 - val_fraction))
        return tokens[:cut], tokens[cut:]
    held = (np.arange(n) // block) % every == every - 1
    return tokens[~held], tokens[held]


def windows(tokens: np.ndarray, context: int) -> np.ndarray:
    """The split's records: row ``i`` is ``tokens[i * context : i * context + context + 1]``."""
    n = max(0, (len(tokens) - 1) // context)
    if n == 0:
        return np.empty((0, context + 1), dtype=tokens.dtype)
    return np.lib.stride_tricks.sliding_window_view(tokens, context + 1)[::context][:n]


def cache_key(corpus: Corpus, *, context: int, val_fraction: float) -> str:
    """The content hash that names the records of ``corpus`` under this layout."""
    layout = {"text_sha256": corpus.sha256, "tokenizer": TOKENIZER, "layout": LAYOUT_VERSION, "context": context,
              "val_fraction": val_fraction, "split_block": SPLIT_BLOCK, "shard_bytes": SHARD_BYTES}
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Prepared:
    """Records ready to read: where they are, what they hold, and whether this call built them."""

    dir: Path
    key: str
    source: str
    vocab: str
    context: int
    chars: int
    splits: dict[str, dict[str, int]]
    """Per split: ``tokens``, ``records``, ``shards``, ``records_per_shard``."""
    built: bool
    """This call built them (False: they were in the cache)."""
    build_s: float
    """How long building them took, whenever that was."""

    def records(self, split_name: str) -> int:
        return self.splits[split_name]["records"]

    def describe(self) -> dict[str, Any]:
        """The part of ``run.json``'s ``data`` that the records fix."""
        return {"source": self.source, "hash": self.key, "dir": str(self.dir), "tokenizer": TOKENIZER,
                "layout": LAYOUT_VERSION, "window": self.context + 1, "corpus_chars": self.chars,
                "train_tokens": self.splits["train"]["tokens"], "val_tokens": self.splits["val"]["tokens"],
                "records": {s: self.splits[s]["records"] for s in SPLITS},
                "shards": {s: self.splits[s]["shards"] for s in SPLITS}, "build_s": self.build_s}

    def summary(self) -> str:
        """One line for the launcher: what was read, how many records, built or reused."""
        how = f"built in {self.build_s:.2f} s" if self.built else "reused"
        return (f"data {self.source}: {self.records('train'):,} train + {self.records('val'):,} val windows of "
                f"{self.context + 1} tokens in {sum(self.splits[s]['shards'] for s in SPLITS)} shards, {how} "
                f"({self.dir})")


def prepare(corpus: Corpus, cache: str | os.PathLike, *, context: int, val_fraction: float,
            timeout: float = 600.0) -> Prepared:
    """The records of ``corpus`` under ``cache``: found there, or built (once, atomically) and then found.

    Checks come first: a text too short for one window per split is refused before
    anything is written. ``timeout`` bounds the wait for another process's build.
    """
    if context < 1:
        raise UserError(f"context must be at least 1, got {context}")
    key = cache_key(corpus, context=context, val_fraction=val_fraction)
    cache = Path(cache)
    final = cache / key
    found = _load(final, corpus, built=False)
    if found is not None:
        return found
    t0 = time.perf_counter()
    vocab, tokens = tokenize(corpus.text)
    parts = dict(zip(SPLITS, split(tokens, val_fraction), strict=True))
    for name, part in parts.items():
        if (len(part) - 1) // context < 1:
            hint = "raise val_fraction, " if name == "val" else ""
            raise UserError(f"the {name} split of {corpus.source} holds {len(part)} tokens, too few for one window "
                            f"of context {context} + 1; give more text, {hint}or lower context")
    make_dirs(cache)
    with _BuildLock(cache / f".{key}.lock", timeout=timeout, what=final):
        found = _load(final, corpus, built=False)  # another process built them while this one waited
        if found is not None:
            return found
        _clear_leftovers(cache, key)
        tmp = cache / f".{key}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            make_dirs(tmp)
            description = _write(tmp, corpus, key, vocab, tokens.dtype, parts, context=context,
                                 val_fraction=val_fraction)
            description["build_s"] = time.perf_counter() - t0
            write_json(tmp / DESCRIPTION, description, sort_keys=True)
            durable_replace(str(tmp), str(final))  # the whole dataset appears at once
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    made = _load(final, corpus, built=True)
    assert made is not None, f"{final} was just built"
    return made


def _write(tmp: Path, corpus: Corpus, key: str, vocab: str, dtype: np.dtype, parts: dict[str, np.ndarray], *,
           context: int, val_fraction: float) -> dict[str, Any]:
    rps = max(1, SHARD_BYTES // ((context + 1) * np.dtype(dtype).itemsize))
    splits = {}
    for name, part in parts.items():
        rows = windows(part, context)
        from_numpy(rows, tmp / name, records_per_shard=rps)
        splits[name] = {"tokens": int(len(part)), "records": int(len(rows)), "shards": -(-len(rows) // rps),
                        "records_per_shard": rps}
    return {"layout": LAYOUT_VERSION, "tokenizer": TOKENIZER, "vocab": vocab, "hash": key,
            "text_sha256": corpus.sha256, "source": corpus.source, "chars": len(corpus.text), "context": context,
            "val_fraction": val_fraction, "dtype": np.dtype(dtype).str, "splits": splits}


def _load(final: Path, corpus: Corpus, *, built: bool) -> Prepared | None:
    """The records in ``final`` as :class:`Prepared`, or None if there are none (or only a stale folder)."""
    try:
        d = json.loads((final / DESCRIPTION).read_text())
        if d["layout"] != LAYOUT_VERSION or d["text_sha256"] != corpus.sha256:
            return None
        return Prepared(dir=final, key=d["hash"], source=corpus.source, vocab=d["vocab"], context=int(d["context"]),
                        chars=int(d["chars"]), splits={s: {k: int(v) for k, v in d["splits"][s].items()}
                                                       for s in SPLITS},
                        built=built, build_s=float(d["build_s"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _clear_leftovers(cache: Path, key: str) -> None:
    """Remove crashed builds' temporary folders and a final folder without a readable description
    (the caller holds the lock, so no one else is writing them)."""
    for leftover in cache.glob(f".{key}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    final = cache / key
    if final.exists():
        aside = cache / f".{key}.tmp-stale-{secrets.token_hex(4)}"
        os.replace(final, aside)
        shutil.rmtree(aside, ignore_errors=True)


class _BuildLock:
    """An exclusive ``flock`` on ``path``, taken within ``timeout`` seconds or TimedOut."""

    POLL = 0.05

    def __init__(self, path: Path, *, timeout: float, what: Path) -> None:
        self.path, self.timeout, self.what = path, timeout, what
        self.fd = -1

    def __enter__(self) -> _BuildLock:
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UserError(f"cannot open the lock {self.path} of the data cache: {exc.strerror}; give a writable "
                            "data_cache (or FIREFLYER_DATA_CACHE)") from None
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(self.fd)
                    raise
            if time.monotonic() > deadline:
                os.close(self.fd)
                raise TimedOut(f"another process was still building the training records {self.what} after "
                               f"{self.timeout:.0f}s (it holds {self.path}); wait for it, or raise timeout")
            time.sleep(self.POLL)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def check_fits(prepared: Prepared, *, global_batch: int) -> None:
    """Refuse records too few for one step: a step reads ``global_batch`` distinct windows of each split."""
    for name in SPLITS:
        n = prepared.records(name)
        if n < global_batch:
            hint = "raise val_fraction, " if name == "val" else ""
            raise UserError(f"the {name} split of {prepared.source} has {n} windows of {prepared.context + 1} tokens, "
                            f"fewer than one step reads (global_batch {global_batch}); "
                            f"give more text, {hint}or lower context or global_batch")


def prepare_data(cfg: TrainConfig) -> Prepared:
    """The records a :class:`~fireflyer.train.config.TrainConfig` trains on, found or built, checked to fit."""
    prepared = prepare(read_corpus(cfg.data.path), data_cache_dir(cfg.data.cache), context=cfg.model.context,
                       val_fraction=cfg.data.val_fraction, timeout=cfg.run.timeout)
    check_fits(prepared, global_batch=cfg.data.global_batch)
    return prepared
