"""The environment variables haiscale reads, and the one reader of each.

haiscale's engine settings are hfreduce's (:mod:`fireflyer.hfreduce.env`, read by
:class:`~fireflyer.hfreduce.config.HFReduceConfig`); a rank's place is torchrun's
(:func:`fireflyer.launch.this_rank`). Its own:
"""

from __future__ import annotations

import os
from fireflyer.errors import UserError

PP_TIMEOUT = "FIREFLYER_PP_TIMEOUT"
"""Seconds every send and receive of the pipeline groups may take, where ``make_subgroups``
is given no ``timeout`` (default 60)."""


def pp_timeout_s(default: float) -> float:
    """``FIREFLYER_PP_TIMEOUT`` in seconds, or ``default`` where it is unset or blank."""
    raw = os.environ.get(PP_TIMEOUT)
    try:
        return float(raw) if raw else default
    except ValueError:
        raise UserError(f"{PP_TIMEOUT}={raw!r} is not a number of seconds") from None
