"""The names of every environment variable hfreduce reads, and what each means.

Only :mod:`fireflyer.hfreduce.config` reads them (:meth:`HFReduceConfig.from_env
<fireflyer.hfreduce.config.HFReduceConfig.from_env>` and :func:`~fireflyer.hfreduce.config.read`);
the other modules name a variable through this module and ask the config for its value.
"""

from __future__ import annotations

from fireflyer import launch

PREFIX = "FIREFLYER_HFREDUCE_"
"""``FIREFLYER_HFREDUCE_<FIELD>`` overrides the default of the :class:`HFReduceConfig` field ``<field>``
(``CHUNK_BYTES``, ``DEPTH``, ``TIMEOUT``, ``IFADDR``, ``ONESHOT_BYTES``, ``CORE``, ``CORE_TREES``,
``CORE_EXCHANGE``, ``SPIN``, ``YIELDS``, ``ARENA``, ``ORDER``, ``DOOR``)."""


def field(name: str) -> str:
    """The variable of the :class:`~fireflyer.hfreduce.config.HFReduceConfig` field ``name``."""
    return f"{PREFIX}{name.upper()}"


ARENA = field("arena")
"""``file``: the node's arena and mailboxes are files in /dev/shm that local ranks open by name;
anything else (default ``memfd``): private memory handed to local ranks as file descriptors."""
ORDER = field("order")
"""``canonical``: every hfreduce group sums in the pairwise tree over global ranks, whatever the layout
(:attr:`~fireflyer.hfreduce.config.HFReduceConfig.order`); default ``fast``."""
CORE = field("core")
"""``0``: the node stage and the reduce kernels run the pure-Python reference, not the compiled core."""
ISA = f"{PREFIX}ISA"
"""``avx512``, ``avx2`` or ``portable``: a lower instruction set for the compiled kernels (the core reads
it too, as it loads: ``_core/module.c``)."""
SPIN_US = f"{PREFIX}SPIN_US"
"""Microseconds the exchange polls its channels before it sleeps (default 50)."""
MAILBOX_BYTES = f"{PREFIX}MAILBOX_BYTES"
"""Bytes of one local ring of the exchange's mailboxes (default 4 MiB, less for many local ranks)."""
DIRECT_BYTES = f"{PREFIX}DIRECT_BYTES"
"""Payloads from this size up go between local ranks as direct reads (default 256 KiB; 0: never)."""
SPREAD = f"{PREFIX}SPREAD"
"""``0``: gathers, broadcasts and reduce-scatters across nodes take the engine's reduction path,
not the exchange."""
SPREAD_CHUNK_BYTES = f"{PREFIX}SPREAD_CHUNK_BYTES"
"""Bytes of one chunk of a spread collective (default 4 MiB)."""
TRACE_BUFFER = f"{PREFIX}TRACE_BUFFER"
"""Flight-recorder entries per group (default 2000; 0 turns recording off)."""
TRACE_DIR = f"{PREFIX}TRACE_DIR"
"""Where flight-recorder dumps go (default: beside a platform task's logs, else a folder per job in tmp)."""
TRACE_STACK = f"{PREFIX}TRACE_STACK"
"""Set, and not ``0``: the flight recorder keeps the Python stack of each collective too."""
DOOR = field("door")
"""``python``: groups take the Python door, not the C++ one (``backend/door.cpp``); default ``cpp``, which falls
back to the Python door, with a one-line warning, where the C++ door cannot be built or loaded
(:attr:`~fireflyer.hfreduce.config.HFReduceConfig.door`)."""
NO_FUTEX = "FIREFLYER_NO_FUTEX"
"""Set: waits on shared flags sleep in short steps instead of on a futex."""

NODE_ID = launch.NODE_ID
"""The rank's node, as the launcher names it; ranks with the same value share an arena
(default: the host's name and boot id)."""
JOB_SECRET = launch.JOB_SECRET
"""The job's secret (16 characters or more), the same in every rank's environment: it keys the
links and the arena. Unset: rank 0 makes one and hands it through the rendezvous store."""
MASTER_ADDR = "MASTER_ADDR"
"""torchrun's rendezvous host: a rank listens on the address that routes to it."""
MASTER_PORT = "MASTER_PORT"
"""torchrun's rendezvous port (part of the job's name for trace dumps)."""
TASK_DIR = "FIREFLYER_TASK_DIR"
"""The platform task's folder: trace dumps go beside its logs."""
ATTEMPT = "FIREFLYER_ATTEMPT"
"""The platform task's attempt (its trace dumps' subfolder)."""
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_RESTART_COUNT = "SLURM_RESTART_COUNT"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
"""These three name the job for trace dumps when it runs under Slurm or torchrun."""
