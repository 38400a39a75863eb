"""The training loop of one rank: data-parallel steps with haiscale DDP, evaluation, saving.

Every rank holds a full replica of the model. A step reads the rank's own batch (record
shards through the storage part, :mod:`fireflyer.train.data`), runs
forward and backward through :class:`fireflyer.haiscale.DistributedDataParallel` (whose
gradient allreduce over hfreduce overlaps backward), clips, and steps AdamW. The
reported loss is the mean over ranks. Rank 0 saves the state, writes ``run.json`` and
writes a text sample at the end; every rank takes part in every collective.

Steps are numbered from 1; ``state.step == k`` means k optimizer steps are done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fireflyer.haiscale import DistributedDataParallel
from fireflyer.train import state as saved
from fireflyer.train.config import TrainConfig
from fireflyer.train.data import SAMPLE_PROMPT, TrainingData
from fireflyer.train.files import write_json
from fireflyer.train.model import GPT, ModelShape
from fireflyer.train.optim import build_optimizer
from fireflyer.train.progress import StepStats, Throughput, make_progress
from fireflyer.errors import UserError


@dataclass
class History:
    """Per-step records of the whole run (restored on resume, so run.json covers every step)."""

    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    val: list[list[float]] = field(default_factory=list)
    """``[step, val_loss]`` pairs."""

    def to_dict(self) -> dict[str, Any]:
        return {"loss": self.loss, "lr": self.lr, "val": self.val}


@dataclass(frozen=True)
class Placement:
    """Where this rank runs."""

    rank: int
    world_size: int
    local_rank: int
    node: str
    device: torch.device
    threads: int


class Trainer:
    """Builds the data, model, DDP wrapper and optimizer for one rank, then runs the steps."""

    def __init__(self, cfg: TrainConfig, where: Placement, *, resume: int | None = None,
                 fail_at: int | None = None, managed: bool = False) -> None:
        self.cfg = cfg
        self.where = where
        self.fail_at = fail_at
        self.managed = managed
        """Run as a platform task: answer suspend commands by saving the state and stopping."""
        """A step at which to raise, as a crashing rank would (fault injection for tests)."""
        self.history = History()
        self._build_data()
        self._build_model()
        self.ckpt = saved.manager(cfg.out, rank=where.rank, world_size=where.world_size)
        self.start_step = self._restore(resume) if resume is not None else 0
        self.resumed_from = self.start_step if resume is not None else None
        self.end_step = cfg.stop_at or cfg.steps
        self.timing = {"train_s": 0.0, "eval_s": 0.0, "save_s": 0.0}

    # ------------------------------------------------------------------ building
    def _build_data(self) -> None:
        w = self.where
        self.data = TrainingData.open(self.cfg, rank=w.rank, world_size=w.world_size, device=w.device)
        self.tokenizer = self.data.tokenizer
        self._notes: list[str] = []

    def _build_model(self) -> None:
        cfg = self.cfg
        shape = ModelShape(vocab_size=self.tokenizer.vocab_size, context=cfg.context, layers=cfg.layers,
                           d_model=cfg.d_model, heads=cfg.heads)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
        self.model = GPT(shape).to(self.where.device)
        self.ddp = DistributedDataParallel(self.model, bucket_cap_mb=cfg.bucket_cap_mb)
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg)

    def _restore(self, step: int) -> int:
        state = saved.load_state(self.cfg.out, step)
        if state["vocab"] != self.tokenizer.chars:
            raise UserError(f"step {step} in {saved.ckpt_dir(self.cfg.out)} was trained on a different corpus "
                             "vocabulary; start afresh with a new --out")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["cpu"])
        if self.where.device.type == "cuda" and "cuda" in state["rng"]:
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.where.device)
        if state.get("data_hash") not in (None, self.data.prepared.key):
            self._notes.append(f"note: the training records differ from those step {step} was trained on "
                               f"({state['data_hash'][:12]} -> {self.data.prepared.key[:12]}); the data order changes")
        h = state["history"]
        self.history = History(loss=list(h["loss"]), lr=list(h["lr"]), val=[list(v) for v in h["val"]])
        return int(state["step"])

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any]:
        """Train from ``start_step`` to ``end_step``; return the run record rank 0 wrote (others: {})."""
        cfg, rank = self.cfg, self.where.rank
        if self.start_step == 0:
            self._evaluate(0)
        bar = make_progress(rank=rank, first=self.start_step + 1, total=cfg.steps)
        if self.resumed_from is not None:
            bar.note(f"resumed at step {self.start_step} from {saved.ckpt_dir(cfg.out)}")
        for text in self._notes:
            bar.note(text)
        rate = Throughput()
        try:
            for step in range(self.start_step + 1, self.end_step + 1):
                if step == self.fail_at:
                    raise RuntimeError(f"injected failure on rank {rank} at step {step}")
                t0 = time.perf_counter()
                loss, lr = self._train_step(step)
                seconds = time.perf_counter() - t0
                self.timing["train_s"] += seconds
                bar.update(StepStats(step, loss, lr, rate.add(seconds, cfg.tokens_per_step), self.allreduce_gbps()))
                if cfg.eval_interval and step % cfg.eval_interval == 0 and step != self.end_step:
                    bar.note(f"step {step}: val loss {self._evaluate(step):.4f}")
                saved_now = bool(cfg.save_every and step % cfg.save_every == 0 and step != self.end_step)
                if saved_now:
                    self._save(step)
                if self.managed and step != self.end_step:
                    self._suspend_if_requested(step, saved_now, bar)
        finally:
            bar.close()
        if not self.history.val or self.history.val[-1][0] != self.end_step:
            self._evaluate(self.end_step)
        self._save(self.end_step)
        self.ckpt.wait()  # persisted, and on rank 0 committed, before the run reports itself done
        reader = self._reader_stats()
        record = self._record(reader) if rank == 0 else {}
        if rank == 0:
            write_json(Path(cfg.out) / "run.json", record)
        dist.barrier()
        return record

    def _train_step(self, step: int) -> tuple[float, float]:
        x, y = self.data.train(step=step)
        self.optimizer.zero_grad(set_to_none=False)  # keep .grad as DDP's bucket views
        logits = self.ddp(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()  # gradients are averaged across ranks when this returns
        if self.cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        mean = loss.detach().reshape(1).float()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        self.history.loss.append(mean.item())
        self.history.lr.append(lr)
        return self.history.loss[-1], lr

    @torch.no_grad()
    def _evaluate(self, step: int) -> float:
        """Mean validation loss over every rank's fixed validation batches; recorded at ``step``."""
        t0 = time.perf_counter()
        self.model.eval()
        total = torch.zeros(1, device=self.where.device)
        for i in range(self.cfg.eval_batches):
            x, y = self.data.eval(index=i)
            total += F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.model.train()
        mean = (total / self.cfg.eval_batches).float()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        self.history.val.append([step, mean.item()])
        self.timing["eval_s"] += time.perf_counter() - t0
        return self.history.val[-1][1]

    def _suspend_if_requested(self, step: int, saved_now: bool, bar: Any) -> None:
        """The platform's suspend handshake: all ranks agree, save ``step``, and stop (see platform.client)."""
        from fireflyer.platform import client

        if client.rank() == 0 and client.receive_suspend_command():
            bar.note(f"suspend requested: saving step {step}, then stopping; the platform resumes the run later")
            bar.close()
        client.suspend_if_requested(self.ckpt, step, None if saved_now else (lambda: self._state(step)))

    def _save(self, step: int) -> None:
        """Every rank hands the (replicated) state to the checkpoint manager; the step waits for the snapshot only."""
        t0 = time.perf_counter()
        self.ckpt.save(step, self._state(step))
        self.timing["save_s"] += time.perf_counter() - t0

    def _state(self, step: int) -> dict[str, Any]:
        rng = {"cpu": torch.get_rng_state()}
        if self.where.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.where.device)
        return saved.payload(
            step,
            config=self.cfg.to_dict(),
            vocab=self.tokenizer.chars,
            data_hash=self.data.prepared.key,
            model=self.model.state_dict(),
            optimizer=self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict(),
            rng=rng,
            history=self.history.to_dict(),
        )

    # ------------------------------------------------------------------ reporting
    def allreduce_gbps(self) -> float:
        s = self.ddp.stats()
        return s["allreduce_bytes"] / s["allreduce_seconds"] / 1e9 if s["allreduce_seconds"] > 0 else 0.0

    def sample(self) -> str:
        """Text the trained model writes after :data:`SAMPLE_PROMPT`, with a generator seeded by ``seed``."""
        if not self.cfg.sample_tokens:
            return ""
        prompt = self.tokenizer.encode(SAMPLE_PROMPT).to(self.where.device)
        gen = torch.Generator(device=self.where.device).manual_seed(self.cfg.seed)
        self.model.eval()
        out = self.model.generate(prompt, self.cfg.sample_tokens, temperature=0.8, generator=gen)
        self.model.train()
        return self.tokenizer.decode(out.cpu())

    def _reader_stats(self) -> dict[str, float]:
        """The shard caches' counters over all ranks (a collective: every rank calls it)."""
        mine = self.data.reader_stats()
        total = torch.tensor([mine["demands"], mine["hits"], mine["stall_s"], mine["prefetched"]],
                             dtype=torch.float64, device=self.where.device)
        worst = torch.tensor([mine["stall_s"]], dtype=torch.float64, device=self.where.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        demands, hits, stall, prefetched = total.tolist()
        n = self.where.world_size
        return {"cache_hit_rate": hits / demands if demands else 0.0, "record_reads": int(demands),
                "stall_s": stall / n, "stall_s_max": worst.item(), "prefetched_shards": int(prefetched)}

    def _record(self, reader: dict[str, float]) -> dict[str, Any]:
        cfg, w = self.cfg, self.where
        done = self.end_step - self.start_step
        ddp = self.ddp.stats()
        t0 = time.perf_counter()
        text = self.sample()
        return {
            "config": cfg.to_dict(),
            "finished": self.end_step == cfg.steps,
            "step": self.end_step,
            "resumed_from": self.resumed_from,
            "world": {"nodes": cfg.nodes, "ranks_per_node": cfg.ranks_per_node, "world_size": w.world_size,
                      "device": str(w.device) if w.device.type == "cpu" else f"cuda x {w.world_size}",
                      "threads_per_rank": w.threads},
            "model": {"parameters": self.model.num_parameters(), "vocab_size": self.tokenizer.vocab_size},
            "data": {**self.data.describe(), "tokens_per_step": cfg.tokens_per_step, **reader},
            "history": self.history.to_dict(),
            "timing": {**self.timing, "steps_this_run": done,
                       "tokens_per_s": done * cfg.tokens_per_step / self.timing["train_s"] if done else 0.0,
                       "sample_s": time.perf_counter() - t0},
            "allreduce": {"bytes_per_rank": ddp["allreduce_bytes"], "seconds": ddp["allreduce_seconds"],
                          "exposed_wait_s": ddp["wait_seconds"], "gbps": self.allreduce_gbps(),
                          "buckets": ddp.get("buckets")},
            "sample": {"prompt": SAMPLE_PROMPT, "text": text},
        }

    def close(self) -> None:
        self.ddp.close()
        self.data.close()

