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

# ---------------------------------------------------------------------- outside the platform
SIMULATE_SUSPEND = "FIREFLYER_SIMULATE_SUSPEND"
"""Seconds after which a job outside the platform is told to suspend (HAI's local simulation)."""
