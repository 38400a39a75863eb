"""``fireflyer train [CONFIG] [--FIELD VALUE ...] [--resume]``: the main job, launched on emulated nodes.

This process resolves the config (the TOML file, default ``configs/demo.toml``, then
flags), prepares the out directory, and starts the job with
:func:`fireflyer.launch.run_local`: one real torchrun agent per emulated node, each rank
running :mod:`fireflyer.train.job`. Before that it finds or builds the training records
(:func:`fireflyer.train.records.prepare_data`), so the ranks only read them. When the job ends it draws ``loss.png`` and prints
the summary from the ``run.json`` rank 0 wrote.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import time
from functools import lru_cache

from fireflyer.cliutil import ArgumentParser, plural
from fireflyer.errors import UserError
from fireflyer.train import report
from fireflyer.train.config import (DEVICES, FIELD_NAMES, FIELDS, FLAG_OF, MODELS, ORDERS, SECTIONS, TrainConfig,
                                    builtin_config)
from fireflyer.train.env import in_platform_task
from fireflyer.fsutil import write_json
from fireflyer.train.outdir import resolve

EPILOG = """\
examples:
  fireflyer train                                  # the demo: configs/demo.toml, 2 nodes x 2 ranks
  fireflyer train my.toml --steps 600 --out runs/long
  fireflyer train --out runs/long --resume         # continue from the latest saved state there
  fireflyer train --out runs/long --overwrite      # delete the run there and start afresh
  fireflyer train --data my-texts/ --out runs/mine # train on a folder of .txt files (UTF-8)
  fireflyer train --preset moe                     # a small DeepSeekMoE: EP=2 in each node x DP=2 across
  fireflyer train --preset moe --pp 2              # ... as 2 pipeline stages, one per node, EP=2 in each
  fireflyer train --global-batch 128 --micro-batch-size 16   # 8 micro-batches a step, 2 on each of 4 ranks
  fireflyer train --tp 2                           # tensor parallel inside each node x data parallel across
  fireflyer train --fsdp                           # the weights and AdamW's state sharded over the 4 ranks
  fireflyer train --order canonical               # 2 nodes x 2 ranks, each step's sums in one fixed tree ...
  fireflyer train --order canonical --nodes 1 --ranks-per-node 1
                                                   # ... and the same bits on one rank: the same global batch
  fireflyer train --order canonical --linear-blocks 2 --tp 2   # ... and as TP=2 x DP=2, with a 1x1 run of
                                                   # --linear-blocks 2
  fireflyer train --fault-tolerant --order canonical --nodes 3  # a lost node costs seconds, and the same bits
"""
PRESETS = ("demo", "moe", "tiny")
"""The configs shipped in ``fireflyer/train/configs``."""


def build_parser(prog: str = "fireflyer train") -> ArgumentParser:
    """The command line: an optional CONFIG, ``--resume``, and one flag per config field."""
    p = ArgumentParser(prog=prog, usage=f"{prog} [CONFIG] [--resume] [--FIELD VALUE ...]",
                       description="Train a small GPT on Shakespeare across emulated nodes: haiscale DDP, FSDP, tensor, "
                                   "pipeline or expert parallel over hfreduce.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", metavar="CONFIG",
                   help=f"TOML file of config sections (default: the shipped {builtin_config('demo').name})")
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="a shipped config instead of CONFIG: demo (the default), moe (a small DeepSeekMoE with "
                        "expert parallel), tiny (seconds, for tests)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest state saved in the out directory; without CONFIG, "
                        "the saved run's config is used")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the earlier run in the out directory (its checkpoints, results and logs) and "
                        "start afresh; without it, an out directory that holds a run is refused")
    docs = _field_docs()
    groups = {name: p.add_argument_group(f"[{name}] fields (override CONFIG's)", kind.__doc__.split(": ", 1)[-1])
              for name, kind in SECTIONS.items()}
    for name, (section, attr) in FIELDS.items():
        f = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == attr)
        kind = {"int": int, "float": float, "str": str, "bool": bool}[str(f.type).split(" |")[0]]
        flag, where = f"--{name.replace('_', '-')}", groups[section]
        help_text = docs.get(name, "") + ("" if attr == name else f" (in a config: [{section}] {attr})")
        if kind is bool:  # a switch: --fault-tolerant
            where.add_argument(flag, dest=name, action="store_const", const=True, default=None, help=help_text)
            continue
        where.add_argument(flag, dest=name, type=kind, default=None, metavar=kind.__name__.upper(), help=help_text,
                           choices={"device": DEVICES, "model": MODELS, "order": ORDERS}.get(name))
    return p


def main(argv: list[str], prog: str = "fireflyer train") -> int:
    """Run ``fireflyer train`` (and ``fireflyer demo``) with ``argv``; return the exit code."""
    args = build_parser(prog).parse_args(argv)
    if args.preset is not None:
        if args.config is not None:
            raise UserError(f"give CONFIG or --preset, not both (got {args.config!r} and --preset {args.preset})")
        args.config = str(builtin_config(args.preset))
    overrides = {name: getattr(args, name) for name in FIELD_NAMES if getattr(args, name) is not None}
    if args.resume and args.overwrite:
        raise UserError("give --resume (continue the run in the out directory) or --overwrite (delete it), not both")
    if in_platform_task():
        from fireflyer.train.job import run_managed

        return run_managed(args.config, overrides, resume=args.resume, overwrite=args.overwrite)
    # `fireflyer demo` run again replaces its own earlier run; any other run in the way is refused
    cfg, resume_from = resolve(args.config, overrides, resume=args.resume, overwrite=args.overwrite,
                               replace_same=prog == "fireflyer demo")
    if cfg.run.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("device = 'cuda' but no CUDA device is visible here; use 'auto' or 'cpu'")
    from fireflyer.train.records import prepare_data

    data = prepare_data(cfg)  # before any rank starts: a bad --data is one line here, and the ranks find the records
    from fireflyer.launch import LocalJob, run_local  # imports torch: only once the config is known to be good

    out = cfg.out_dir
    config_path = write_json(out / "config.json", cfg.to_dict())
    target = ["-m", "fireflyer.train.job", "--config", str(config_path)]
    if resume_from is not None:
        target += ["--resume", str(resume_from)]
    print(f"fireflyer train: {plural(cfg.parallelism.nodes, 'node')} x {plural(cfg.parallelism.ranks_per_node, 'rank')}, steps "
          f"{_step_range(cfg, resume_from)}, out {out}/ (logs in {out / 'logs'}/)", flush=True)
    print(f"fireflyer train: {cfg.describe_batch()}", flush=True)
    print(f"fireflyer train: {data.summary()}", flush=True)
    t0 = time.monotonic()
    job = LocalJob(target=target, nodes=cfg.parallelism.nodes, ranks_per_node=cfg.parallelism.ranks_per_node,
                   timeout=cfg.run.timeout, grace=cfg.run.stop_grace, log_dir=str(out / "logs"))
    if cfg.run.fault_tolerant:
        _run_replicas(job, cfg)
    else:
        run_local(job)
    wall = time.monotonic() - t0
    run = report.load_run(out)
    png = report.plot_losses(run, out / "loss.png")
    print(report.summary(run, wall_s=wall, out=out, png=png))
    return 0


def _run_replicas(job, cfg: TrainConfig) -> None:
    """``--fault-tolerant``: torchft's Lighthouse, then each node as a replica group of its own, restarted by its
    agent when its ranks die; the Lighthouse ends with the job."""
    from fireflyer.launch import run_local
    from fireflyer.lighthouse import LIGHTHOUSE_ENV, start_lighthouse

    import shutil
    import tempfile

    from fireflyer.train.ft_trainer import READY_ENV

    logs = cfg.out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ready = tempfile.mkdtemp(prefix="fireflyer-ft-ready-")
    lighthouse, address = start_lighthouse(logs / "lighthouse.log")
    try:
        run_local(dataclasses.replace(job, replicas=True, max_restarts=cfg.run.max_restarts,
                                      env={"RUST_LOG": "warn", **job.env, LIGHTHOUSE_ENV: address, READY_ENV: ready}))
    finally:
        lighthouse.kill()
        lighthouse.wait()
        shutil.rmtree(ready, ignore_errors=True)


def _step_range(cfg: TrainConfig, resume_from: int | None) -> str:
    first = 1 if resume_from is None else resume_from + 1
    last = cfg.run.stop_at or cfg.run.steps
    return f"{first}-{last} of {cfg.run.steps}"


@lru_cache(maxsize=1)
def _field_docs() -> dict[str, str]:
    """Each config field's docstring (the string literal after it), by its flag name, for --help."""
    docs = {}
    for section, kind in SECTIONS.items():
        body = ast.parse(inspect.getsource(kind)).body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:], strict=False):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[FLAG_OF[(section, node.target.id)]] = nxt.value.value  # type: ignore[union-attr]
    return docs
