"""The training loop of one rank of a fault-tolerant run: every node a torchft replica group.

:class:`FaultTolerantTrainer` is the :class:`~fireflyer.train.trainer.Trainer` with its step
and evaluation replaced (see :mod:`fireflyer.train.fault_tolerant` for the design): before
each step the rank joins torchft's quorum (healing from a live replica if it is behind),
computes the aligned blocks of the step's micro-batches the quorum gives it, gathers every
block's sum and adds them in the canonical tree; the optimizer steps only if torchft commits.
A step that fails (a replica lost during it) is redone by the next quorum.

The node's own ranks are the default process group; the cross-replica group is torchft's. The
model is laid out over the node's ranks as any run's is (:class:`~fireflyer.train.parallel.RankModel`):
the dense model whole on each rank, held bare, its gradients summed here.
The checkpoint on disk is written by the first replica of the quorum (its node's ranks), and
``run.json`` by its rank 0; every replica evaluates on its own.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fireflyer.errors import UserError
from fireflyer.hfreduce.plans.canonical import PairwiseAccumulator, canonical_sum
from fireflyer.train import state as saved
from fireflyer.train.config import TrainConfig
from fireflyer.train.data import TrainingData
from fireflyer.train.fault_tolerant import (Failure, LeftBehind, Record, Replica, StepPlan, micro_blocks,
                                            node_index, restarts, tree_over_blocks)
from fireflyer.fsutil import write_json
from fireflyer.train.model import lm_loss
from fireflyer.train.progress import StepStats, Throughput, make_progress
from fireflyer.train.trainer import History, Placement, Trainer

COLLECTIVE_TIMEOUT = 15.0
"""Seconds a cross-replica collective may wait; a lost replica is usually named within a second."""
QUORUM_TIMEOUT = 60.0
"""Seconds a quorum (and a heal) may take."""
READY_ENV = "FIREFLYER_FT_READY"
"""A folder where each replica says it is built (``fireflyer train --fault-tolerant`` makes it fresh)."""


class _RunFinished(Exception):
    """The checkpoint on disk is the run's last step: the live replicas finished while this one was joining."""


class FaultTolerantTrainer(Trainer):
    """A :class:`Trainer` whose steps survive the loss of replicas (``cfg.run.fault_tolerant``)."""

    def __init__(self, cfg: TrainConfig, where: Placement, *, resume: int | None = None,
                 fail_at: int | None = None) -> None:
        self._saved_record: dict[str, Any] | None = None
        """The fault-tolerance record of the checkpoint this rank started from."""
        super().__init__(cfg, where, resume=resume, fail_at=fail_at)
        self.params = list(self.model.parameters())
        self.width = sum(p.numel() for p in self.params) + 1  # the gradient, then the loss
        self.replica = Replica(replica_id=where.node, configured=cfg.parallelism.nodes, micro_batches=cfg.micro_batches,
                               canonical=cfg.parallelism.order == "canonical", state=self._live_state, load=self._load_live,
                               timeout=min(COLLECTIVE_TIMEOUT, cfg.run.timeout), quorum_timeout=min(QUORUM_TIMEOUT, cfg.run.timeout))
        self.replica.set_step(self.start_step)
        if self._saved_record:  # the checkpoint's record; a heal from a live replica brings a newer one
            self.replica.record = Record(**{k: v for k, v in self._saved_record.items()
                                            if k in {f.name for f in fields(Record)}})
        if restarts() == 0:
            self._wait_for_replicas()
        self.writer = where.node
        """The replica that writes the checkpoint and run.json: the quorum's first."""
        self._open: dict[str, Any] | None = None
        """A failure not yet recovered from: its record, until the next committed step."""
        self._last_commit = time.time()

    def _wait_for_replicas(self) -> None:
        """A first start waits (up to the quorum timeout) for every configured replica to be built, so the first
        quorum has them all rather than whichever started first; a restarted replica joins the live ones."""
        ready = os.environ.get(READY_ENV)
        if not ready:
            return
        if self.where.rank == 0:
            folder = Path(ready)
            (folder / self.where.node).touch()
            deadline = time.monotonic() + min(QUORUM_TIMEOUT, self.cfg.run.timeout)
            while len(list(folder.iterdir())) < self.cfg.parallelism.nodes and time.monotonic() < deadline:
                time.sleep(0.02)
        dist.barrier()

    def _state(self, step: int) -> dict[str, Any]:
        state = super()._state(step)
        # a restart of every node still knows the run's failures; per rank, as its times are (a sharded checkpoint
        # keeps what differs between ranks only under keys of their own)
        state["fault_tolerance"] = {f"rank{self.where.rank}": asdict(self.replica.record)}
        return state

    def _take(self, state: dict[str, Any]) -> int:
        records = state.get("fault_tolerance") or {}
        self._saved_record = records.get(f"rank{self.where.rank}") or next(iter(records.values()), None)
        return super()._take(state)

    def _restore(self, step: int) -> int:
        """A first start loads ``step`` as any run does; a restarted node loads the newest checkpoint, which the
        live replicas' saving may replace while it loads: the node's ranks then agree on the newer one."""
        if restarts() == 0:
            return super()._restore(step)
        for _ in range(5):
            try:
                got, ok = super()._restore(step), 1
            except UserError:
                got, ok = 0, 0
            flag = torch.tensor([ok], dtype=torch.int64)
            dist.all_reduce(flag)
            if int(flag.item()) == self.where.world_size:
                return got
            box = [saved.latest_step(self.cfg.run.out) if self.where.rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                break
            step = box[0]
        raise UserError(f"the restarted {self.where.node} could not load a checkpoint from {saved.ckpt_dir(self.cfg.run.out)}")

    # ------------------------------------------------------------------ building
    def _build_data(self) -> None:
        w, cfg = self.where, self.cfg
        rank = node_index(w.node) * cfg.parallelism.ranks_per_node + w.rank  # this rank's place in the configured layout
        self.data = TrainingData.open(cfg, rank=rank, world_size=cfg.world_size, device=w.device)
        self.tokenizer = self.data.tokenizer
        self._notes: list[str] = []

    # ------------------------------------------------------------------ the state a heal moves
    def _live_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "history": self.history.to_dict(),
                "record": asdict(self.replica.record) if hasattr(self, "replica") else {}}

    def _load_live(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        h = state["history"]
        self.history = History(loss=list(h["loss"]), lr=list(h["lr"]), val=[list(v) for v in h["val"]],
                               experts=[dict(e) for e in h.get("experts", [])])
        mine, theirs = self.replica.record, state.get("record") or {}
        for name in ("failures", "quorums"):
            setattr(mine, name, list(theirs.get(name, [])))
        mine.heals = list(theirs.get("heals", []))
        mine.dropped_micro_batches = int(theirs.get("dropped_micro_batches", 0))
        mine.redone_steps = int(theirs.get("redone_steps", 0))

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any]:
        cfg, rank = self.cfg, self.where.rank
        if self.start_step >= self.end_step:  # restarted after the live replicas finished the run: nothing left
            if rank == 0:
                print(f"{self.where.node}: the run finished (step {self.end_step} is committed) while this node "
                      "restarted; nothing left to do", flush=True)
            dist.barrier()
            return {}
        if self.start_step == 0:
            self._evaluate(0)
        bar = make_progress(rank=rank, first=self.start_step + 1, total=cfg.run.steps)
        if self.resumed_from is not None:
            bar.note(f"resumed at step {self.start_step} from {saved.ckpt_dir(cfg.run.out)}")
        rate = Throughput()
        finished: _RunFinished | None = None
        try:
            while self.replica.current_step() < self.end_step:
                t0 = time.perf_counter()
                plan = self._begin(bar)
                if plan is None:  # the quorum failed as it formed
                    self.replica.commit()
                    continue
                if plan.step > self.end_step:
                    break
                if plan.step == self.fail_at:
                    raise RuntimeError(f"injected failure on {self.where.node} rank {rank} at step {plan.step}")
                done = self._train_step_ft(plan)
                if done is None:
                    self._failed(plan, bar)
                    continue
                loss, lr = done
                self._recovered(bar)
                step = plan.step
                seconds = time.perf_counter() - t0
                self.timing["train_s"] += seconds
                bar.update(StepStats(step, loss, lr, rate.add(seconds, cfg.tokens_per_step), 0.0, None))
                if cfg.data.eval_interval and step % cfg.data.eval_interval == 0 and step != self.end_step:
                    bar.note(f"step {step}: val loss {self._evaluate(step):.4f}")
                if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 and step != self.end_step:
                    self._save(step)
        except _RunFinished as done:  # the live replicas ended the run as this one came back: not a failure
            finished = done
        finally:
            bar.close()
        if finished is not None:
            self.writer = ""  # a live replica wrote the run's record; this one says only that it is done
            if rank == 0:
                print(finished, flush=True)
            dist.barrier()
            return {}
        if not self.history.val or self.history.val[-1][0] != self.end_step:
            self._evaluate(self.end_step)
        self._save(self.end_step)
        self.ckpt.wait()
        reader = self._reader_stats()
        laid = self._layout_summary()  # a collective over the node's ranks
        record = self._record(reader, laid) if rank == 0 and self.writer == self.where.node else {}
        if record:
            write_json(Path(cfg.run.out) / "run.json", record)
        dist.barrier()
        return record

    def _begin(self, bar: Any) -> StepPlan | None:
        """The next quorum's plan; a quorum without a replica of the last one is a failure, recorded."""
        before = list(self.replica.record.quorums[-1]["replicas"]) if self.replica.record.quorums else None
        try:
            plan = self.replica.begin()
        except TimeoutError:  # this node was paused past its quorum's deadline (frozen, stopped) and may wake late
            latest = saved.latest_step(self.cfg.run.out)  # each rank reads it: a finished run's last step is final
            if latest is not None and latest >= self.end_step:
                raise _RunFinished(f"{self.where.node}: the run finished (step {latest} is committed) while this "
                                   "node waited for its quorum; nothing left to do") from None
            raise
        if plan is None:
            return None
        if plan.replicas != before:
            self._check_not_left_behind(plan)
        self.writer = plan.replicas[0]
        lost = [r for r in (before or []) if r not in plan.replicas]
        if lost:
            if self._open is None:  # left between steps: no step saw it fail
                self._open = asdict(Failure(step=plan.step, at=self._last_commit, replicas_before=len(before or []),
                                            replicas_after=len(plan.replicas), lost=lost,
                                            error="left the quorum between steps"))
            else:
                self._open.update(replicas_after=len(plan.replicas), lost=lost)
            bar.note(f"step {plan.step}: {', '.join(lost)} lost; going on with {len(plan.replicas)} of "
                     f"{self.cfg.parallelism.nodes} replicas")
        joined = [r for r in plan.replicas if before is not None and r not in before]
        if joined:
            bar.note(f"step {plan.step}: {', '.join(joined)} joined; {len(plan.replicas)} replicas")
        return plan

    def _check_not_left_behind(self, plan: StepPlan) -> None:
        """A new quorum whose step is not past the newest checkpoint on disk holds no replica that committed it:
        the live replicas went on without this one (its node stopped past the timeout, then resumed) and may have
        finished. Going on would redo their steps alone and write checkpoints they already wrote; the node's
        ranks restart instead, from that checkpoint (rank 0 reads it for the node, so its ranks agree)."""
        box = [saved.latest_step(self.cfg.run.out) if self.where.rank == 0 else None]
        if self.where.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        if box[0] is not None and box[0] >= self.end_step:
            raise _RunFinished(f"{self.where.node}: the run finished (step {box[0]} is committed) while this node "
                               "joined; nothing left to do")
        if box[0] is not None and box[0] >= plan.step:
            raise LeftBehind(f"{self.where.node} was left behind: its quorum {plan.replicas} is at step "
                             f"{plan.step - 1}, the checkpoint on disk at step {box[0]}; restarting from it")

    def _failed(self, plan: StepPlan, bar: Any) -> None:
        self.replica.record.redone_steps += 1
        if self._open is None:
            self._open = asdict(Failure(step=plan.step, at=time.time(), replicas_before=len(plan.replicas),
                                        replicas_after=len(plan.replicas), lost=[], error=self.replica.error()))
        bar.note(f"step {plan.step} failed ({self._open['error'][:200]}); redoing it in the next quorum")

    def _recovered(self, bar: Any) -> None:
        self._last_commit = time.time()
        if self._open is not None:
            self._open["recovered_s"] = self._last_commit - self._open["at"]
            self.replica.record.failures.append(self._open)
            bar.note(f"step {self._open['step']} done {self._open['recovered_s']:.1f} s after the failure")
            self._open = None

    def _train_step_ft(self, plan: StepPlan) -> tuple[float, float] | None:
        """This rank's blocks of the step, gathered and summed in the canonical tree; None if not committed."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        sums = []
        for start, size in plan.mine:
            grads, losses = PairwiseAccumulator(), PairwiseAccumulator()
            for g in range(start, start + size):
                for p in self.params:
                    p.grad.zero_()  # each micro-batch from zeroed gradients, as DDP's canonical step
                loss = lm_loss(self.model, self.data.micro_batch("train", g, at=plan.step))
                loss.backward()
                grads.add(torch.cat([p.grad.reshape(-1) for p in self.params]))
                losses.add(loss.detach().float())
            sums.append(torch.cat([grads.result(keep_accumulator=True),
                                   losses.result(keep_accumulator=True).reshape(1)]))
        every = self.replica.gather(plan, sums, self.width)
        if every is not None:
            total = tree_over_blocks(plan.total, plan.blocks, every) if self.replica.canonical else \
                canonical_sum(every, keep_accumulator=True)
            mean = total.div_(plan.total)
        if not self.replica.commit() or every is None:
            return None
        self.replica.record.dropped_micro_batches += plan.dropped
        with torch.no_grad():
            offset = 0
            for p in self.params:
                p.grad.copy_(mean[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        if self.cfg.optimizer.grad_clip:  # as the plain data-parallel run clips: its bits
            self.net.clip(self.cfg.optimizer.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.history.loss.append(mean[-1].item())
        self.history.lr.append(lr)
        return self.history.loss[-1], lr

    @torch.no_grad()
    def _evaluate(self, step: int) -> float:
        """The validation loss, computed by this replica alone (its node's ranks split the micro-batches) in the
        canonical tree: the same bits on every replica and as a run that never failed."""
        t0 = time.perf_counter()
        M, R = self.cfg.global_micro_batches, self.where.world_size
        blocks, shares = micro_blocks(M, R)
        slots = torch.full((self.cfg.data.eval_batches, len(blocks)), -0.0)
        self.model.eval()
        for i in range(self.cfg.data.eval_batches):
            for b in shares[self.where.rank]:
                start, size = blocks[b]
                acc = PairwiseAccumulator()
                for g in range(start, start + size):
                    acc.add(lm_loss(self.model, self.data.micro_batch("val", g, at=i)).float())
                slots[i, b] = acc.result()
        self.model.train()
        if R > 1:
            dist.all_reduce(slots)
        sums = [tree_over_blocks(M, blocks, list(row.unbind())) for row in slots]
        mean = canonical_sum(sums) / (self.cfg.data.eval_batches * M)
        self.history.val.append([step, mean.item()])
        self.timing["eval_s"] += time.perf_counter() - t0
        return self.history.val[-1][1]

    def _save(self, step: int) -> None:
        """The quorum's first replica writes the checkpoint (its node's ranks, each a share)."""
        if self.writer == self.where.node:
            super()._save(step)

    def _record(self, reader: dict[str, float], laid: dict[str, Any]) -> dict[str, Any]:
        record = super()._record(reader, laid)
        record["world"]["world_size"] = self.cfg.world_size  # every replica's ranks, not this node's
        r = self.replica.record
        record["fault_tolerance"] = {"replicas": self.cfg.parallelism.nodes, "order": self.cfg.parallelism.order, **asdict(r),
                                     "restarts_of_this_node": restarts()}
        return record

    def close(self) -> None:
        try:
            self.replica.shutdown()
        finally:
            super().close()
