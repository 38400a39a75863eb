"""The testing wing's ``/dev/shm`` check tells a test's leftovers from the segments of tests running beside it: a
segment whose creator lives outside this session is another's; one whose creator is gone, or is this process, is
counted."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from fireflyer import lifetime
from fireflyer.testing import shm

pytestmark = pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="needs /dev/shm")

HOLD = """
import os, sys, time
open(os.path.join("/dev/shm", sys.argv[1] + str(os.getpid())), "w").close()
print("made", flush=True)
time.sleep(60)
"""


def _make(name: str) -> str:
    open(os.path.join(shm.SHM_DIR, name), "w").close()
    return name


def test_the_creator_is_read_off_hfreduces_and_torchs_names():
    assert shm.creator("fireflyer-hfr-job-x0-4242") == 4242
    assert shm.creator("fireflyer-hfr-shared-0a1b-0-3-17") == 17
    assert shm.creator("torch_99_1234_0") == 99
    assert shm.creator("fireflyer-unnamed") is None


def test_a_segment_of_a_live_process_outside_the_session_is_left_out_and_counted_once_it_is_gone():
    before = shm.segments()
    env = {k: v for k, v in os.environ.items() if k != lifetime.MARK}  # another session: not under this one's mark
    other = subprocess.Popen([sys.executable, "-c", HOLD, "fireflyer-hfr-test-other-"], env=env,
                             stdout=subprocess.PIPE, text=True)
    name = f"fireflyer-hfr-test-other-{other.pid}"
    try:
        assert other.stdout.readline().strip() == "made"
        assert name in shm.segments() - before
        assert shm.new_since(before) == set(), "a live process of another session made it"
    finally:
        other.kill()
        other.wait()
    try:
        assert shm.left_behind(before, settle=0.5) == {name}, "its creator is gone: a leftover"
    finally:
        os.unlink(os.path.join(shm.SHM_DIR, name))


def test_a_segment_of_this_process_or_of_none_named_is_counted():
    before = shm.segments()
    mine = _make(f"fireflyer-hfr-test-mine-{os.getpid()}")
    anonymous = _make("fireflyer-test-anonymous")
    try:
        t0 = time.monotonic()
        assert shm.left_behind(before, settle=0.3) == {mine, anonymous}
        assert time.monotonic() - t0 >= 0.3, "it waited for them to go"
    finally:
        for name in (mine, anonymous):
            os.unlink(os.path.join(shm.SHM_DIR, name))
    assert shm.left_behind(before, settle=5.0) == set()
