"""The training loop of one rank: steps on the run's layout, evaluation, saving.

Every run is laid out (:func:`fireflyer.haiscale.layout`): the rank holds its part of the model
(:class:`~fireflyer.train.parallel.RankModel`), a whole replica under
:class:`fireflyer.haiscale.DistributedDataParallel` for the dense model on data parallel (whose
gradient allreduce over hfreduce overlaps backward), or its FSDP shards, pipeline stage, experts
or TP shares. A step reads the rank's own batch (record shards through the storage part,
:mod:`fireflyer.train.data`), runs forward and backward, clips, and steps AdamW. The reported loss
is the mean over the global batch. Rank 0 writes ``run.json`` and a text sample at the end; every
rank saves its share of the state and takes part in every collective.

Steps are numbered from 1; ``state.step == k`` means k optimizer steps are done.

A step is the global batch (``global_batch`` sequences, in micro-batches of ``micro_batch_size``),
its micro-batches shared evenly among the data replicas, each its own forward and backward
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
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from fireflyer.haiscale import layout
from fireflyer.hfreduce import HFReduceConfig
from fireflyer.train import state as saved
from fireflyer.train.config import TrainConfig
from fireflyer.train.data import SAMPLE_PROMPT, TrainingData
from fireflyer.fsutil import write_json
from fireflyer.train.optim import build_optimizer
from fireflyer.train.parallel import RankModel, describe, replica_of, whole_model
from fireflyer.train.progress import StepStats, Throughput, make_progress
from fireflyer.errors import UserError

TIED_HEAD = "head.weight"
"""The whole model's name of the output head, which is the token embedding's weight itself."""
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
    """Builds the layout, data, model (its part on this rank) and optimizer for one rank, then runs the steps."""

    def __init__(self, cfg: TrainConfig, where: Placement, *, resume: int | None = None,
                 fail_at: int | None = None, managed: bool = False) -> None:
        self.cfg = cfg
        self.where = where
        self.fail_at = fail_at
        self.managed = managed
        """Run as a platform task: answer suspend commands by saving the state and stopping."""
        """A step at which to raise, as a crashing rank would (fault injection for tests)."""
        self.history = History()
        par = cfg.parallelism
        # collective: before anything else talks. A TP group sums in the canonical order in either order (its linears
        # compute in blocks); the canonical order's data-parallel groups too
        options = self._canonical_options() if par.order == "canonical" or par.tp > 1 else None
        self.layout = layout(pp=par.pp, ep=par.ep, tp=par.tp, pg_options=options,
                             timeout=min(COLLECTIVE_TIMEOUT, cfg.run.timeout))
        self._build_data()
        self._build_model()
        self.ckpt = saved.manager(cfg.run.out, rank=where.rank, world_size=where.world_size,
                                  kind="replicated" if self.net.replicated else "sharded")
        self.start_step = self._restore(resume) if resume is not None else 0
        self.resumed_from = self.start_step if resume is not None else None
        self.end_step = cfg.run.stop_at or cfg.run.steps
        self.timing = {"train_s": 0.0, "eval_s": 0.0, "save_s": 0.0}

    # ------------------------------------------------------------------ building
    def _build_data(self) -> None:
        w = self.where
        # one batch per data replica (a pipeline, a TP group; with neither, each rank)
        self.data = TrainingData.open(self.cfg, rank=replica_of(self.layout, self.cfg), world_size=self.cfg.replicas,
                                      device=w.device)
        self.tokenizer = self.data.tokenizer
        self._notes: list[str] = []

    def _build_model(self) -> None:
        self.net = RankModel(self.cfg, self.layout, self.tokenizer.vocab_size, self.where.device)
        """This rank's part of the model, how it is held, and its step."""
        self.model = self.net.module
        self.optimizer, self.scheduler = build_optimizer(self.model, self.cfg)

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
        self.net.load(state["model"], state["optimizer"], self.optimizer)  # whole tensors under global names
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
                imbalance = self.history.experts[-1]["imbalance"] if self.history.experts else None
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
        """A step: forward and backward on the layout (the gradients reduced), global clipping, AdamW, the MoE
        layers' balancing step; returns the global batch's mean loss and the step's learning rate."""
        net = self.net
        self.optimizer.zero_grad(set_to_none=False)
        loss = net.train_loss(self.data, step)
        if self.cfg.optimizer.grad_clip:
            net.clip(self.cfg.optimizer.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        layers = net.after_step()
        self.history.loss.append(loss)
        self.history.lr.append(lr)
        if layers or self.cfg.model.kind == "moe":
            self.history.experts.append(self._expert_record(layers))
        return self.history.loss[-1], lr

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

    def _evaluate(self, step: int) -> float:
        """Mean validation loss over every replica's fixed validation batches; recorded at ``step``."""
        t0 = time.perf_counter()
        self.history.val.append([step, self.net.val_loss(self.data)])
        self.timing["eval_s"] += time.perf_counter() - t0
        return self.history.val[-1][1]

    def _suspend_if_requested(self, step: int, saved_now: bool, bar: Any) -> None:
        """The platform's suspend handshake: all ranks agree, save ``step``, and stop (see platform.client)."""
        from fireflyer.platform import client

        def announce() -> None:  # rank 0's bar prints it; the others' are silent
            bar.note(f"suspend requested: saving step {step}, then stopping; the platform resumes the run later")
            bar.close()

        client.suspend_if_requested(self.ckpt, step, None if saved_now else (lambda: self._state(step)),
                                    announce=announce)

    def _save(self, step: int) -> None:
        """Every rank hands its state to the checkpoint manager; the step waits for the snapshot only."""
        t0 = time.perf_counter()
        self.ckpt.save(step, self._state(step))
        self.timing["save_s"] += time.perf_counter() - t0

    def _state(self, step: int) -> dict[str, Any]:
        """The state to save: the model and AdamW's state under global names, the scheduler, RNG and history
        (a collective: TP shares and FSDP shards are gathered)."""
        rng = {"cpu": torch.get_rng_state()}
        if self.where.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.where.device)
        # every rank of a replicated model saves the same whole state; a sharded one keeps what differs between
        # ranks under keys of their own
        own = {"rng": rng} if self.net.replicated else {"rng": {f"rank{self.where.rank}": rng},
                                                        "layout": describe(self.layout)}
        return saved.payload(
            step, config=self.cfg.to_dict(), vocab=self.tokenizer.chars, data_hash=self.data.prepared.key,
            model=self.net.model_state(), optimizer=self.net.optimizer_state(self.optimizer),
            scheduler=self.scheduler.state_dict(), history=self.history.to_dict(), **own)

    # ------------------------------------------------------------------ reporting
    def allreduce_gbps(self) -> float:
        """DDP's gradient allreduce rate so far; 0 where no DDP sums the gradients (FSDP, the canonical steps, a
        fault-tolerant run's torchft group)."""
        if self.net.ddp is None:
            return 0.0
        s = self.net.ddp.stats()
        return s["allreduce_bytes"] / s["allreduce_seconds"] / 1e9 if s["allreduce_seconds"] > 0 else 0.0

    def sample(self) -> str:
        """Text the trained model writes after :data:`SAMPLE_PROMPT`, with a generator seeded by ``seed``."""
        if not self.cfg.run.sample_tokens:
            return ""
        prompt = self.tokenizer.encode(SAMPLE_PROMPT).to(self.where.device)
        gen = torch.Generator(device=self.where.device).manual_seed(self.cfg.run.seed)
        model = self.net.whole()
        if model is None:  # spread over ranks: the whole model, from the saved state's names
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
        """The layout's part of run.json, gathered from every rank (a collective).

        Each stage knows its own MoE layers' per-step records: they are merged by block index, so
        rank 0 reports every layer. Parameters: this rank's, and the whole model's (each global name once).
        """
        net = self.net
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
        ddp = self.net.ddp.stats() if self.net.ddp is not None else None
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
            "layout": laid["layout"],
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
        self.net.close()
        self.data.close()


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """The sha256 of a model's whole state (global names, full tensors), whatever layout held it: every tensor by
    name, the output head's tie to the token embedding left out. Equal digests, equal bits."""
    h = hashlib.sha256()
    for name in sorted(set(state) - {TIED_HEAD}):
        t = state[name]
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

