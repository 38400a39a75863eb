"""The platform's commands, dispatched: ``fireflyer platform start|stop|status|quota|group|serve|user``
(:mod:`~fireflyer.platform.daemon_cli`) and ``fireflyer submit|queue|describe|logs|suspend|resume|stop|
nodes|drain|undrain`` (:mod:`~fireflyer.platform.task_cli`). Output: :mod:`~fireflyer.platform.render`."""

from __future__ import annotations

from typing import Callable

from fireflyer.errors import UserError
from fireflyer.platform import daemon_cli, task_cli

COMMANDS: dict[str, Callable[[list[str]], int]] = {"platform": daemon_cli.main, **task_cli.COMMANDS}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        raise UserError(f"unknown platform command {argv[:1]}; choose one of {', '.join(COMMANDS)}")
    return COMMANDS[argv[0]](argv[1:])
