"""Scripts the tests run as processes of their own (``python <script> ARGS`` or under torchrun).

Each module here is a script, not a library: importing one runs it. A test finds one with
:func:`path` (or runs it with ``python -m fireflyer.testing.jobs.<name>``).
"""

from __future__ import annotations

from pathlib import Path


def path(name: str) -> Path:
    """The file of job ``name`` (``"interrupt"`` -> ``.../fireflyer/testing/jobs/interrupt.py``)."""
    script = Path(__file__).with_name(f"{name}.py")
    if not script.is_file():
        raise FileNotFoundError(f"no test job named {name!r} (looked for {script})")
    return script
