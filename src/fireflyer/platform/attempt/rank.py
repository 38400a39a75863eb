"""``python -m fireflyer.platform.attempt.rank ATTEMPT_DIR -- CMD...``: how one rank of a task starts.

The supervisor (local executor) or ``srun`` (Slurm executor) starts this once per rank.
It completes the torchrun-style environment (from Slurm's variables when ``RANK`` is not
set), sends the rank's output to ``logs/rank{R}.log``, marks the rank started, and
replaces itself with the task's command. A command that is not there is logged and
exits 127, as a shell would.
"""

from __future__ import annotations

import os
import socket
import sys
import time

from fireflyer.platform import env as names
from fireflyer.platform.layout import AttemptDir
from fireflyer.errors import UserError

_FROM_SLURM = {
    "RANK": "SLURM_PROCID",
    "WORLD_SIZE": "SLURM_NTASKS",
    "LOCAL_RANK": "SLURM_LOCALID",
    "GROUP_RANK": "SLURM_NODEID",
    "NODE_RANK": "SLURM_NODEID",
    names.NODE_ID: "SLURMD_NODENAME",
}


def rank_env(env: dict[str, str]) -> dict[str, str]:
    """The torchrun variables, filled in from Slurm's where the launcher did not set them."""
    out = dict(env)
    for key, slurm in _FROM_SLURM.items():
        if key not in out and slurm in out:
            out[key] = out[slurm]
    if "LOCAL_WORLD_SIZE" not in out and "SLURM_NTASKS_PER_NODE" in out:
        out["LOCAL_WORLD_SIZE"] = out["SLURM_NTASKS_PER_NODE"].split("(")[0]
    if "RANK" not in out:
        raise UserError("no RANK (nor SLURM_PROCID) in the environment: start ranks through the platform")
    out.setdefault("ROLE_RANK", out["RANK"])
    out.setdefault("ROLE_WORLD_SIZE", out.get("WORLD_SIZE", "1"))
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m fireflyer.platform.attempt.rank ATTEMPT_DIR -- CMD...", file=sys.stderr)
        return 2
    adir, command = AttemptDir(args[0]), args[2:]
    env = rank_env(dict(os.environ))
    rank = int(env.get(names.TASK_RANK) or env["RANK"])  # a replica's rank: its place in the task
    adir.logs.mkdir(parents=True, exist_ok=True)
    log = os.open(adir.rank_log(rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    adir.started.mkdir(parents=True, exist_ok=True)
    marker = adir.started_marker(rank)
    marker.write_text(f"{os.getpid()} {socket.gethostname()} {time.time():.3f}\n")
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print(f"fireflyer: rank {rank} could not start {command[0]!r}: {exc.strerror}", flush=True)
        return 127


if __name__ == "__main__":
    sys.exit(main())
