"""One rank of ``fireflyer bench pp``, started by torchrun: ``python -m fireflyer.bench.pp_worker SPEC.json``.

The world is one pipeline, one stage per rank (``make_subgroups(pp_size=world)``). For
each schedule and micro-batch count it runs warm-up steps, then timed steps, and records
every forward and backward its stages run (start, end, thread CPU time) on the host's
monotonic clock, which all ranks on one host share. A :class:`StageProbe` also counts the
bytes of activations the stage keeps for backward (autograd's saved tensors, parameters
excluded, each storage once), live at any moment and at peak. The rank writes
``rank{R}.json`` into the spec's ``out_dir``; the parent turns the records into bubble
fractions.
"""

from __future__ import annotations

import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fireflyer.bench.skeleton import rank_groups, worker_main


class _Saved:
    """One tensor autograd keeps for backward; leaving the graph (refcount 0) releases its bytes."""

    __slots__ = ("key", "probe", "tensor")

    def __init__(self, probe: StageProbe, tensor: torch.Tensor, key: int) -> None:
        self.probe, self.tensor, self.key = probe, tensor, key

    def __del__(self) -> None:
        self.probe._release(self.key)


class StageProbe:
    """Wraps a torch ``PipelineStage``: times its forwards and backwards and counts saved activations."""

    def __init__(self, stage: Any) -> None:
        self.stage = stage
        self.events: list[list[Any]] = []
        self.params = {p.untyped_storage().data_ptr() for p in stage.submod.parameters()}
        self.storages: dict[int, list[int]] = {}  # storage pointer -> [holders, bytes]
        self.live = 0
        self.peak = 0
        self.peak_inflight = 0
        self.forward_bytes: list[int] = []
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

        def forward_one_chunk(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            before = self.live
            t0, c0 = time.monotonic(), time.thread_time()
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                out = fwd(chunk_id, *args, **kwargs)
            self.events.append(["F", chunk_id, stage.stage_index, t0, time.monotonic(), time.thread_time() - c0])
            self.forward_bytes.append(self.live - before)
            self.peak_inflight = max(self.peak_inflight, len(stage.fwd_cache))
            return out

        def backward_one_chunk(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.monotonic(), time.thread_time()
            out = bwd(chunk_id, *args, **kwargs)
            self.events.append(["B", chunk_id, stage.stage_index, t0, time.monotonic(), time.thread_time() - c0])
            return out

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk

    def _pack(self, t: torch.Tensor) -> Any:
        key = t.untyped_storage().data_ptr()
        if key in self.params or t.device.type == "meta":
            return t
        entry = self.storages.get(key)
        if entry is None:
            nbytes = t.untyped_storage().nbytes()
            self.storages[key] = [1, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        return _Saved(self, t, key)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        entry = self.storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.storages[key]

    def reset(self) -> None:
        self.events, self.forward_bytes = [], []
        self.peak, self.peak_inflight = self.live, 0


def build_model(stages: int, layers_per_stage: int, width: int) -> nn.Sequential:
    """``stages * layers_per_stage`` blocks of Linear + ReLU, the same on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU())
                           for _ in range(stages * layers_per_stage)])


def run_case(spec: dict[str, Any], pp_group: Any, schedule: str, n_mb: int) -> dict[str, Any]:
    from fireflyer.haiscale.pipeline import (
        Pipeline,
        PipelineConfig,
        Schedule,
        partition,
        stage_indices,
    )

    p, rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    v = spec["virtual"] if Schedule.parse(schedule) is Schedule.INTERLEAVED_1F1B else 1
    model = build_model(p, spec["layers"], spec["width"])
    mods = [partition(model, i, p * v) for i in stage_indices(rank, p, v)]
    pipe = Pipeline(mods if v > 1 else mods[0], pp_group, loss_fn=F.mse_loss,
                    config=PipelineConfig(schedule=schedule, n_microbatches=n_mb))
    probes = [StageProbe(s) for s in pipe.stages]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n_mb * spec["rows"], spec["width"], generator=g)
    y = torch.randn(n_mb * spec["rows"], spec["width"], generator=g)
    steps = []
    for i in range(spec["warmup"] + spec["steps"]):
        for m in mods:
            m.zero_grad(set_to_none=True)
        for probe in probes:
            probe.reset()
        dist.barrier(group=pp_group)
        start = time.monotonic()
        pipe.forward_backward(x, y)
        end = time.monotonic()
        if i >= spec["warmup"]:
            steps.append({"start": start, "end": end, "events": [e for pr in probes for e in pr.events],
                          "peak_saved_bytes": sum(pr.peak for pr in probes),
                          "peak_inflight": sum(pr.peak_inflight for pr in probes),
                          "forward_bytes": [b for pr in probes for b in pr.forward_bytes]})
    return {"schedule": Schedule.parse(schedule).value, "microbatches": n_mb, "virtual": v,
            "stages": pipe.stage_indices, "steps": steps}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """This rank's records of every schedule and micro-batch count the spec asks for."""
    torch.set_num_threads(1)
    with rank_groups(spec["timeout_s"], spec["backend"]):
        from fireflyer.haiscale.pipeline import make_subgroups

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the parent reports the placement itself
            _, pp_group = make_subgroups(dist.get_world_size(), timeout=timedelta(seconds=spec["timeout_s"]))
        cases = [run_case(spec, pp_group, s, m) for s in spec["schedules"] for m in spec["microbatches"]]
        return {"rank": dist.get_rank(), "pp_rank": dist.get_rank(pp_group), "cases": cases}


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:], "python -m fireflyer.bench.pp_worker", run))
