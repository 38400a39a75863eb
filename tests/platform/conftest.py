"""Fixtures and settings shared by the platform tests."""

from __future__ import annotations

import sys
from pathlib import Path

# The live-platform harness (platform_harness.py and its task, platform_job.py) still sits in
# tests/multiproc until it moves into the testing wing (fireflyer.testing.live_platform); until
# then its folder goes on the path so test_platform_local/_full_disk/_train can import it.
_HARNESS = Path(__file__).resolve().parent.parent / "multiproc"
if (_HARNESS / "platform_harness.py").is_file() and str(_HARNESS) not in sys.path:
    sys.path.insert(0, str(_HARNESS))
