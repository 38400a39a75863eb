"""The scheduler's pure policy: priorities, chains, quotas, turns, preemption, zones, drained nodes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fireflyer.platform.state.policy import (
    QUEUED,
    RUNNING,
    SUSPENDING,
    Node,
    PolicyConfig,
    Priority,
    Task,
    order_tasks,
    schedule,
)

P = Priority


def nodes(n: int, zones: int = 1, **kw) -> list[Node]:
    per = -(-n // zones)
    return [Node(f"n{i:03d}", zone=f"z{i // per}", **kw) for i in range(n)]


def started(dec) -> dict[int, tuple[str, ...]]:
    return {s.task_id: s.nodes for s in dec.starts}


def test_whole_nodes_all_or_nothing_in_priority_then_queue_order():
    dec = schedule(nodes(4), [Task(1, "a", 3), Task(2, "b", 2, P.HIGH), Task(3, "c", 2)])
    assert set(started(dec)) == {2, 3} or set(started(dec)) == {2}
    assert 1 in dec.waiting  # 3 nodes do not fit beside the HIGH task's 2
    assert all(len(v) == t for k, v in started(dec).items() for t in [{2: 2, 3: 2}[k]])


def test_a_big_task_is_not_starved_by_smaller_ones_of_its_priority_but_lower_ones_may_fill_in():
    ns = nodes(4)
    running = Task(1, "a", 2, state=RUNNING, assigned=("n000", "n001"), run_seconds=10)
    dec = schedule(ns, [running, Task(2, "b", 4), Task(3, "c", 1), Task(4, "d", 1, P.LOW)])
    assert 2 in dec.waiting and "behind" in dec.waiting[3]
    assert 4 in started(dec)  # a lower priority may use the gap; it will be preempted later


def test_preemption_suspends_lower_priority_and_waits_for_its_nodes():
    ns = nodes(4)
    low = Task(1, "a", 4, P.LOW, state=RUNNING, assigned=tuple(n.name for n in ns), run_seconds=5)
    dec = schedule(ns, [low, Task(2, "b", 2, P.HIGH)])
    assert [s.task_id for s in dec.suspends] == [1]
    assert 2 in dec.waiting and not dec.starts  # starts once the suspended task has stopped
    # next cycle: the low task is suspending (nodes still busy), then gone
    dec = schedule(ns, [Task(1, "a", 4, P.LOW, state=SUSPENDING, assigned=low.assigned), Task(2, "b", 2, P.HIGH)])
    assert not dec.starts
    dec = schedule(ns, [Task(3, "a", 4, P.LOW, chain_first_id=1), Task(2, "b", 2, P.HIGH)])
    assert set(started(dec)) == {2} and 3 in dec.waiting


def test_a_resumed_chain_keeps_its_place_in_the_queue():
    ns = nodes(2)
    # task 9 is the new attempt of chain 1; it goes before task 5 submitted after the chain began
    dec = schedule(ns, [Task(5, "b", 2), Task(9, "a", 2, chain_first_id=1)])
    assert set(started(dec)) == {9}


def test_never_interrupted_for_the_same_user_at_the_same_priority():
    ns = nodes(2)
    old = Task(1, "a", 2, state=RUNNING, assigned=("n000", "n001"), run_seconds=10**6)
    dec = schedule(ns, [old, Task(2, "a", 2)])
    assert not dec.suspends and 2 in dec.waiting


def test_users_take_turns_after_the_time_share_threshold():
    ns = nodes(2)
    cfg = PolicyConfig(time_share_after=3600)
    young = Task(1, "a", 2, state=RUNNING, assigned=("n000", "n001"), run_seconds=100)
    assert not schedule(ns, [young, Task(2, "b", 2)], cfg=cfg).suspends
    old = Task(1, "a", 2, state=RUNNING, assigned=("n000", "n001"), run_seconds=7200)
    dec = schedule(ns, [old, Task(2, "b", 2)], cfg=cfg)
    assert [s.task_id for s in dec.suspends] == [1]  # b holds nothing at this priority: b's turn


def test_quotas_per_user_group_priority_with_public_default_and_user_override():
    ns = nodes(8)
    quotas = {("public", "default", P.NORMAL): 2, ("vip", "default", P.NORMAL): 6}
    dec = schedule(ns, [Task(1, "a", 2), Task(2, "a", 1), Task(3, "vip", 5)], quotas)
    assert set(started(dec)) == {1, 3}
    assert "over quota" in dec.waiting[2]


def test_drained_and_unhealthy_nodes_are_never_used_and_their_tasks_are_suspended():
    ns = [Node("n0"), Node("n1", drained=True), Node("n2", healthy=False), Node("n3")]
    run = Task(1, "a", 2, state=RUNNING, assigned=("n0", "n1"), run_seconds=5)
    dec = schedule(ns, [run, Task(2, "b", 1)])
    assert dec.suspends[0].task_id == 1 and "drained" in dec.suspends[0].reason
    assert started(dec) == {2: ("n3",)}
    assert "usable" in schedule(ns, [Task(3, "c", 3)]).waiting[3]


def test_zones_best_fit_then_one_cross_zone_task_crossing_once():
    ns = nodes(8, zones=2)  # z0: n000-n003, z1: n004-n007
    busy = Task(1, "a", 1, state=RUNNING, assigned=("n000",), run_seconds=1)
    dec = schedule(ns, [busy, Task(2, "b", 3)])
    assert started(dec)[2] == ("n001", "n002", "n003")  # the fuller zone that still fits
    dec = schedule(ns, [busy, Task(3, "b", 6), Task(4, "c", 1, P.LOW)])
    placed = started(dec)[3]
    zones = [int(n[1:]) // 4 for n in placed]
    assert len(set(zones)) == 2 and sum(a != b for a, b in zip(zones, zones[1:])) == 1  # one rank pair crosses
    cross = Task(5, "d", 6, state=RUNNING, assigned=("n000", "n001", "n002", "n004", "n005", "n006"), run_seconds=1)
    dec = schedule(ns, [cross, Task(6, "e", 2)])
    assert 6 in dec.waiting  # a second cross-zone task is not allowed


def test_zones_count_when_claiming_so_a_big_task_preempts_inside_one_zone_instead_of_waiting():
    ns = nodes(8, zones=2)  # z0: n000-n003, z1: n004-n007
    cross = Task(1, "a", 2, P.LOW, state=RUNNING, assigned=("n003", "n004"), run_seconds=1)  # holds the crossing
    low = Task(2, "b", 2, P.LOW, state=RUNNING, assigned=("n005", "n006"), run_seconds=1)
    normal = Task(3, "c", 1, P.NORMAL, state=RUNNING, assigned=("n000",), run_seconds=1)
    big = Task(4, "d", 4, P.ABOVE_NORMAL)
    small = Task(5, "e", 1, P.BELOW_NORMAL)
    dec = schedule(ns, [cross, low, normal, big, small])
    # 3 nodes are free (n001, n002, n007) but no zone has 4: the big task takes zone 1 from the LOW tasks
    assert sorted(s.task_id for s in dec.suspends) == [1, 2] and 4 in dec.waiting
    assert started(dec) == {5: ("n001",)}  # a lower priority fills a gap the big task does not need


def test_free_nodes_are_taken_before_anyone_is_preempted_and_then_the_latest_in_order_goes():
    ns = nodes(6)
    low = Task(1, "a", 2, P.LOW, state=RUNNING, assigned=("n000", "n001"), run_seconds=1)
    normal = Task(2, "b", 2, P.NORMAL, state=RUNNING, assigned=("n002", "n003"), run_seconds=1)
    dec = schedule(ns, [low, normal, Task(3, "c", 2, P.HIGH)])
    assert not dec.suspends and started(dec) == {3: ("n004", "n005")}
    dec = schedule(ns, [low, normal, Task(3, "c", 4, P.HIGH)])
    assert [s.task_id for s in dec.suspends] == [1] and 3 in dec.waiting  # LOW goes, NORMAL stays


def test_above_normal_counts_as_normal_after_half_an_hour():
    ns = nodes(2)
    young = Task(1, "a", 2, P.ABOVE_NORMAL, state=RUNNING, assigned=("n000", "n001"), run_seconds=60)
    old = Task(1, "a", 2, P.ABOVE_NORMAL, state=RUNNING, assigned=("n000", "n001"), run_seconds=31 * 60)
    newcomer = Task(2, "b", 2, P.ABOVE_NORMAL)
    assert not schedule(ns, [young, newcomer]).suspends  # protected among its equals
    assert [s.task_id for s in schedule(ns, [old, newcomer]).suspends] == [1]  # demoted: the newcomer goes first
    assert not schedule(ns, [old, Task(3, "c", 2, P.NORMAL)]).suspends  # still protected among NORMAL tasks
    assert not schedule(ns, [old, newcomer], cfg=PolicyConfig(demote_after=None)).suspends
    with pytest.raises(ValueError, match="demote_after"):
        PolicyConfig(demote_after=-1)


def test_priority_names_and_bad_values():
    assert P.parse("high") is P.HIGH and P.parse(40) is P.VERY_HIGH and P.parse("10") is P.NORMAL
    with pytest.raises(ValueError, match="EXTREME_HIGH"):
        P.parse("urgent")
    with pytest.raises(ValueError, match="time_share_after"):
        PolicyConfig(time_share_after=-1)


@pytest.mark.parametrize("cfg", [PolicyConfig(), PolicyConfig(default_quota=2)], ids=["no default", "default 2"])
@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=25),
    prios=st.lists(st.sampled_from(list(P)), min_size=25, max_size=25),
    running=st.lists(st.booleans(), min_size=25, max_size=25),
    n_nodes=st.integers(1, 16),
    zones=st.integers(1, 3),
)
def test_invariants(cfg, sizes, prios, running, n_nodes, zones):
    ns = nodes(n_nodes, zones)
    free = [n.name for n in ns]
    tasks = []
    for i, size in enumerate(sizes):
        if running[i] and size <= len(free):
            tasks.append(Task(i, f"u{i % 3}", size, prios[i], state=RUNNING, assigned=tuple(free[:size]),
                              run_seconds=i * 100.0))
            free = free[size:]
        else:
            tasks.append(Task(i, f"u{i % 3}", size, prios[i]))
    dec = schedule(ns, tasks, cfg=cfg)
    busy = {n for t in tasks if t.state != QUEUED for n in t.assigned}
    got = [n for s in dec.starts for n in s.nodes]
    assert len(got) == len(set(got)) and not set(got) & busy  # no node twice, none already in use
    by_id = {t.id: t for t in tasks}
    for s in dec.starts:
        assert by_id[s.task_id].state == QUEUED and len(s.nodes) == by_id[s.task_id].nodes
    queued = {t.id for t in tasks if t.state == QUEUED}
    assert queued == {s.task_id for s in dec.starts} | set(dec.waiting)
    # a suspended task is never of higher priority than every task that claimed its place
    for sus in dec.suspends:
        assert by_id[sus.task_id].state == RUNNING
    assert len(order_tasks(tasks, cfg)) == len(tasks)  # ordering is total


# ---------------------------------------------------------------------- the default quota
def test_a_user_alone_may_borrow_every_node_beyond_the_default_quota():
    dec = schedule(nodes(4), [Task(1, "a", 4), Task(2, "a", 1, P.LOW)], cfg=PolicyConfig(default_quota=2))
    assert set(started(dec)) == {1} and not dec.suspends


def test_another_users_task_takes_back_borrowed_nodes_at_once():
    ns = nodes(4)
    cfg = PolicyConfig(default_quota=2)  # time_share_after: 4 h, so without the default a would keep all four
    a = Task(1, "a", 4, state=RUNNING, assigned=tuple(n.name for n in ns), run_seconds=60)
    dec = schedule(ns, [a, Task(2, "b", 2)], cfg=cfg)
    assert [s.task_id for s in dec.suspends] == [1] and "default quota of 2" in dec.suspends[0].reason
    assert "waiting for preempted" in dec.waiting[2]
    assert not schedule(ns, [a, Task(2, "b", 2)], cfg=PolicyConfig()).suspends  # None: no default, no borrowing


def test_a_task_within_the_default_quota_is_never_preempted_by_a_borrower():
    ns = nodes(4)
    cfg = PolicyConfig(default_quota=2)
    a = Task(1, "a", 2, state=RUNNING, assigned=("n000", "n001"), run_seconds=60)
    dec = schedule(ns, [a, Task(2, "b", 4)], cfg=cfg)  # b's 4 nodes are beyond its quota: it only borrows
    assert not dec.suspends and "only borrows" in dec.waiting[2]
    dec = schedule(ns, [a, Task(2, "b", 2), Task(3, "a", 2)], cfg=cfg)  # a's second task would borrow
    assert set(started(dec)) == {2} and 3 in dec.waiting


def test_borrowers_do_not_block_each_other():
    dec = schedule(nodes(2), [Task(1, "a", 2), Task(2, "b", 2)], cfg=PolicyConfig(default_quota=1))
    assert len(dec.starts) == 1


def test_a_quota_row_is_a_hard_limit_not_a_default():
    quotas = {("a", "default", P.NORMAL): 1}
    dec = schedule(nodes(4), [Task(1, "a", 2), Task(2, "c", 4)], quotas, PolicyConfig(default_quota=2))
    assert "over quota: a may hold 1" in dec.waiting[1] and set(started(dec)) == {2}  # c borrows what is idle


def test_the_platforms_default_quota_is_half_its_nodes_rounded_up():
    from fireflyer.platform.config import PlatformConfig

    assert PlatformConfig(nodes=5).policy.for_nodes(5).default_quota == 3
    assert PlatformConfig(nodes=5).policy.for_nodes(8).default_quota == 4  # Slurm: the nodes the store has
    assert PlatformConfig(policy=PolicyConfig(default_quota=None)).policy.for_nodes(2).default_quota is None
    assert PlatformConfig(policy=PolicyConfig(default_quota=1)).policy.for_nodes(2).default_quota == 1
    for bad in (-1, "all", 1.5, True):
        with pytest.raises(ValueError, match="default_quota"):
            PlatformConfig(policy=PolicyConfig(default_quota=bad))
