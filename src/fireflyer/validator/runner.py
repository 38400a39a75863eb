"""Run the selected checks one after another, each inside its time budget.

Checks run in sequence so their measurements do not disturb each other. Each runs in a
worker thread that the runner waits on for at most ``2 x budget + overhead``: a check stuck
in a call that cannot be interrupted (a hung GPU, a dead NFS mount) becomes a FAIL that says
so, and the validator moves on instead of hanging the node's health check.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from fireflyer.errors import UserError
from fireflyer.validator.checks import ALL_CHECKS, Check, CheckContext, RunOptions
from fireflyer.validator.grading import CheckResult, Status
from fireflyer.validator.profiles import Profile

OVERHEAD_S = {"allreduce": 25.0, "nccl_allreduce": 25.0, "xid": 10.0}
"""Seconds a check may run past twice its budget before it counts as hung (process start-up)."""


def select_checks(names: Sequence[str] | None = None, skip: Sequence[str] = ()) -> list[str]:
    """The checks to run, in their standard order; an unknown name is a UserError."""
    for name in [*(names or []), *skip]:
        if name not in ALL_CHECKS:
            raise UserError(f"unknown check {name!r}; choose from: {', '.join(ALL_CHECKS)}")
    wanted = set(names) if names else set(ALL_CHECKS)
    return [n for n in ALL_CHECKS if n in wanted and n not in set(skip)]


def hard_limit(name: str, budget_s: float) -> float:
    """Seconds after which a check is declared hung."""
    return 2 * budget_s + OVERHEAD_S.get(name, 5.0)


def run_one(check: Check, ctx: CheckContext, limit_s: float) -> CheckResult:
    """``check.run(ctx)`` in a daemon thread, abandoned (as a FAIL) after ``limit_s`` seconds."""
    box: list[CheckResult] = []
    worker = threading.Thread(target=lambda: box.append(check.run(ctx)), name=f"check-{check.name}", daemon=True)
    t0 = time.monotonic()
    worker.start()
    worker.join(limit_s)
    if box:
        return box[0]
    return CheckResult(name=check.name, status=Status.FAIL, seconds=time.monotonic() - t0,
                       reason=f"did not finish within {limit_s:.0f}s (budget {ctx.budget_s:.0f}s): "
                              "it hangs on this node")


def run_checks(profile: Profile, options: RunOptions, names: Sequence[str],
               on_result: Callable[[CheckResult], None] | None = None,
               explicit: bool = False) -> list[CheckResult]:
    """Run ``names`` against ``profile``. A check the profile disables is a SKIP, unless
    ``explicit`` (the user named it with ``--checks``)."""
    results = []
    for name in names:
        cls = ALL_CHECKS[name]
        settings = profile.settings(name)
        if not settings.enabled and not explicit:
            result = CheckResult(name=name, status=Status.SKIP, reason=f"disabled in profile {profile.name}")
        else:
            check = cls()
            budget = check.budget(options, settings)
            ctx = CheckContext(options=options, settings=settings, defaults=dict(cls.params), budget_s=budget)
            result = run_one(check, ctx, hard_limit(name, budget))
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results
