"""The HTTP API's request and response bodies, so the OpenAPI spec says exactly what goes in and out.

Bounds keep every number inside what SQLite and the scheduler can hold, and strings
are refused (422) when they could not be stored or exec'd: lone UTF-16 surrogates
(JSON allows them, UTF-8 does not) and NUL characters.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool

from fireflyer.platform.scheduler.api import MAX_TASK_ID
from fireflyer.errors import UserError

MAX_ID = MAX_TASK_ID
"""Task ids and offsets stay well inside SQLite's signed 64-bit integers."""
MAX_NODES = 1_000_000
MAX_RANKS = 1_000_000


def _storable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError("text must be valid Unicode (no lone surrogates)") from None
    if "\0" in text:
        raise UserError("text must not contain NUL characters")
    return text


Text = Annotated[str, AfterValidator(_storable)]
Short = Annotated[str, Field(max_length=256), AfterValidator(_storable)]
Arg = Annotated[str, Field(min_length=1, max_length=65536), AfterValidator(_storable)]
EnvKey = Annotated[str, Field(min_length=1, max_length=1024, pattern=r"^[^=]+$"), AfterValidator(_storable)]
EnvValue = Annotated[str, Field(max_length=65536), AfterValidator(_storable)]
PriorityText = Annotated[str, Field(min_length=1, max_length=32), AfterValidator(_storable)]
PriorityNumber = Annotated[int, Field(ge=0, le=1000)]

TaskState = Literal["queued", "running", "suspending", "held", "finished"]


class Error(BaseModel):
    detail: str = Field(description="what went wrong, in one line")


class Health(BaseModel):
    ok: bool


class Me(BaseModel):
    user: str
    admin: bool


class Task(BaseModel):
    """The latest attempt of a chain, or one attempt of it (``attempts`` in a description)."""

    id: int = Field(description="the chain's id: the one users refer to, stable across attempts")
    task_id: int = Field(description="this attempt's own id")
    attempt: int
    name: str
    user: str
    group: str
    priority: str = Field(description="HAI's priority name, e.g. NORMAL or HIGH")
    nodes: int
    ranks_per_node: int
    command: list[str]
    state: TaskState
    outcome: str = Field(description="the state, or how the attempt ended: succeeded, failed, stopped, suspended, "
                                     "unschedulable, restarted")
    assigned: list[str]
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    stop_code: int
    stop: str | None
    detail: str
    whole_life_state: int
    handle: str | None
    fault_tolerant: bool = Field(False, description="each node a replica: a lost node is replaced, the task goes on")


class Replica(BaseModel):
    """One replica of a fault-tolerant task's latest attempt."""

    slot: int = Field(description="the replica's place in the job's layout")
    name: str = Field(description="its ranks' FIREFLYER_NODE_ID: node{slot}, wherever it runs")
    node: str = Field(description="the node it runs (or last ran) on")
    state: str = Field(description="starting, running, done (its ranks exited 0) or lost")
    restarts: int = Field(description="times it was started again on another node in this attempt")
    started_at: float | None
    ended_at: float | None
    detail: str


class Quorum(BaseModel):
    id: int = Field(description="torchft's quorum id")
    replicas: list[str] = Field(description="the replicas (node{slot}) in the Lighthouse's last quorum")
    at: float | None = Field(description="when the supervisor saw this quorum first")


class Event(BaseModel):
    task_id: int
    at: float
    kind: str
    detail: str


class TaskDetail(Task):
    attempts: list[Task]
    events: list[Event]
    logs: str = Field(description="the latest attempt's log directory, on the server's filesystem")
    replicas: list[Replica] | None = Field(None, description="a fault-tolerant task's replicas")
    quorum: Quorum | None = Field(None, description="a running fault-tolerant task's current quorum")


class TaskPage(BaseModel):
    tasks: list[Task]
    total: int = Field(description="tasks matching the filters, over all pages")
    limit: int
    offset: int


class Logs(BaseModel):
    task_id: int
    attempt: int
    rank: int
    text: str
    state: TaskState


class Submit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nodes: int = Field(ge=1, le=MAX_NODES, description="whole nodes the task needs (all or nothing)")
    command: list[Arg] = Field(min_length=1, max_length=4096, description="the program and its arguments")
    priority: PriorityText | PriorityNumber = Field("NORMAL", description="a priority name or its number")
    group: Short = "default"
    name: Short = ""
    ranks_per_node: int | None = Field(None, ge=1, le=MAX_RANKS, description="default: the platform's")
    env: dict[EnvKey, EnvValue] = Field(default_factory=dict, max_length=4096)
    request_id: Short | None = Field(None, description="idempotency key: resubmitting it returns the first task")
    cwd: Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(_storable)] | None = Field(
        None, description="working directory on the server's filesystem (default: the server's)")
    user: Short | None = Field(None, description="submit for another user (admins only)")
    fault_tolerant: StrictBool = Field(False, description="each node a replica (torchft): a node that dies or is drained "
                                                    "is replaced while the others go on; at least 2 nodes")


class Node(BaseModel):
    name: str
    zone: str
    state: Literal["idle", "busy", "drained", "unhealthy"]
    healthy: bool
    drained: bool
    reason: str
    task: int | None = Field(description="the chain running on the node")


class Drain(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: Annotated[str, Field(min_length=1, max_length=1024), AfterValidator(_storable)] = "drained by an admin"


class Drained(BaseModel):
    node: str
    drained: bool


class NodeCounts(BaseModel):
    total: int
    busy: int
    idle: int
    drained: int
    unhealthy: int


class QuotaUse(BaseModel):
    user: str
    group: str
    priority: str
    used: int = Field(description="nodes the user's running tasks hold at this priority")
    quota: int | None = Field(description="the user's quota (or the public one), else the platform's default "
                                          "quota, beyond which tasks only borrow idle nodes; null: unlimited")


class Bucket(BaseModel):
    at: float = Field(description="the bucket's end, epoch seconds")
    busy: float = Field(description="busy nodes, time-averaged over the bucket")
    total: int


class Overview(BaseModel):
    nodes: NodeCounts
    utilisation: float = Field(description="busy / usable nodes now")
    queue_by_priority: dict[str, int]
    running_by_priority: dict[str, int]
    quota_use: list[QuotaUse]
    history: list[Bucket]
