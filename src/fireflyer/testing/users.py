"""Run a piece of a test as another Unix user (root only): the door a stranger on the same machine has."""

from __future__ import annotations

import os
from typing import Callable

NOBODY = 65534


def refused_as(uid: int, attempt: Callable[[], object], refusal: type[BaseException] | tuple) -> bool:
    """Fork, drop to ``uid`` (and the same gid), run ``attempt``; True when it raised ``refusal``.

    False when it succeeded; any other exception in the child counts as not refused either,
    so a test cannot pass by accident.
    """
    if os.geteuid() != 0:
        raise PermissionError("refused_as needs root to switch to another user")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(uid)
            os.setuid(uid)
            attempt()
        except refusal:
            code = 3
        except BaseException:  # noqa: BLE001 - anything else is not the refusal the test looks for
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 3
