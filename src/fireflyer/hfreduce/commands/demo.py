"""``fireflyer hfreduce demo``: HFReduce across emulated nodes, launched by real torchrun.

Starts one torchrun agent per emulated node (``--nnodes N --node-rank i`` on
127.0.0.1, each with its own ``FIREFLYER_NODE_ID``), exactly as a multi-node job
starts on a cluster. The job (:mod:`fireflyer.hfreduce.commands.demo_job`) checks hfreduce
against gloo, times both, and trains a tiny model with torch DDP over hfreduce.
"""

from __future__ import annotations

from fireflyer.cliutil import ArgumentParser, doc_summary
from fireflyer.errors import UserError
from fireflyer.launch import LocalJob, run_local


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer hfreduce demo", description=doc_summary(__doc__))
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node (default 2)")
    p.add_argument("--mib", type=int, default=32, help="allreduce size per rank in MiB (default 32)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the demo is stopped")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.ranks_per_node < 1:
        raise UserError("--nodes and --ranks-per-node must be at least 1")
    if not 1 <= args.mib <= 1024:
        raise UserError("--mib must be between 1 and 1024")
    run_local(LocalJob(
        target=["-m", "fireflyer.hfreduce.commands.demo_job", f"--mib={args.mib}"],
        nodes=args.nodes, ranks_per_node=args.ranks_per_node, timeout=args.timeout,
        env={"OMP_NUM_THREADS": "1"},
    ))
    return 0
