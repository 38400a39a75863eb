"""Suite-wide settings: flight recorder dumps from failing test collectives go to the session's tmp, not /tmp,
and the training records ``fireflyer train`` builds go there too, not to the user's ~/.cache. Every process the
suite starts carries the session's mark (fireflyer.lifetime), and whatever of them is left at its end is killed."""

from __future__ import annotations

import os
import signal

import pytest


@pytest.fixture(autouse=True, scope="session")
def _flight_dumps_in_tmp(tmp_path_factory):
    if "FIREFLYER_HFREDUCE_TRACE_DIR" not in os.environ:  # ranks (spawned or torchrun) inherit it
        os.environ["FIREFLYER_HFREDUCE_TRACE_DIR"] = str(tmp_path_factory.mktemp("flight-dumps"))
    yield


@pytest.fixture(autouse=True, scope="session")
def _data_cache_in_tmp(tmp_path_factory):
    if "FIREFLYER_DATA_CACHE" not in os.environ:  # ranks, launched jobs and platform tasks inherit it
        os.environ["FIREFLYER_DATA_CACHE"] = str(tmp_path_factory.mktemp("data-cache"))
    yield


@pytest.fixture(autouse=True, scope="session")
def _no_process_outlives_the_suite():
    from fireflyer import lifetime

    mark = os.environ.get(lifetime.MARK)
    if not mark:  # before any process starts: ranks, fork servers, daemons and launched jobs inherit it
        mark = os.environ[lifetime.MARK] = lifetime.child_mark()
    yield
    left = [pid for pid in lifetime.marked(mark) if not _multiprocessing_helper(pid)]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if left:
        print(f"\nthe suite left {len(left)} process(es) running; killed: {left}")


def _multiprocessing_helper(pid: int) -> bool:
    """This process's own fork server and resource tracker: they end with it (killed now, the tracker would be
    started anew at exit and complain about every semaphore it never saw)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            parent = int(f.read().rsplit(b")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except (OSError, ValueError, IndexError):
        return False
    return parent == os.getpid() and (b"multiprocessing.forkserver" in cmdline
                                      or b"multiprocessing.resource_tracker" in cmdline)
