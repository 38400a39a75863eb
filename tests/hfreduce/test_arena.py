"""The node's shared-memory arena, on the real /dev/shm (every test cleans up after itself)."""

from __future__ import annotations

import os
import stat
import threading
import time
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fireflyer.hfreduce.transport import arena as arena_mod
from fireflyer.hfreduce.transport import futex
from fireflyer.hfreduce.transport.arena import (
    MAGIC,
    NAME_PREFIX,
    STAGES,
    Arena,
    ArenaShape,
    arena_path,
    reached,
    sweep_stale,
)
from fireflyer.hfreduce.errors import HFReduceError

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")

SHAPE = ArenaShape(local_size=2, chunk_bytes=4096, depth=2)
# Every name this module makes starts with this and ends in our (live) pid, so a
# concurrent sweep_stale elsewhere never takes our arenas, and we can find leftovers.
_TAG = f"{NAME_PREFIX}unittest-{uuid.uuid4().hex[:8]}-"


def _ours() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(_TAG)]


class _Arenas:
    def __init__(self) -> None:
        self.names: list[str] = []
        self.opened: list[Arena] = []

    def name(self) -> str:
        name = f"{_TAG}{uuid.uuid4().hex[:8]}-{os.getpid()}"
        self.names.append(name)
        return name

    def create(self, shape: ArenaShape = SHAPE, name: str | None = None) -> Arena:
        a = Arena.create(name or self.name(), shape)
        self.opened.append(a)
        return a

    def attach(self, name: str, shape: ArenaShape = SHAPE, timeout: float = 1.0) -> Arena:
        a = Arena.attach(name, shape, timeout)
        self.opened.append(a)
        return a


@pytest.fixture
def arenas():
    made = _Arenas()
    try:
        yield made
    finally:
        for a in made.opened:
            a.close()
        for name in made.names:
            try:
                os.unlink(arena_path(name))
            except FileNotFoundError:
                pass
    assert _ours() == [], "a test left an arena behind in /dev/shm"


def _dead_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        pid = int(f.read()) - 1
    while pid > 1:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1
    pytest.skip("no free pid found")


# -- life cycle --------------------------------------------------------------------


def test_create_makes_a_private_file_of_total_bytes(arenas) -> None:
    old = os.umask(0)  # 0600 must not depend on the caller's umask
    try:
        a = arenas.create()
    finally:
        os.umask(old)
    st_ = os.stat(arena_path(a.name))
    assert stat.S_IMODE(st_.st_mode) == 0o600
    assert st_.st_size == SHAPE.total_bytes
    assert a.bytes.numel() == SHAPE.total_bytes
    assert int.from_bytes(bytes(a.bytes[:4].tolist()), "little") == MAGIC
    assert not a.aborted()
    assert all(a.read_flag(s, k) == 0 for s in STAGES for k in range(SHAPE.local_size))


def test_attach_sees_the_same_bytes_and_flags(arenas) -> None:
    a = arenas.create()
    b = arenas.attach(a.name)
    off = SHAPE.in_offset(1, 1)
    a.bytes[off : off + 4] = a.bytes.new_tensor([1, 2, 3, 250])
    assert b.bytes[off : off + 4].tolist() == [1, 2, 3, 250]
    b.bytes[SHAPE.out_offset(0)] = 7
    assert a.bytes[SHAPE.out_offset(0)].item() == 7

    b.publish("red", 1, 41)
    assert a.read_flag("red", 1) == 41
    a.set_pid(1, 123456)
    assert b.pid(1) == 123456
    a.write_descriptor(0, b"descriptor-bytes")
    assert b.descriptor(0, 16) == b"descriptor-bytes"
    a.write_descriptor(1, b"in another slot", buf=1)
    assert b.descriptor(1, 15, buf=1) == b"in another slot" and b.descriptor(0, 16) == b"descriptor-bytes"


@pytest.mark.parametrize(
    "other",
    [
        ArenaShape(local_size=1, chunk_bytes=4096, depth=2),
        ArenaShape(local_size=2, chunk_bytes=2048, depth=2),
        ArenaShape(local_size=2, chunk_bytes=4096, depth=1),
    ],
    ids=["local_size", "chunk_bytes", "depth"],
)
def test_attach_with_a_different_shape_raises(arenas, other: ArenaShape) -> None:
    a = arenas.create()
    assert other.total_bytes <= SHAPE.total_bytes  # big enough to map, so the header check decides
    with pytest.raises(HFReduceError, match="different shape"):
        arenas.attach(a.name, other)


def test_attach_with_a_larger_shape_times_out(arenas) -> None:
    a = arenas.create()
    bigger = ArenaShape(local_size=4, chunk_bytes=4096, depth=2)
    with pytest.raises(HFReduceError, match="timed out"):
        arenas.attach(a.name, bigger, timeout=0.1)


def test_attach_to_a_missing_arena_times_out(arenas) -> None:
    with pytest.raises(HFReduceError, match="timed out"):
        arenas.attach(arenas.name(), timeout=0.05)


@pytest.mark.parametrize(
    "header,error",
    [(b"JUNK" * 8, "different shape"), (b"", "initialised")],
    ids=["foreign-file", "uninitialised-file"],
)
def test_attach_to_a_file_that_is_not_an_arena_raises(arenas, header: bytes, error: str) -> None:
    name = arenas.name()
    fd = os.open(arena_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, SHAPE.total_bytes)
        os.pwrite(fd, header, 0)
    finally:
        os.close(fd)
    with pytest.raises(HFReduceError, match=error):
        arenas.attach(name, timeout=0.2)


def test_attach_waits_for_a_create_in_progress(arenas) -> None:
    # Reproduce the window inside Arena.create: the file has its full size, the header is not written yet.
    name = arenas.name()
    fd = os.open(arena_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, SHAPE.total_bytes)

    def finish_create() -> None:
        time.sleep(0.2)
        os.pwrite(fd, arena_mod._HEADER.pack(MAGIC, SHAPE.local_size, SHAPE.depth, 0, SHAPE.chunk_bytes), 0)

    t = threading.Thread(target=finish_create)
    t.start()
    try:
        b = arenas.attach(name, timeout=3.0)
        assert b.shape == SHAPE
    finally:
        t.join()
        os.close(fd)


def test_create_on_an_existing_name_raises_and_leaves_it_alone(arenas) -> None:
    a = arenas.create()
    a.publish("in", 0, 9)
    with pytest.raises(HFReduceError, match="already exists"):
        Arena.create(a.name, SHAPE)
    assert os.path.exists(arena_path(a.name))
    b = arenas.attach(a.name)
    assert b.read_flag("in", 0) == 9


def test_unlink_removes_the_file_but_mappings_stay_usable(arenas) -> None:
    a = arenas.create()
    b = arenas.attach(a.name)
    a.unlink()
    assert not os.path.exists(arena_path(a.name))
    a.unlink()  # a second unlink is quiet
    a.publish("out", 1, 77)
    assert b.read_flag("out", 1) == 77
    b.bytes[SHAPE.red_offset(1)] = 99
    assert a.bytes[SHAPE.red_offset(1)].item() == 99
    with pytest.raises(HFReduceError):
        Arena.attach(a.name, SHAPE, timeout=0.05)


def test_close_releases_the_mapping(arenas) -> None:
    a = arenas.create()
    view = a.bytes[:16]  # a live view must not make close() raise
    a.close()
    assert a.bytes is None
    del view


# -- flags -------------------------------------------------------------------------


def test_flags_are_independent_and_on_their_own_cache_lines(arenas) -> None:
    shape = ArenaShape(local_size=3, chunk_bytes=4096, depth=2)
    a = arenas.create(shape)
    slots = [(s, k) for s in STAGES for k in range(shape.local_size)]
    addresses = sorted(a.flag_address(s, k) for s, k in slots)
    assert len(set(addresses)) == len(slots)
    assert all(y - x >= 64 for x, y in zip(addresses, addresses[1:]))
    assert all(addr % 4 == 0 for addr in addresses)
    assert shape.flags_offset >= 24  # the header comes first
    for i, (s, k) in enumerate(slots):
        a.publish(s, k, 1000 + i)
    assert [a.read_flag(s, k) for s, k in slots] == [1000 + i for i in range(len(slots))]


def test_publish_and_read_flag_wrap_modulo_2_32(arenas) -> None:
    a = arenas.create()
    b = arenas.attach(a.name)
    for value, want in [(2**31 - 1, 2**31 - 1), (2**31, 2**31), (2**32 - 1, 2**32 - 1), (2**32, 0), (2**32 + 5, 5), (-1, 2**32 - 1)]:
        a.publish("done", 0, value)
        assert b.read_flag("done", 0) == want
    # a counter that wrapped still counts as past the targets just below 2**32
    a.publish("done", 1, 2**32 + 2)
    assert reached(b.read_flag("done", 1), 2**32 - 3)
    assert not reached(b.read_flag("done", 1), 3)


def test_reached_examples() -> None:
    assert reached(5, 5)
    assert reached(6, 5)
    assert not reached(4, 5)
    assert reached(1, 2**32 - 1)  # wrapped past the target
    assert not reached(2**32 - 1, 1)
    assert reached(0, 0)


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**31 - 1))
def test_reached_is_true_up_to_half_the_ring_ahead(target: int, ahead: int) -> None:
    assert reached((target + ahead) & 0xFFFFFFFF, target)


@given(st.integers(0, 2**32 - 1), st.integers(1, 2**31))
def test_reached_is_false_behind(target: int, behind: int) -> None:
    assert not reached((target - behind) & 0xFFFFFFFF, target)


# -- abort -------------------------------------------------------------------------


def test_abort_is_seen_by_every_mapping_and_keeps_the_first_message(arenas) -> None:
    a = arenas.create()
    b = arenas.attach(a.name)
    assert not a.aborted() and not b.aborted()
    assert b.abort_message() == ""
    b.abort("rank 3 (node 1, local rank 1) died: boom ✗")
    assert a.aborted() and b.aborted()
    assert a.abort_message() == "rank 3 (node 1, local rank 1) died: boom ✗"
    a.abort("a later failure")
    assert b.abort_message() == "rank 3 (node 1, local rank 1) died: boom ✗"


def test_abort_wakes_a_waiter_sleeping_on_a_flag(arenas) -> None:
    a = arenas.create()
    b = arenas.attach(a.name)
    addr = b.flag_address("out", 1)
    woke: list[str] = []
    started = threading.Event()

    def waiter() -> None:
        started.set()
        deadline = time.monotonic() + 5.0
        while b.read_flag("out", 1) == 0 and not b.aborted() and time.monotonic() < deadline:
            futex.wait(addr, 0, timeout=5.0)
        woke.append(b.abort_message())

    t = threading.Thread(target=waiter)
    t.start()
    started.wait(5.0)
    time.sleep(0.05)
    a.abort("local rank 0 failed")
    t.join(5.0)
    assert not t.is_alive()
    assert woke == ["local rank 0 failed"]


@pytest.mark.parametrize("message", ["x" * 10_000, "€" * 1000, ""])
def test_abort_with_long_or_odd_messages_truncates_without_crashing(arenas, message: str) -> None:
    a = arenas.create()
    b = arenas.attach(a.name)
    flags_before = [a.read_flag(s, k) for s in STAGES for k in range(SHAPE.local_size)]
    descriptor_before = a.descriptor(SHAPE.local_size - 1, 64)
    a.abort(message)
    assert b.aborted()
    got = b.abort_message()
    assert len(got.encode()) <= 2048
    if message.startswith("x"):
        assert got == "x" * 2044
    elif message:
        # cut inside a 3-byte character: the complete ones survive, the tail is replaced
        assert got.startswith("€" * 681)
        assert len(got.encode(errors="replace")) <= 2048
    else:
        assert got == ""
    # the message stays inside its own region
    assert [a.read_flag(s, k) for s in STAGES for k in range(SHAPE.local_size)] == flags_before
    assert a.descriptor(SHAPE.local_size - 1, 64) == descriptor_before
    assert SHAPE.abort_offset + 64 + 2048 <= SHAPE.control_bytes


# -- layout ------------------------------------------------------------------------


@given(st.integers(1, 64), st.sampled_from([4096, 8192, 65536, 1 << 20]), st.integers(2, 8))
def test_shape_regions_do_not_overlap(local_size: int, chunk_bytes: int, depth: int) -> None:
    s = ArenaShape(local_size=local_size, chunk_bytes=chunk_bytes, depth=depth)
    regions = [
        (0, 24),  # header
        (s.flags_offset, s.pid_offset),
        (s.pid_offset, s.pid_offset + 8 * local_size),
        (s.desc_offset, s.desc_offset + 64 * local_size * depth),
        (s.abort_offset, s.abort_offset + 64 + 2048),
    ]
    regions += [(s.in_offset(b, k), s.in_offset(b, k) + chunk_bytes) for b in range(depth) for k in range(local_size)]
    regions += [(s.red_offset(b), s.red_offset(b) + chunk_bytes) for b in range(depth)]
    regions += [(s.out_offset(b), s.out_offset(b) + chunk_bytes) for b in range(depth)]
    regions.sort()
    for (_, end), (start, _) in zip(regions, regions[1:]):
        assert end <= start
    assert regions[-1][1] == s.total_bytes
    assert s.flag_index(STAGES[-1], local_size - 1) * 4 + 4 <= s.pid_offset
    assert s.control_bytes % 4096 == 0
    assert s.in_offset(0, 0) % 64 == 0  # chunk buffers start cache-line aligned


# -- sweep_stale -------------------------------------------------------------------


def test_sweep_stale_removes_only_arenas_of_dead_pids(tmp_path) -> None:
    dead = _dead_pid()
    names = {
        "dead": f"{NAME_PREFIX}abc123-0-{dead}",
        "live": f"{NAME_PREFIX}abc123-1-{os.getpid()}",
        "not_a_pid": f"{NAME_PREFIX}abc123-x",
        "no_suffix": f"{NAME_PREFIX}",
        "foreign": f"something-else-{dead}",
    }
    for n in names.values():
        (tmp_path / n).write_bytes(b"\0" * 64)
    removed = sweep_stale(str(tmp_path))
    assert removed == [names["dead"]]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(v for k, v in names.items() if k != "dead")


def test_sweep_stale_on_a_missing_dir_is_empty(tmp_path) -> None:
    assert sweep_stale(str(tmp_path / "nope")) == []


def test_sweep_stale_survives_an_out_of_range_pid_suffix(tmp_path) -> None:
    dead = _dead_pid()
    (tmp_path / f"{NAME_PREFIX}x-99999999999").write_bytes(b"")
    (tmp_path / f"{NAME_PREFIX}y-{dead}").write_bytes(b"")
    removed = sweep_stale(str(tmp_path))
    assert f"{NAME_PREFIX}y-{dead}" in removed



# -- waits -----------------------------------------------------------------------------


def test_a_wait_counts_a_flag_published_just_before_the_peer_died(arenas) -> None:
    """The peer publishes and dies while the waiter checks for failures: the wait returns, the flag counts.

    (The race behind a fault-matrix flake: a rank whose peer finished a collective and then
    exited raised PeerFailure although every flag it needed was up.)"""
    a = arenas.create()

    def check() -> None:  # the peer publishes, then the check finds it dead
        a.publish("red", 1, 5)
        raise HFReduceError("rank 1 died")

    a.wait("red", [1], 5, time.monotonic() + 5.0, check, lambda k: HFReduceError("timed out"))
    assert a.read_flag("red", 1) == 5


def test_a_wait_still_raises_when_the_flag_never_came(arenas) -> None:
    a = arenas.create()

    def check() -> None:
        raise HFReduceError("rank 1 died")

    with pytest.raises(HFReduceError, match="rank 1 died"):
        a.wait("red", [1], 5, time.monotonic() + 5.0, check, lambda k: HFReduceError("timed out"))
