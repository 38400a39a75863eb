"""The ``--drain`` hook: the command a failed health check runs to take its node out of scheduling.

Slurm runs ``HealthCheckProgram`` periodically and does not act on its exit code by itself;
the program drains the node. The hook is a command line split like a shell would (``shlex``)
but run without a shell, as an argument list, so nothing in the failure reason (which quotes
log lines) can inject commands. The reason reaches the command two ways:

* the environment: ``FIREFLYER_DRAIN_REASON`` (and ``FIREFLYER_VALIDATE_STATUS``);
* placeholders inside an argument: ``{reason}`` and ``{hostname}`` are replaced within that
  one argument, which stays one argument whatever the reason contains.

Example: ``--drain 'scontrol update nodename={hostname} state=drain reason={reason}'``.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
from dataclasses import dataclass

from fireflyer.errors import UserError

REASON_ENV = "FIREFLYER_DRAIN_REASON"
STATUS_ENV = "FIREFLYER_VALIDATE_STATUS"
MAX_REASON = 200


@dataclass(frozen=True, kw_only=True)
class DrainOutcome:
    """What the hook did: its argument list, exit code (None if it could not start) and output."""

    argv: list[str]
    returncode: int | None
    output: str


def parse_drain_command(command: str) -> list[str]:
    """Split the ``--drain`` string into an argument list; a UserError if it is empty or unbalanced."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise UserError(f"--drain {command!r}: {exc}") from exc
    if not argv:
        raise UserError("--drain needs a command, e.g. 'scontrol update nodename={hostname} state=drain reason={reason}'")
    return argv


def one_line(reason: str, limit: int = MAX_REASON) -> str:
    """The reason as one printable line of at most ``limit`` characters (Slurm shows one line)."""
    text = " ".join("".join(ch if ch.isprintable() else " " for ch in reason).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_drain(argv: list[str], reason: str, *, status: str = "FAIL", timeout: float = 30.0) -> DrainOutcome:
    """Run the hook ``argv`` (no shell) with the reason in its environment and placeholders."""
    reason = one_line(reason)
    host = socket.gethostname()
    final = [a.replace("{reason}", reason).replace("{hostname}", host) for a in argv]
    env = dict(os.environ, **{REASON_ENV: reason, STATUS_ENV: status})
    try:
        done = subprocess.run(final, env=env, shell=False, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return DrainOutcome(argv=final, returncode=None, output=f"{final[0]}: command not found")
    except PermissionError as exc:
        return DrainOutcome(argv=final, returncode=None, output=f"{final[0]}: {exc.strerror}")
    except subprocess.TimeoutExpired:
        return DrainOutcome(argv=final, returncode=None, output=f"did not finish within {timeout:.0f}s")
    return DrainOutcome(argv=final, returncode=done.returncode, output=(done.stdout + done.stderr).strip()[-500:])
