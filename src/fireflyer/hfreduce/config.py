"""Engine configuration, where a rank sits (its node and the address it listens on), and the job's secret.

The one reader of hfreduce's environment: :meth:`HFReduceConfig.from_env` for the
per-group settings, :func:`read` and :func:`read_int` for the process-wide knobs and the
launcher's variables. The names, with what each means, are in :mod:`fireflyer.hfreduce.env`.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

from fireflyer.hfreduce import env as names
from fireflyer.errors import UserError

_D = TypeVar("_D", int, None)


@dataclass(frozen=True, kw_only=True)
class HFReduceConfig:
    """How the engine runs. Environment variables ``FIREFLYER_HFREDUCE_<FIELD>`` override the defaults
    (:meth:`from_env`)."""

    chunk_bytes: int | None = None
    """Bytes of one rank's chunk; the unit of pipelining. Larger means fewer handoffs, smaller means more overlap.
    None: chosen when the group forms (:func:`default_chunk_bytes`)."""
    depth: int = 4
    """Chunks in flight per node (arena buffers). At least 2."""
    timeout: float | None = None
    """Seconds a collective may take before every rank raises CollectiveTimeout. ``None``: not set here.
    One rule decides it (:meth:`settled`): a value set here beats the caller's explicit timeout (torch's
    ``init_process_group``/``new_group(timeout=...)``, or ``from_env(timeout=...)``), which beats
    ``FIREFLYER_HFREDUCE_TIMEOUT``, which beats the default (torch's own default through ``dist``,
    :data:`DEFAULT_TIMEOUT` for a Communicator made directly)."""
    ifaddr: str | None = None
    """IPv4 address to listen on for other nodes. Default: the address that routes to MASTER_ADDR."""
    oneshot_bytes: int = 256 << 10
    """On one node, collectives up to this size (and one chunk) run one-shot: every rank stages its whole
    input in and reduces all of it into its own result, with no second handoff. Every rank of a group must
    use the same value (as with chunk_bytes). At most one chunk counts, whatever this says. Why 256 KiB:
    docs/hfreduce.md, "Why the defaults"."""
    core: bool = True
    """Run the node stage in the compiled core when it is built (``False``: the pure-Python reference)."""
    core_trees: bool = True
    """With ``core``: run the tree stage's sends, receives and combines in the compiled core too
    (``False``: the Python loop of trees.py, on the same frames; ranks may mix the two)."""
    core_exchange: bool = True
    """With ``core``: a synchronous all-to-all, gather, scatter or cross-node step drives its rings and sockets
    in the compiled core (``False``: the Python loop of transport/progress.py, on the same frames; ranks may
    mix the two)."""
    spin: int = 64
    """Busy polls of a flag before a waiting rank yields its core (compiled core)."""
    yields: int = 16
    """sched_yield calls a waiting rank makes before it sleeps on the flag's futex (compiled core).
    A yield hands the core to a peer that shares it (ranks outnumber cores here) at once, where a
    futex sleep costs a wake-up per handoff; counted, not timed, because a yield with nobody else
    to run returns at once, so timed yielding spins far longer than asked whenever other threads
    share the processes (docs/hfreduce.md, "Why the defaults")."""
    order: str = "fast"
    """How a reduction's terms meet. ``fast``: the order the layout gives (in a node, local ranks in
    turn; across nodes, the double binary tree), the same bits on every rank and in every rerun of
    the same layout. ``canonical``: the left-balanced pairwise tree over global ranks
    (:mod:`fireflyer.hfreduce.plans.canonical`), so the bits do not depend on the layout either: a
    floating-point SUM, AVG or PRODUCT gives what one process summing the ranks' tensors in that
    tree gives, on 1x8, 2x4, 4x2 or 8x1 alike. It needs every node to hold the same power-of-two
    number of consecutive ranks (one node may hold any number); other layouts are refused when
    the group forms. Across more than two nodes the trees become binomial trees rooted at node 0.
    Every rank of a group must use the same value."""
    door: str = "cpp"
    """The door of small one-node allreduces: ``cpp``, the C++ door (``backend/door.cpp``), which falls back to
    the Python door with a one-line warning where it cannot be built or loaded; ``python``, the Python door.
    Both give the same bits."""
    arena: str = "memfd"
    """How local ranks share the node's arena and the exchange's mailboxes: ``file``, files in
    /dev/shm opened by name; anything else, private memory handed over as file descriptors
    (where the platform can, else files too)."""

    @property
    def private_arena(self) -> bool:
        """Whether the arena is private memory passed as descriptors (``arena`` is not ``file``)."""
        return self.arena != "file"

    def __post_init__(self) -> None:
        if self.chunk_bytes is not None and (self.chunk_bytes < 4096 or self.chunk_bytes % 64):
            raise UserError(f"chunk_bytes must be a multiple of 64 and at least 4096, got {self.chunk_bytes}")
        if self.depth < 2:
            raise UserError(f"depth must be at least 2, got {self.depth}")
        if self.timeout is not None and not self.timeout > 0:
            raise UserError(f"timeout must be positive seconds, got {self.timeout}")
        if not 0 <= self.oneshot_bytes <= 1 << 40:
            raise UserError(f"oneshot_bytes must be 0 or more bytes, got {self.oneshot_bytes}")
        if self.order not in ORDERS:
            raise UserError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.door not in DOORS:
            raise UserError(f"door: choose {' or '.join(DOORS)}, got {self.door!r}")
        if not 0 <= self.spin <= 1 << 24 or not 0 <= self.yields <= 1 << 20:
            raise UserError(f"spin must be 0..{1 << 24} and yields 0..{1 << 20}, got {self.spin} and {self.yields}")

    def settled(self, given: float | timedelta | None = None, default: float | None = None) -> "HFReduceConfig":
        """This config with its timeout a number, by the one rule: its own where set, else ``given`` (the
        caller's explicit timeout), else ``FIREFLYER_HFREDUCE_TIMEOUT``, else ``default``
        (:data:`DEFAULT_TIMEOUT` when None)."""
        if self.timeout is not None:
            return self
        if given is not None:
            value = given.total_seconds() if isinstance(given, timedelta) else float(given)
        else:
            from_env = _env_field("timeout", float)
            value = from_env if from_env is not None else (DEFAULT_TIMEOUT if default is None else default)
        return dataclasses.replace(self, timeout=value)

    @classmethod
    def from_env(cls, timeout: float | timedelta | None = None, **overrides) -> "HFReduceConfig":
        """The defaults, then ``FIREFLYER_HFREDUCE_<FIELD>`` where set, then ``overrides``; an explicit
        ``timeout`` beats the environment's (see :attr:`timeout` for the one rule)."""
        kw: dict = {}
        for name, conv in (("chunk_bytes", int), ("depth", int), ("timeout", float), ("ifaddr", str),
                           ("oneshot_bytes", int), ("core", _flag), ("core_trees", _flag),
                           ("core_exchange", _flag), ("spin", int), ("yields", int),
                           ("arena", str), ("order", str), ("door", str)):
            value = _env_field(name, conv)
            if value is not None:
                kw[name] = value
        if timeout is not None:
            kw["timeout"] = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)


DEFAULT_TIMEOUT = 60.0
"""Seconds: a Communicator's collective timeout where nothing else sets one (torch's default through ``dist``)."""


def _env_field(name: str, conv):
    """``FIREFLYER_HFREDUCE_<NAME>`` converted, or None where unset or empty."""
    raw = read(names.field(name))
    if not raw:
        return None
    try:
        return conv(raw)
    except ValueError:
        raise UserError(f"{names.field(name)}={raw!r} is not a valid {conv.__name__}") from None


ORDERS = ("fast", "canonical")
DOORS = ("cpp", "python")
"""The values of :attr:`HFReduceConfig.order`."""

ONE_NODE_CHUNK = 256 << 10
MANY_NODES_CHUNK = 4 << 20


def default_chunk_bytes(num_nodes: int) -> int:
    """The chunk for a group that did not set one.

    On one node, small chunks keep each chunk's slots, partial and result in the CPU's
    caches between the stage-in, the reduce and the stage-out, so memory sees little more
    than each input read once and each output written once. Across nodes the tree stage
    pays per chunk, so chunks stay large. The measurements: docs/hfreduce.md, "Why the defaults".
    """
    return ONE_NODE_CHUNK if num_nodes == 1 else MANY_NODES_CHUNK


def _flag(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise UserError(raw)


_flag.__name__ = "flag (0 or 1)"


def node_key() -> str:
    """This process's node: ``FIREFLYER_NODE_ID`` if set, else the host (name and boot id)."""
    explicit = read(names.NODE_ID)
    if explicit:
        return explicit
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def route_address(config: HFReduceConfig) -> str:
    """The address this rank listens on for other nodes: ``config.ifaddr``, else the one that routes to MASTER_ADDR."""
    if config.ifaddr:
        return config.ifaddr
    master = read(names.MASTER_ADDR, "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(master), 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"




def read(name: str, default: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The value of hfreduce's environment variable ``name`` (named in :mod:`~fireflyer.hfreduce.env`), or ``default``.

    ``env`` stands in for the process's environment (tests, and callers that were handed one).
    """
    return (os.environ if env is None else env).get(name, default)


def read_int(name: str, default: _D, what: str, env: Mapping[str, str] | None = None) -> int | _D:
    """``name`` as an integer, ``default`` when unset or blank; ValueError ``NAME='raw' is not <what>``."""
    raw = (read(name, "", env) or "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"{name}={raw!r} is not {what}") from None


SECRET_ENV = names.JOB_SECRET


def launcher_secret() -> bytes | None:
    """The job's secret from the launcher's environment (``FIREFLYER_JOB_SECRET``), or None."""
    raw = read(SECRET_ENV)
    if raw is None or raw == "":
        return None
    if len(raw) < 16:
        raise UserError(f"{SECRET_ENV} must be at least 16 characters (a random token), got {len(raw)}")
    return raw.encode()
