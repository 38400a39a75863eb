"""The platform's commands, dispatched: ``fireflyer platform start|stop|status|quota|group|serve|user``
(:mod:`~fireflyer.platform.commands.admin`) and ``fireflyer submit|queue|describe|logs|suspend|resume|stop|
nodes|drain|undrain`` (:mod:`~fireflyer.platform.commands.tasks`). Output: :mod:`~fireflyer.platform.commands.render`."""

from __future__ import annotations

from typing import Callable

from fireflyer.errors import UserError
from fireflyer.platform.commands import admin, tasks

COMMANDS: dict[str, Callable[[list[str]], int]] = {"platform": admin.main, **tasks.COMMANDS}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        raise UserError(f"unknown platform command {argv[:1]}; choose one of {', '.join(COMMANDS)}")
    return COMMANDS[argv[0]](argv[1:])
