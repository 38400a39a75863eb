"""``fireflyer hfreduce demo``: HFReduce across emulated nodes, launched by real torchrun.

Starts one torchrun agent per emulated node (``--nnodes N --node-rank i`` on
127.0.0.1, each with its own ``FIREFLYER_NODE_ID``), exactly as a multi-node job
starts on a cluster. The job (:mod:`fireflyer.hfreduce.demo_job`) checks hfreduce
against gloo, times both, and trains a tiny model with torch DDP over hfreduce.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from fireflyer.cliutil import ArgumentParser
from fireflyer.errors import UserError
from fireflyer.hfreduce.transport import free_port


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer hfreduce demo", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node (default 2)")
    p.add_argument("--mib", type=int, default=32, help="allreduce size per rank in MiB (default 32)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the demo is stopped")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.ranks_per_node < 1:
        raise UserError("--nodes and --ranks-per-node must be at least 1")
    if not 1 <= args.mib <= 1024:
        raise UserError("--mib must be between 1 and 1024")
    port = free_port()
    procs = []
    for node in range(args.nodes):
        env = dict(os.environ, FIREFLYER_NODE_ID=f"node{node}", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={args.nodes}", f"--node-rank={node}", f"--nproc-per-node={args.ranks_per_node}",
            "--master-addr=127.0.0.1", f"--master-port={port}",
            "-m", "fireflyer.hfreduce.demo_job", f"--mib={args.mib}",
        ]
        quiet = node > 0
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL if quiet else None,
                                      stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + args.timeout
    failed = None
    try:
        for p_ in procs:
            _, err = p_.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p_.returncode != 0 and failed is None:
                failed = (p_.returncode, err)
    except subprocess.TimeoutExpired:
        failed = (124, f"the demo did not finish within {args.timeout:.0f}s")
    finally:
        for p_ in procs:
            if p_.poll() is None:
                p_.kill()
                p_.wait()
    if failed:
        code, err = failed
        lines = [ln for ln in (err or "").splitlines() if "Error" in ln or "error" in ln]
        raise RuntimeError(f"demo job failed (exit {code}): {lines[-1].strip() if lines else (err or '').strip()[-300:]}")
    return 0
