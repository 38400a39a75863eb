"""How an attempt's ranks start: the supervisor's starters, kept together.

* :func:`local_ranks`: every rank on this machine, each emulated node telling its ranks
  apart by name; each rank's torchrun variables come from :func:`fireflyer.launch.rank_env`.
* :func:`srun_ranks`: every rank with one ``srun`` inside the attempt's Slurm allocation
  (the supervisor's starter under ``--slurm``).

Both start the rank shim (``python -m fireflyer.platform.attempt.rank``) with :func:`task_env`,
the variables every rank of an attempt shares.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Callable

from fireflyer import lifetime
from fireflyer.launch import rank_env, threads_per_rank
from fireflyer.platform import env as names
from fireflyer.platform.executors.base import Launch
from fireflyer.platform.layout import AttemptDir

Procs = list[tuple[str, subprocess.Popen]]
Starter = Callable[[Launch, AttemptDir], Procs]


def task_env(launch: Launch, adir: AttemptDir) -> dict[str, str]:
    """The variables every rank of an attempt shares (the torchrun ones are added by each starter)."""
    return {
        **launch.env,
        names.NNODES: str(len(launch.nodes)),
        names.TASK_ID: str(launch.task_id),
        names.CHAIN_ID: str(launch.chain_id),
        names.ATTEMPT: str(launch.attempt),
        names.JOB_SECRET: adir.job_secret(),
        names.TASK_NAME: launch.name,
        names.USER: launch.user,
        names.TASK_DIR: str(adir.root),
        names.LOG_DIR: str(adir.logs),
        names.WHOLE_LIFE_STATE: str(launch.whole_life_state),
        "TORCHELASTIC_RUN_ID": f"fireflyer-{launch.task_id}",
        "PYTHONUNBUFFERED": "1",
    }


def _rank_command(launch: Launch, adir: AttemptDir) -> list[str]:
    return [sys.executable, "-m", "fireflyer.platform.attempt.rank", str(adir.root), "--", *launch.command]


def local_ranks(launch: Launch, adir: AttemptDir) -> Procs:
    """Start every rank on this machine, each emulated node telling its ranks apart by name."""
    # the ranks' grace on a stop is the supervisor's: SIGTERM, kill_grace seconds, then SIGKILL
    base = {**os.environ, **task_env(launch, adir), lifetime.GRACE: f"{launch.timeouts.kill_grace:g}"}
    if "OMP_NUM_THREADS" not in launch.env:  # every emulated node shares this machine's cores
        base["OMP_NUM_THREADS"] = str(threads_per_rank(launch.world_size))
    procs: Procs = []
    for node_rank, node in enumerate(launch.nodes):
        for local_rank in range(launch.ranks_per_node):
            rank = node_rank * launch.ranks_per_node + local_rank
            env = {**base, **rank_env(rank=rank, world_size=launch.world_size, local_rank=local_rank,
                                      local_world_size=launch.ranks_per_node, node=node,
                                      master_addr="127.0.0.1", master_port=launch.master_port)}
            proc = subprocess.Popen(_rank_command(launch, adir), env=env, cwd=launch.cwd, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=lifetime.tied_to_me(signal.SIGTERM))
            procs.append((f"rank{rank}", proc))
    return procs


def srun_ranks(launch: Launch, adir: AttemptDir) -> Procs:
    """Start every rank of the attempt with one ``srun`` (the supervisor's starter under ``--slurm``).

    Each task is the rank shim, which takes RANK, LOCAL_RANK, GROUP_RANK and the node's
    name from Slurm's variables. MASTER_ADDR is the first node of the allocation. A rank
    that fails makes srun stop the others (``--kill-on-bad-exit=1``), as the local
    supervisor stops every rank after a failure: peers of a dead rank would otherwise
    hang in their next collective until the watchdog.
    """
    from fireflyer.platform.executors.slurm import JOB_PREFIX, SlurmError, hostnames, node_addr

    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    first = hostnames(nodelist)[0] if nodelist else launch.nodes[0]
    try:
        master = node_addr(first)
    except SlurmError:
        master = first
    nnodes, per_node = len(launch.nodes), launch.ranks_per_node
    # A real cluster's ranks: Slurm tells each its rank and node; the shared rendezvous is ours to give.
    env = {**os.environ, **task_env(launch, adir), "WORLD_SIZE": str(launch.world_size),
           "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": master, "MASTER_PORT": str(launch.master_port)}
    argv = ["srun", "--nodes", str(nnodes), "--ntasks", str(nnodes * per_node),
            "--ntasks-per-node", str(per_node), "--kill-on-bad-exit=1", "--job-name",
            JOB_PREFIX + str(launch.task_id)]
    cpus = os.environ.get("SLURM_CPUS_ON_NODE", "")
    if cpus.isdigit() and int(cpus) >= per_node:
        argv += ["--cpus-per-task", str(int(cpus) // per_node)]  # the whole node, not one CPU per rank
    argv += _rank_command(launch, adir)
    with open(adir.logs / "srun.log", "ab") as log:
        proc = subprocess.Popen(argv, env=env, cwd=launch.cwd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return [("srun", proc)]


def replica_ranks(launch: Launch, adir: AttemptDir, *, slot: int, node: str, start: int, master_port: int,
                  extra: dict[str, str]) -> Procs:
    """Start one replica of a fault-tolerant attempt on this machine: the ranks of ``slot``, on ``node``.

    The replica is a torch.distributed world of its own (``RANK`` 0..ranks_per_node-1, its own
    ``MASTER_PORT``) named ``node{slot}`` (``FIREFLYER_NODE_ID``) wherever it runs, so its place in
    the job's layout never changes; ``FIREFLYER_TASK_RANK`` names its log. ``start`` counts its
    starts in this attempt (torchrun's ``TORCHELASTIC_RESTART_COUNT``). ``extra``: the Lighthouse's
    address and such, the same for every replica.
    """
    rpn = launch.ranks_per_node
    base = {**os.environ, **task_env(launch, adir), lifetime.GRACE: f"{launch.timeouts.kill_grace:g}", **extra}
    if "OMP_NUM_THREADS" not in launch.env:
        base["OMP_NUM_THREADS"] = str(threads_per_rank(launch.world_size))
    procs: Procs = []
    for local_rank in range(rpn):
        task_rank = slot * rpn + local_rank
        env = {**base, **rank_env(rank=local_rank, world_size=rpn, local_rank=local_rank, local_world_size=rpn,
                                  node=f"node{slot}", master_addr="127.0.0.1", master_port=master_port),
               names.TASK_RANK: str(task_rank), names.REPLICA: str(slot), names.PLATFORM_NODE: node,
               names.RESTART_COUNT: str(start)}
        proc = subprocess.Popen(_rank_command(launch, adir), env=env, cwd=launch.cwd, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=lifetime.tied_to_me(signal.SIGTERM))
        procs.append((f"rank{task_rank}" + (f".{start}" if start else ""), proc))
    return procs
