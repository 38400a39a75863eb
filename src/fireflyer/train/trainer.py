"""The training loop of one rank: data-parallel steps with haiscale DDP, evaluation, saving.

Every rank holds a full replica of the model. A step reads the rank's own batch (record
shards through the storage part, :mod:`fireflyer.train.data`), runs
forward and backward through :class:`fireflyer.haiscale.DistributedDataParallel` (whose
gradient allreduce over hfreduce overlaps backward), clips, and steps AdamW. The
reported loss is the mean over ranks. Rank 0 saves the state, writes ``run.json`` and
writes a text sample at the end; every rank takes part in every collective.

Steps are numbered from 1; ``state.step == k`` means k optimizer steps are done.

A step is the global batch (``global_batch`` sequences, in micro-batches of ``micro_batch_size``),
its micro-batches shared evenly among the ranks, each its own forward and backward
(:meth:`DistributedDataParallel.accumulate`). With ``order = "canonical"`` every sum
of a step is taken in one fixed pairwise tree over the global micro-batch index, on an hfreduce
group made for it (``HFReduceConfig(order="canonical")``), and each rank runs one thread: the
gradients, the loss, the validation loss and so the weights are bit for bit those of one
process running every micro-batch, whatever the layout (see :mod:`fireflyer.haiscale.accumulate`).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from fireflyer.haiscale import DistributedDataParallel, layout
from fireflyer.hfreduce import HFReduceConfig
from fireflyer.hfreduce.plans.canonical import PairwiseAccumulator, canonical_sum
from fireflyer.train import state as saved
from fireflyer.train.config import TrainConfig
from fireflyer.train.data import SAMPLE_PROMPT, TrainingData
from fireflyer.fsutil import write_json
from fireflyer.train.model import GPT, ModelShape, lm_loss, split_linears
from fireflyer.train.optim import build_optimizer, clip_exact
from fireflyer.train.parallel import (TIED, LaidOut, describe, load_optimizer, optimizer_state, plain_names,
                                     plain_state, replica_of, whole_model)
from fireflyer.train.progress import StepStats, Throughput, make_progress
from fireflyer.errors import UserError

TIED_HEAD = "head.weight"
"""The plain model's name of the output head, which is the token embedding's weight itself."""
COLLECTIVE_TIMEOUT = 120.0
"""Seconds one collective may take (capped by the job's own timeout): a lost peer fails fast."""


@dataclass
class History:
    """Per-step records of the whole run (restored on resume, so run.json covers every step)."""

    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    val: list[list[float]] = field(default_factory=list)
    """``[step, val_loss]`` pairs."""
    experts: list[dict[str, Any]] = field(default_factory=list)
    """MoE: per step, each MoE layer's ``{"tokens": [...], "imbalance": x}`` under its block index, and the
    step's all-to-all bytes (every rank's, summed) and seconds (the mean rank's)."""

    def to_dict(self) -> dict[str, Any]:
        out = {"loss": self.loss, "lr": self.lr, "val": self.val}
        if self.experts:
            out["experts"] = self.experts
        return out


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
        self.laid_out: LaidOut | None = None
        """The layout path (model = moe, or pp > 1): this rank's stage, experts and groups."""
        self.layout = None
        self.group: dist.ProcessGroup | None = None
        """The group gradients and losses are summed over: the default one, unless the order is canonical."""
        self.ddp: DistributedDataParallel | None = None
        self.sharded: torch.nn.Module | None = None
        """The model sharded by FSDP (``fsdp``): steps go through fsdp_accumulate, the state is gathered to save."""
        if cfg.model.kind == "moe" or cfg.parallelism.pp > 1 or cfg.parallelism.tp > 1:  # collective: before anything else talks
            # a TP group sums in the canonical order in either order (its linears compute in blocks); the canonical
            # order's data-parallel groups too
            options = self._canonical_options() if cfg.parallelism.order == "canonical" or cfg.parallelism.tp > 1 else None
            self.layout = layout(pp=cfg.parallelism.pp, ep=cfg.parallelism.ep, tp=cfg.parallelism.tp, pg_options=options)
        self._build_data()
        self._build_model()
        self.ckpt = saved.manager(cfg.run.out, rank=where.rank, world_size=where.world_size,
                                  kind="sharded" if self.laid_out else "replicated")
        self.start_step = self._restore(resume) if resume is not None else 0
        self.resumed_from = self.start_step if resume is not None else None
        self.end_step = cfg.run.stop_at or cfg.run.steps
        self.timing = {"train_s": 0.0, "eval_s": 0.0, "save_s": 0.0}

    # ------------------------------------------------------------------ building
    def _build_data(self) -> None:
        w = self.where
        rank, world = w.rank, w.world_size
        if self.layout is not None:  # one batch per pipeline (data replica)
            rank, world = replica_of(self.layout, self.cfg), self.cfg.replicas
        self.data = TrainingData.open(self.cfg, rank=rank, world_size=world, device=w.device)
        self.tokenizer = self.data.tokenizer
        self._notes: list[str] = []

    def _build_model(self) -> None:
        cfg = self.cfg
        if self.layout is not None:
            self.laid_out = LaidOut(cfg, self.layout, self.tokenizer.vocab_size, self.where.device)
            self.model, self.ddp = self.laid_out.module, self.laid_out.ddp
            self.optimizer, self.scheduler = build_optimizer(self.model, cfg)
            return
        shape = ModelShape(vocab_size=self.tokenizer.vocab_size, context=cfg.model.context, layers=cfg.model.layers,
                           d_model=cfg.model.d_model, heads=cfg.model.heads)
        torch.manual_seed(cfg.run.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
        self.model = GPT(shape).to(self.where.device)
        if cfg.parallelism.order == "canonical":
            seconds = min(COLLECTIVE_TIMEOUT, cfg.run.timeout)
            self.group = dist.new_group(backend="hfreduce", timeout=timedelta(seconds=seconds),
                                        pg_options=self._canonical_options())
            if cfg.parallelism.linear_blocks > 1:  # the linears every TP degree dividing linear_blocks computes alike
                split_linears(self.model, blocks=cfg.parallelism.linear_blocks)
        if cfg.parallelism.fsdp:  # each rank one shard of the weights, gradients and AdamW's state
            from fireflyer.haiscale import fully_shard  # torch's FSDP: imported only by the runs that use it

            self.sharded = fully_shard(self.model, group=self.group, order=cfg.parallelism.order)
        else:
            self.ddp = DistributedDataParallel(self.model, process_group=self.group, bucket_cap_mb=cfg.parallelism.bucket_cap_mb,
                                               order=cfg.parallelism.order)
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg)

    def _canonical_options(self) -> HFReduceConfig:
        """hfreduce groups that sum in the canonical order, with the job's collective timeout."""
        return HFReduceConfig.from_env(order="canonical", timeout=min(COLLECTIVE_TIMEOUT, self.cfg.run.timeout))

    def _restore(self, step: int) -> int:
        return self._take(saved.load_state(self.cfg.run.out, step))

    def _take(self, state: dict[str, Any]) -> int:
        """Load a saved ``state`` into this rank; returns its step."""
        step = int(state["step"])
        if state["vocab"] != self.tokenizer.chars:
            raise UserError(f"step {step} in {saved.ckpt_dir(self.cfg.run.out)} was trained on a different corpus "
                             "vocabulary; start afresh with a new --out")
        rng = state["rng"]
        if "cpu" not in rng:  # saved per rank (a laid-out run): this rank's, else the first rank's
            rng = rng.get(f"rank{self.where.rank}", rng["rank0"])
        if self.laid_out is not None:
            self.laid_out.load(state["model"], state["optimizer"], self.optimizer)
        else:  # a state saved on any layout: whole tensors under global names (the head is the token embedding)
            names = plain_names(self.model)
            if self.sharded is not None:  # this rank's shard of each
                with torch.no_grad():
                    for n in names:
                        n.param.copy_(n.share(state["model"][n.name]))
            else:
                self.model.load_state_dict({TIED_HEAD: state["model"][TIED], **state["model"]})
            load_optimizer(names, state["optimizer"], self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(rng["cpu"])
        if self.where.device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], self.where.device)
        if state.get("data_hash") not in (None, self.data.prepared.key):
            self._notes.append(f"note: the training records differ from those step {step} was trained on "
                               f"({state['data_hash'][:12]} -> {self.data.prepared.key[:12]}); the data order changes")
        h = state["history"]
        self.history = History(loss=list(h["loss"]), lr=list(h["lr"]), val=[list(v) for v in h["val"]],
                               experts=[dict(e) for e in h.get("experts", [])])
        return int(state["step"])

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any]:
        """Train from ``start_step`` to ``end_step``; return the run record rank 0 wrote (others: {})."""
        cfg, rank = self.cfg, self.where.rank
        if self.start_step == 0:
            self._evaluate(0)
        bar = make_progress(rank=rank, first=self.start_step + 1, total=cfg.run.steps)
        if self.resumed_from is not None:
            bar.note(f"resumed at step {self.start_step} from {saved.ckpt_dir(cfg.run.out)}")
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
                imbalance = self.history.experts[-1]["imbalance"] if self.laid_out and self.history.experts else None
                bar.update(StepStats(step, loss, lr, rate.add(seconds, cfg.tokens_per_step), self.allreduce_gbps(),
                                     imbalance))
                if cfg.data.eval_interval and step % cfg.data.eval_interval == 0 and step != self.end_step:
                    bar.note(f"step {step}: val loss {self._evaluate(step):.4f}")
                saved_now = bool(cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 and step != self.end_step)
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
        laid = self._layout_summary()
        record = self._record(reader, laid) if rank == 0 else {}
        if rank == 0:
            write_json(Path(cfg.run.out) / "run.json", record)
        dist.barrier()
        return record

    def _train_step(self, step: int) -> tuple[float, float]:
        if self.laid_out is not None:
            return self._laid_out_step(step)
        # Each micro-batch's forward and backward; the gradients averaged over every rank's micro-batches
        # (in the canonical tree, for order = "canonical") when this returns, with the mean loss.
        if self.sharded is not None:  # FSDP deals the step's micro-batches to the shards in turn
            from fireflyer.haiscale import fsdp_accumulate, sharding_info

            mine = sharding_info(self.sharded).micro_batch_indices(self.cfg.micro_batches)
            mean = fsdp_accumulate(self.sharded, [self.data.micro_batch("train", g, at=step) for g in mine], lm_loss)
        else:
            mean = self.ddp.accumulate(self.data.train(step=step), lm_loss)
        if self.cfg.optimizer.grad_clip and self.cfg.parallelism.order == "canonical":  # an exact norm: the same bits on every layout
            shards = self.group if self.sharded is not None else None  # FSDP: each rank adds its own shards
            clip_exact(self.model.parameters(), self.model.parameters(), self.cfg.optimizer.grad_clip, shards)
        elif self.cfg.optimizer.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optimizer.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.history.loss.append(mean.item())
        self.history.lr.append(lr)
        return self.history.loss[-1], lr

    def _laid_out_step(self, step: int) -> tuple[float, float]:
        """A step of the layout path: the pipeline (or one forward), global clipping, the balancing step."""
        net = self.laid_out
        assert net is not None
        self.optimizer.zero_grad(set_to_none=False)
        loss = net.train_loss(self.data.train(step=step))
        if self.cfg.optimizer.grad_clip:
            net.clip(self.cfg.optimizer.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        layers = net.after_step()
        # the canonical order's loss is already the global batch's mean, the same on every rank
        self.history.loss.append(loss.item() if self.cfg.parallelism.order == "canonical" else self._replica_mean(loss))
        self.history.lr.append(lr)
        if layers or self.cfg.model.kind == "moe":
            self.history.experts.append(self._expert_record(layers))
        return self.history.loss[-1], lr

    def _replica_mean(self, value: torch.Tensor | None) -> float:
        """The mean over data replicas of a value the last stage holds, on every rank of its TP group (collective
        over the world: TP rank 0 counts it)."""
        buf = torch.zeros(1, dtype=torch.float64, device=self.where.device)
        if value is not None and self.layout.coords["tp"] == 0:
            buf += value.double()
        dist.all_reduce(buf)
        return buf.item() / self.cfg.replicas

    def _expert_record(self, layers: list) -> dict[str, Any]:
        """The step's MoE record: this stage's layers, the all-to-all totals and the worst imbalance of any
        stage (collective over the world: every rank adds its bytes and seconds, and its stages' worst)."""
        sums = torch.tensor([float(sum(l.bytes_sent for l in layers)), sum(l.seconds for l in layers)],
                            dtype=torch.float64, device=self.where.device)
        worst = torch.tensor([max((l.imbalance for l in layers), default=1.0)], dtype=torch.float64,
                             device=self.where.device)
        dist.all_reduce(sums)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return {"layers": {str(l.layer): {"tokens": l.tokens, "imbalance": l.imbalance} for l in layers},
                "imbalance": worst.item(), "all_to_all_bytes": int(sums[0].item()),
                "all_to_all_s": sums[1].item() / self.where.world_size}

    @torch.no_grad()
    def _evaluate(self, step: int) -> float:
        """Mean validation loss over every rank's fixed validation batches; recorded at ``step``."""
        t0 = time.perf_counter()
        if self.laid_out is not None and self.cfg.parallelism.order != "canonical":
            total = torch.zeros((), dtype=torch.float64, device=self.where.device)
            for i in range(self.cfg.data.eval_batches):
                for x, y in self.data.eval(index=i):
                    loss = self.laid_out.eval_loss(x, y)
                    if loss is not None:
                        total += loss.double()
            self.history.val.append([step, self._replica_mean(total / (self.cfg.data.eval_batches * self.cfg.micro_batches))])
            self.timing["eval_s"] += time.perf_counter() - t0
            return self.history.val[-1][1]
        # Batch i's loss summed pairwise over this replica's micro-batches, then over the replicas (in the
        # group's order), then over i in the canonical tree: layout-independent bits in the canonical order.
        net = self.laid_out
        self.model.eval()
        sums = torch.zeros(self.cfg.data.eval_batches, device=self.where.device)
        for i in range(self.cfg.data.eval_batches):
            acc = PairwiseAccumulator()
            for x, y in self.data.eval(index=i):
                loss = lm_loss(self.model, (x, y)) if net is None else net.eval_loss(x, y)
                if loss is not None:  # None on a pipeline's earlier stages, which only pass activations on
                    acc.add(loss.float())
            if acc.count:
                sums[i] = acc.result()
        self.model.train()
        dist.all_reduce(sums, group=self.group if net is None else self.layout.dense_group)
        mean = canonical_sum(list(sums.unbind())) / (self.cfg.data.eval_batches * self.cfg.global_micro_batches)
        if net is not None:  # a pipeline's last stage holds it
            mean = net.from_last_stage(mean)
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
        if self.laid_out is not None:  # each rank its share, under global names (kind="sharded")
            return saved.payload(
                step, config=self.cfg.to_dict(), vocab=self.tokenizer.chars, data_hash=self.data.prepared.key,
                model=self.laid_out.model_state(), optimizer=self.laid_out.optimizer_state(self.optimizer),
                scheduler=self.scheduler.state_dict(), rng={f"rank{self.where.rank}": rng},
                history=self.history.to_dict(), layout=describe(self.layout))
        return saved.payload(
            step,
            config=self.cfg.to_dict(),
            vocab=self.tokenizer.chars,
            data_hash=self.data.prepared.key,
            model=plain_state(self.model),
            optimizer=optimizer_state(plain_names(self.model), self.optimizer),
            scheduler=self.scheduler.state_dict(),
            rng=rng,
            history=self.history.to_dict(),
        )

    # ------------------------------------------------------------------ reporting
    def allreduce_gbps(self) -> float:
        if self.ddp is None:  # a fault-tolerant run sums through torchft's group, not a DDP
            return 0.0
        s = self.ddp.stats()
        return s["allreduce_bytes"] / s["allreduce_seconds"] / 1e9 if s["allreduce_seconds"] > 0 else 0.0

    def sample(self) -> str:
        """Text the trained model writes after :data:`SAMPLE_PROMPT`, with a generator seeded by ``seed``."""
        if not self.cfg.run.sample_tokens:
            return ""
        prompt = self.tokenizer.encode(SAMPLE_PROMPT).to(self.where.device)
        gen = torch.Generator(device=self.where.device).manual_seed(self.cfg.run.seed)
        model = self.model
        if self.laid_out is not None or self.sharded is not None:  # the whole model, from the saved state's names
            state = saved.load_state(self.cfg.run.out, self.end_step)
            model = whole_model(self.cfg, self.tokenizer.vocab_size, state["model"]).to(self.where.device)
        model.eval()
        out = model.generate(prompt, self.cfg.run.sample_tokens, temperature=0.8, generator=gen)
        model.train()
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

    def _layout_summary(self) -> dict[str, Any]:
        """The layout path's part of run.json, gathered from every rank (a collective; {} on the plain path).

        Each stage knows its own MoE layers' per-step records: they are merged by block index, so
        rank 0 reports every layer. Parameters: this rank's, and the whole model's (each global name once).
        """
        if self.laid_out is None:
            return {}
        net = self.laid_out
        mine = {"experts": [e["layers"] for e in self.history.experts],
                "names": {k: v.numel() for k, v in net.model_state().items()}, "held": net.num_parameters()}
        everyone: list[Any] = [None] * self.where.world_size
        dist.all_gather_object(everyone, mine)
        for i, step in enumerate(self.history.experts):  # every rank ran the same steps
            step["layers"] = {k: v for e in everyone for k, v in e["experts"][i].items()}
        names = {k: v for e in everyone for k, v in e["names"].items()}
        buffers = {n for n, _ in net.full.named_buffers()}
        return {"layout": describe(self.layout),
                "parameters": {"whole_model": sum(v for k, v in names.items() if k not in buffers),
                               "per_rank": [e["held"] for e in everyone]}}

    def _record(self, reader: dict[str, float], laid: dict[str, Any]) -> dict[str, Any]:
        cfg, w = self.cfg, self.where
        done = self.end_step - self.start_step
        ddp = self.ddp.stats() if self.ddp is not None else None
        t0 = time.perf_counter()
        text = self.sample()
        return {
            "config": cfg.to_dict(),
            "finished": self.end_step == cfg.run.steps,
            "step": self.end_step,
            "resumed_from": self.resumed_from,
            "world": {"nodes": cfg.parallelism.nodes, "ranks_per_node": cfg.parallelism.ranks_per_node, "world_size": w.world_size,
                      "device": str(w.device) if w.device.type == "cpu" else f"cuda x {w.world_size}",
                      "threads_per_rank": w.threads},
            "model": self._model_record(laid),
            **({"layout": laid["layout"]} if laid else {}),
            **({"experts": self._experts_summary()} if self.history.experts else {}),
            "data": {**self.data.describe(), "tokens_per_step": cfg.tokens_per_step,
                     "micro_batches_per_step": cfg.global_micro_batches, "micro_batch_size": cfg.data.micro_batch_size,
                     **reader},
            "history": self.history.to_dict(),
            "timing": {**self.timing, "steps_this_run": done,
                       "tokens_per_s": done * cfg.tokens_per_step / self.timing["train_s"] if done else 0.0,
                       "sample_s": time.perf_counter() - t0},
            **({"allreduce": {"bytes_per_rank": ddp["allreduce_bytes"], "seconds": ddp["allreduce_seconds"],
                              "exposed_wait_s": ddp["wait_seconds"], "gbps": self.allreduce_gbps(),
                              "buckets": ddp.get("buckets")}} if ddp is not None else {}),
            "sample": {"prompt": SAMPLE_PROMPT, "text": text},
        }

    def _model_record(self, laid: dict[str, Any]) -> dict[str, Any]:
        if not laid:
            return {"parameters": self.model.num_parameters(), "vocab_size": self.tokenizer.vocab_size, "kind": "dense",
                    "weights_sha256": weights_digest(saved.load_state(self.cfg.run.out, self.end_step)["model"])}
        cfg = self.cfg
        out = {"parameters": laid["parameters"]["whole_model"], "parameters_per_rank": laid["parameters"]["per_rank"],
               "vocab_size": self.tokenizer.vocab_size, "kind": cfg.model.kind,
               "weights_sha256": weights_digest(saved.load_state(cfg.run.out, self.end_step)["model"])}
        if cfg.model.kind == "moe":
            out.update(experts=cfg.model.experts, shared_experts=cfg.model.shared_experts, expert_hidden=cfg.model.expert_hidden,
                       top_k=cfg.model.top_k, experts_per_rank=cfg.model.experts // cfg.parallelism.ep)
        return out

    def _experts_summary(self) -> dict[str, Any]:
        """The MoE steps of this run in brief: per-step imbalance and all-to-all bytes (the full per-layer
        tokens are in ``history.experts``)."""
        h = self.history.experts
        return {"imbalance": [e["imbalance"] for e in h], "all_to_all_bytes": [e["all_to_all_bytes"] for e in h],
                "all_to_all_s": sum(e["all_to_all_s"] for e in h),
                "tokens": [{k: v["tokens"] for k, v in e["layers"].items()} for e in h]}

    def close(self) -> None:
        if self.ddp is not None:
            self.ddp.close()
        self.data.close()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """The sha256 of a model's whole state (global names, full tensors), whatever layout held it: every tensor by
    name, the output head's tie to the token embedding left out. Equal digests, equal bits."""
    h = hashlib.sha256()
    for name in sorted(set(state) - {TIED_HEAD}):
        t = state[name]
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

