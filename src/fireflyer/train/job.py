"""One rank of ``fireflyer train``, as torchrun starts it on every rank of every node.

``python -m fireflyer.train.job --config OUT/config.json [--resume STATE]``: reads the
resolved config the launcher wrote, joins the job's hfreduce process group (its place,
:func:`fireflyer.launch.this_rank`, comes from torchrun's variables, and
``FIREFLYER_NODE_ID`` tells emulated nodes apart), picks its device and thread count,
and runs the :class:`~fireflyer.train.trainer.Trainer`. As a platform task there is no
launcher: ``fireflyer train`` calls :func:`run_managed` in every rank instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

import fireflyer.hfreduce  # noqa: F401 - registers backend "hfreduce"
from fireflyer import lifetime
from fireflyer.cliutil import plural
from fireflyer.errors import UserError
from fireflyer.launch import this_rank, threads_per_rank
from fireflyer.lifetime import Stopped
from fireflyer.train.config import TrainConfig
from fireflyer.train.env import injected_failure
from fireflyer.train.trainer import COLLECTIVE_TIMEOUT, Placement, Trainer


def place(cfg: TrainConfig) -> Placement:
    """This rank's place in the job, from torchrun's environment; sets its device and torch threads."""
    me = this_rank()
    rank, world, local_rank = me.rank, me.world_size, me.local_rank
    use_cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    if cfg.parallelism.order == "canonical" and use_cuda:  # before CUDA starts: cuBLAS's fixed-order workspace
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if use_cuda:
        if not torch.cuda.is_available():
            raise UserError("device = 'cuda' but this node has no CUDA device; use device = 'auto' or 'cpu'")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # The launcher sets OMP_NUM_THREADS so the node's ranks share its cores without oversubscribing.
    # In the canonical order one thread per rank: a kernel's bits may depend on how many threads split it.
    threads = 1 if cfg.parallelism.order == "canonical" else \
        int(os.environ.get("OMP_NUM_THREADS") or threads_per_rank(me.local_world_size))
    torch.set_num_threads(threads)
    return Placement(rank=rank, world_size=world, local_rank=local_rank,
                     node=me.node, device=device, threads=threads)


def train(trainer_of: Callable[[], Trainer], announce: Callable[[Trainer], None] | None = None) -> Trainer:
    """Build the trainer and run it; however the run ends, a save in flight is finished first.

    A stop signal (:func:`fireflyer.lifetime.graceful`) or a failure, here or a peer's, leaves
    the save in flight to be persisted (and, on rank 0, committed) before the error goes on up:
    waited for here, in the main thread, within the stop's grace, and not at interpreter exit,
    where its writer threads could no longer start.
    """
    trainer = None
    try:
        trainer = trainer_of()
        try:
            if announce is not None:
                announce(trainer)
            trainer.run()
        finally:
            trainer.close()
        return trainer
    except BaseException as failure:
        if trainer is not None:
            stop = _finish_save(trainer)
            if stop is not None and stop is not failure:  # the stop came while the save was waited for: it is
                raise stop from None                      # what ended the run, whatever failed just before
        raise


def _finish_save(trainer: Trainer) -> Stopped | None:
    """Wait (within the stop's grace) for the save in flight; a stop signal that comes meanwhile does not cut
    the wait short (a peer's failure, then this rank's SIGTERM, is the usual order). Returns that stop."""
    deadline = time.monotonic() + lifetime.grace_from_env()
    stop = None
    while True:
        try:
            trainer.ckpt.wait(timeout=max(0.0, deadline - time.monotonic()))
            return stop
        except Stopped as exc:  # one only: the handler ignores later stop signals
            stop = exc
        except Exception as exc:  # noqa: BLE001 - the stop or the failure is what goes on up; the lost save is said
            print(f"rank {trainer.where.rank}: {exc}", file=sys.stderr, flush=True)
            return stop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fireflyer.train.job", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="resolved config JSON written by 'fireflyer train'")
    p.add_argument("--resume", type=int, default=None, help="committed step to continue from")
    args = p.parse_args(argv)
    lifetime.graceful()  # SIGTERM from the agent: finish the save in flight, then go
    cfg = TrainConfig.from_json(args.config)
    where = place(cfg)
    try:
        dist.init_process_group("hfreduce", timeout=timedelta(seconds=min(COLLECTIVE_TIMEOUT, cfg.run.timeout)))
        try:
            if cfg.run.fault_tolerant:
                train(lambda: _fault_tolerant(cfg, where, args.resume))
            else:
                train(lambda: Trainer(cfg, where, resume=args.resume, fail_at=injected_failure(where.rank)))
        finally:
            dist.destroy_process_group()
    except Stopped as exc:
        print(f"rank {where.rank}: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


def _fault_tolerant(cfg: TrainConfig, where, resume: int | None) -> Trainer:
    """One replica group's rank; restarted by its agent, it starts from the newest checkpoint on disk (and a
    live replica heals it to the quorum's step)."""
    from fireflyer.train import state as saved
    from fireflyer.train.fault_tolerant import node_index, restarts
    from fireflyer.train.ft_experts import FaultTolerantMoETrainer
    from fireflyer.train.ft_trainer import FaultTolerantTrainer

    fail_at = injected_failure(node_index(where.node) * cfg.parallelism.ranks_per_node + where.rank)
    if restarts() > 0:
        fail_at = None  # an injected failure happens once
        box = [saved.latest_step(cfg.run.out) if where.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)  # the node's ranks start from one step
        resume = box[0] if box[0] is not None else resume
    kind = FaultTolerantMoETrainer if cfg.model.kind == "moe" else FaultTolerantTrainer
    return kind(cfg, where, resume=resume, fail_at=fail_at)


def run_managed(config: str | None, overrides: dict, *, resume: bool, overwrite: bool = False) -> int:
    """``fireflyer train`` as a platform task: this process is one rank the platform started.

    The platform gives every rank torchrun's environment, so there is nothing to launch:
    the ranks join one hfreduce group, rank 0 readies the out directory and shares the
    resolved config, and all train. A later attempt of the task's chain (after a suspend
    or a restart) continues from the newest committed checkpoint in the out directory;
    a first attempt starts afresh unless ``--resume`` is given, and is refused where the out
    directory holds another run, unless ``--overwrite`` is given. A suspend command is
    answered by saving the current step and stopping (``Trainer(managed=True)``).
    """
    import time

    from fireflyer.errors import UserError
    from fireflyer.platform import client
    from fireflyer.platform import env as names
    from fireflyer.fsutil import write_json

    if os.environ.get(names.REPLICA):  # a fault-tolerant task: this rank is one of a replica's
        return run_replica(config, overrides, resume=resume, overwrite=overwrite)
    lifetime.graceful()  # the platform stops a task's ranks with SIGTERM, then SIGKILL: the save in flight commits
    overrides = {**overrides, "nodes": client.nnodes(), "ranks_per_node": this_rank().local_world_size}
    rank = client.rank()
    dist.init_process_group("hfreduce", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT))
    try:
        box: list = [None]
        if rank == 0:
            try:
                cfg, resume_from = resolve_attempt(config, overrides, resume=resume, overwrite=overwrite)
                if cfg.run.fault_tolerant:
                    raise UserError("fault_tolerant under the platform needs a task submitted with 'fireflyer submit "
                                    "--fault-tolerant' (the platform then runs and replaces each node's replica)")
                write_json(cfg.out_dir / "config.json", cfg.to_dict())
                box = [(cfg.to_dict(), resume_from, None)]
            except (UserError, ValueError) as exc:
                box = [(None, None, str(exc))]
        dist.broadcast_object_list(box, src=0)
        cfg_dict, resume_from, error = box[0]
        if error is not None:
            raise UserError(error)
        cfg = TrainConfig.from_dict(cfg_dict)
        where = place(cfg)
        if rank == 0:
            first = 1 if resume_from is None else resume_from + 1
            print(f"fireflyer train: platform task {client.chain_id()} attempt {client.attempt()}: "
                  f"{plural(cfg.parallelism.nodes, 'node')} x {plural(cfg.parallelism.ranks_per_node, 'rank')}, steps {first}-{cfg.run.stop_at or cfg.run.steps}, "
                  f"out {cfg.out_dir}/", flush=True)
            print(f"fireflyer train: {cfg.describe_batch()}", flush=True)
        t0 = time.monotonic()
        train(lambda: Trainer(cfg, where, resume=resume_from, fail_at=injected_failure(where.rank), managed=True),
              announce=(lambda t: print(f"fireflyer train: {t.data.prepared.summary()}", flush=True))
              if rank == 0 else None)
        if rank == 0:
            print_summary(cfg.out_dir, t0)
    finally:
        dist.destroy_process_group()
    return 0


def print_summary(out_dir: Path, t0: float) -> None:
    """The run's summary and loss plot from its ``run.json`` (``t0``: when training began, monotonic)."""
    import time

    from fireflyer.train import report

    run = report.load_run(out_dir)
    png = report.plot_losses(run, out_dir / "loss.png")
    print(report.summary(run, wall_s=time.monotonic() - t0, out=out_dir, png=png), flush=True)


def resolve_attempt(config: str | None, overrides: dict, *, resume: bool, overwrite: bool
                    ) -> tuple[TrainConfig, int | None]:
    """The run of a platform attempt: a later attempt of the chain goes on from the newest checkpoint, and may
    replace what an earlier one left without a checkpoint."""
    from fireflyer.platform import client
    from fireflyer.train import state as saved
    from fireflyer.train.config import builtin_config, read_toml
    from fireflyer.train.outdir import resolve

    out = overrides.get("out") or read_toml(config or builtin_config("demo")).get("out") or \
        TrainConfig.from_toml(builtin_config("demo")).run.out
    go_on = resume or (client.attempt() > 0 and saved.latest_step(out) is not None)
    return resolve(config, overrides, resume=go_on, overwrite=overwrite or client.attempt() > 0)


REPLICA_CONFIG_WAIT_S = 120.0
"""How long a replica waits for replica 0 to resolve the run's config (it may start well after the others)."""


def run_replica(config: str | None, overrides: dict, *, resume: bool, overwrite: bool = False) -> int:
    """``fireflyer train`` as one rank of a replica of a fault-tolerant platform task (``fireflyer submit
    --fault-tolerant``): the replica's ranks are a world of their own, and the platform started torchft's
    Lighthouse and names the replica (``FIREFLYER_NODE_ID`` = ``node{slot}``) as ``fireflyer train
    --fault-tolerant``'s launcher does.

    Replica 0 resolves the run (as :func:`run_managed`'s rank 0 does) and leaves the result in the attempt's
    folder (``ft/config.json``); the others, and a replica the platform started again on another node, read
    it there. A replica started again (``TORCHELASTIC_RESTART_COUNT`` > 0) loads the newest checkpoint and
    heals from a live one. The replica that wrote ``run.json`` prints the summary.
    """
    import json
    import time

    from fireflyer.platform import client
    from fireflyer.platform import env as names
    from fireflyer.fsutil import write_json

    lifetime.graceful()
    me = this_rank()
    slot = int(os.environ[names.REPLICA])
    shared = Path(os.environ[names.TASK_DIR]) / "ft" / "config.json"
    overrides = {**overrides, "nodes": client.nnodes(), "ranks_per_node": me.local_world_size, "fault_tolerant": True}
    dist.init_process_group("hfreduce", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT))
    try:
        box: list = [None]
        if me.rank == 0:
            if slot == 0 and not shared.exists():
                try:
                    cfg, resume_from = resolve_attempt(config, overrides, resume=resume, overwrite=overwrite)
                    write_json(cfg.out_dir / "config.json", cfg.to_dict())
                    got = {"config": cfg.to_dict(), "resume_from": resume_from, "error": None}
                except (UserError, ValueError) as exc:
                    got = {"config": None, "resume_from": None, "error": str(exc)}
                write_json(shared, got)
            else:
                deadline = time.monotonic() + REPLICA_CONFIG_WAIT_S
                while not shared.exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
                if not shared.exists():
                    got = {"error": f"replica 0 did not resolve the run's config within {REPLICA_CONFIG_WAIT_S:g} s"}
                else:
                    got = json.loads(shared.read_text())
            box = [got]
        dist.broadcast_object_list(box, src=0)
        got = box[0]
        if got.get("error"):
            raise UserError(got["error"])
        cfg = TrainConfig.from_dict(got["config"])
        resume_from = got["resume_from"]
        where = place(cfg)
        if me.rank == 0:
            first = 1 if resume_from is None else resume_from + 1
            again = f", started again (start {os.environ.get(names.RESTART_COUNT)})" \
                if os.environ.get(names.RESTART_COUNT, "0") != "0" else ""
            print(f"fireflyer train: platform task {client.chain_id()} attempt {client.attempt()}: replica {where.node} "
                  f"of {cfg.parallelism.nodes} on {os.environ.get(names.PLATFORM_NODE, '?')}{again}, "
                  f"{plural(cfg.parallelism.ranks_per_node, 'rank')}, steps {first}-{cfg.run.stop_at or cfg.run.steps}, out {cfg.out_dir}/",
                  flush=True)
        t0 = time.monotonic()
        trainer = train(lambda: _fault_tolerant(cfg, where, resume_from))
        trained = trainer.start_step < trainer.end_step  # not a replica that came back after the run ended
        if me.rank == 0 and trained and getattr(trainer, "writer", None) == where.node and \
                (cfg.out_dir / "run.json").exists():
            print_summary(cfg.out_dir, t0)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
