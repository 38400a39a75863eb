"""The environment variables the platform sets or reads, named once.

Import-light: ranks import this (through the client) on every start.

The torchrun variables of an emulated node's ranks (``RANK``, ``LOCAL_RANK``,
``FIREFLYER_NODE_ID``, ...) are not here: :func:`fireflyer.launch.rank_env` builds them.
"""

from __future__ import annotations

# ---------------------------------------------------------------------- the user's side (CLI)
HOME = "FIREFLYER_PLATFORM_HOME"
"""The platform's directory when ``--home`` is not given (default ``~/.fireflyer/platform``)."""
SERVER = "FIREFLYER_SERVER"
"""A platform server's URL: the CLI acts through it when ``--server`` is not given."""
TOKEN = "FIREFLYER_TOKEN"
"""The bearer token the CLI sends to a platform server."""

# ---------------------------------------------------------------------- what every rank of a task gets
TASK_DIR = "FIREFLYER_TASK_DIR"
"""The attempt's directory: what makes a process a rank of a platform task."""
LOG_DIR = "FIREFLYER_LOG_DIR"
TASK_ID = "FIREFLYER_TASK_ID"
CHAIN_ID = "FIREFLYER_CHAIN_ID"
ATTEMPT = "FIREFLYER_ATTEMPT"
NNODES = "FIREFLYER_NNODES"
TASK_NAME = "FIREFLYER_TASK_NAME"
USER = "FIREFLYER_USER"
JOB_SECRET = "FIREFLYER_JOB_SECRET"
WHOLE_LIFE_STATE = "FIREFLYER_WHOLE_LIFE_STATE"
NODE_ID = "FIREFLYER_NODE_ID"
"""The node a process runs for: a prolog's node (emulated ranks get theirs from ``rank_env``)."""

# ---------------------------------------------------------------------- a fault-tolerant task's replicas
TASK_RANK = "FIREFLYER_TASK_RANK"
"""A replica's rank's place in the whole task (``slot * ranks_per_node + LOCAL_RANK``): its log and started
marker; its ``RANK`` is its place in the replica, which is a torch.distributed world of its own."""
REPLICA = "FIREFLYER_REPLICA"
"""The replica's slot (0 .. nodes-1); its ranks' ``FIREFLYER_NODE_ID`` is ``node{slot}`` wherever it runs."""
PLATFORM_NODE = "FIREFLYER_PLATFORM_NODE"
"""The platform's node a replica runs on."""
LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
"""torchft's own variable: where the replicas find the task's Lighthouse."""
FT_READY = "FIREFLYER_FT_READY"
"""A folder where each replica of a first start says it is built (``fireflyer train``'s, fresh per attempt)."""
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
"""torchrun's count of a node's restarts: a replacement replica gets its start number (it loads the newest
checkpoint and heals from a live replica instead of waiting for the others)."""

# ---------------------------------------------------------------------- outside the platform
SIMULATE_SUSPEND = "FIREFLYER_SIMULATE_SUSPEND"
"""Seconds after which a job outside the platform is told to suspend (HAI's local simulation)."""
