"""``fireflyer bench parallel``: bad settings are one line before any run starts (the runs themselves are the
benchmark, not a test)."""

from __future__ import annotations

import pytest

from fireflyer.testing.cli import fireflyer, one_error_line


@pytest.mark.parametrize("args,needle", [
    (["--steps", "1"], "--steps must be 2 to 10000, got 1"),
    (["--rounds", "0"], "--rounds must be 1 to 100, got 0"),
    (["--cases", "pp 2x2"], "unknown case(s) 'pp 2x2'; choose from:"),
    (["--cases", ","], "unknown case(s) (none given)"),
])
def test_bad_settings_are_one_line(args, needle, tmp_path):
    done = fireflyer("bench", "parallel", *args, "--out", str(tmp_path), timeout=60)
    assert done.returncode == 2
    assert needle in one_error_line(done)
    assert not list(tmp_path.iterdir())
