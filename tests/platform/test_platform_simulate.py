"""The day simulator: conservation, accounting, determinism, preemption rules, FIFO order, the workload."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fireflyer.platform.state.policy import PolicyConfig, Priority
from fireflyer.platform.state.simulate import (
    DEFAULT_CLASSES,
    POLICIES,
    Job,
    JobClass,
    SimConfig,
    compare,
    make_workload,
    offered_node_hours,
    percentile,
    simulate,
)

P = Priority
LIGHT = (
    JobClass(name="train", priority=P.NORMAL, count=6, sizes=(2, 4), hours=(1.0, 3.0), arrive=(0, 10)),
    JobClass(name="bg", priority=P.LOW, count=6, sizes=(1, 2), hours=(0.5, 2.0), arrive=(0, 10), at_start=2),
    JobClass(name="exp", priority=P.HIGH, count=8, sizes=(1, 2, 4), hours=(0.1, 0.5), arrive=(0, 12), bursts=3),
    JobClass(name="urgent", priority=P.VERY_HIGH, count=2, sizes=(8,), hours=(0.2, 0.5), arrive=(2, 12)),
)
"""A day with slack on 16 nodes: about 60 node-hours offered against 384."""
SMALL = SimConfig(nodes=16, zones=2, hours=24.0, step_s=60.0)


def job(i: int, nodes: int, work_s: float, submit_s: float, priority: Priority = P.NORMAL, user: str = "u0") -> Job:
    return Job(i, "t", user, "g0", priority, nodes, work_s, submit_s)


def work_node_s(jobs: list[Job]) -> float:
    return sum(j.nodes * j.work_s for j in jobs)


# ---------------------------------------------------------------------- conservation and accounting
@pytest.mark.parametrize("policy", POLICIES)
def test_no_node_is_double_booked_and_allocation_never_exceeds_capacity(policy):
    jobs = make_workload(LIGHT, seed=3, users=4, max_nodes=16)
    cfg = SimConfig(nodes=16, zones=2, hours=24.0, record_assignments=True)
    r = simulate(jobs, cfg, policy)
    names = {n.name for n in cfg.cluster()}
    for s in r.steps:
        held = [n for _, nodes in s.assignments for n in nodes]
        assert len(held) == len(set(held)) == s.busy <= cfg.nodes
        assert set(held) <= names
        assert len({j for j, _ in s.assignments}) == len(s.assignments)  # one task per chain at a time
    assert 0 <= r.useful_node_s <= r.allocated_node_s <= r.capacity_node_s


@pytest.mark.parametrize("policy", POLICIES)
def test_every_task_finishes_in_a_day_with_slack_and_useful_work_is_exactly_the_jobs_work(policy):
    jobs = make_workload(LIGHT, seed=1, users=4, max_nodes=16)
    r = simulate(jobs, SMALL, policy)
    assert r.finished == len(jobs) == len(r.jobs)
    assert all(j.first_start_s is not None and j.first_start_s >= j.submit_s for j in r.jobs)
    assert all(j.finish_s >= j.first_start_s + next(x.work_s for x in jobs if x.id == j.id) - 1e-6 for j in r.jobs)
    assert math.isclose(r.useful_node_s, work_node_s(jobs), rel_tol=1e-9)
    assert math.isclose(r.allocated_node_s, r.useful_node_s + r.lost_node_s + r.restart_node_s + r.suspend_node_s)


def test_fifo_never_preempts_nor_reorders_and_has_no_overheads():
    jobs = make_workload(DEFAULT_CLASSES, seed=5, max_nodes=64)
    r = simulate(jobs, SimConfig(nodes=64, zones=2, hours=24.0), "fifo")
    assert r.preemptions == 0 and r.lost_node_s == r.restart_node_s == r.suspend_node_s == 0
    assert all(j.attempts <= 1 for j in r.jobs)
    starts = [j.first_start_s for j in sorted(r.jobs, key=lambda j: j.id)]
    ran = [s for s in starts if s is not None]
    assert starts[: len(ran)] == ran, "a later job started while an earlier one had not"
    assert ran == sorted(ran)
    assert len(ran) < len(jobs)  # the day is busy: the queue was not empty at the end


def test_fifo_with_backfill_passes_a_blocked_head_but_never_preempts():
    jobs = [job(1, 3, 3600, 0), job(2, 4, 3600, 60), job(3, 1, 600, 120)]
    cfg = SimConfig(nodes=4, zones=1, hours=4.0)
    strict = {j.id: j.first_start_s for j in simulate(jobs, cfg, "fifo").jobs}
    back = {j.id: j.first_start_s for j in simulate(jobs, cfg, "fifo_backfill").jobs}
    assert strict == {1: 0.0, 2: 3600.0, 3: 3600.0 + 3600.0}  # job 3 fits at once but waits behind job 2
    assert back[3] == 120.0 and back[2] == 3600.0
    assert simulate(jobs, cfg, "fifo_backfill").preemptions == 0


def test_a_preempted_task_loses_work_since_its_checkpoint_pays_the_restart_and_resumes():
    # one NORMAL job holds the whole cluster; a HIGH one arrives at 630 s
    jobs = [job(1, 4, 7200, 0), job(2, 4, 1800, 630, P.HIGH, user="u1")]
    cfg = SimConfig(nodes=4, zones=1, hours=4.0, step_s=60, checkpoint_every_s=300, restart_cost_s=60, suspend_s=10)
    r = simulate(jobs, cfg, "hai")
    low, high = r.jobs
    (ev,) = r.preemption_events
    assert ev.t == 660 and ev.job == 1 and ev.priority == P.NORMAL and ev.top_queued == P.HIGH
    assert ev.lost_s == pytest.approx(60)  # ran 660 s, last checkpoint at 600 s
    assert high.first_start_s == 720 and high.finish_s == pytest.approx(720 + 1800)
    assert low.starts == (0.0, 2520.0) and low.attempts == 2
    assert low.finish_s == pytest.approx(2520 + 60 + (7200 - 600))
    assert r.lost_node_s == pytest.approx(4 * 60) and r.restart_node_s == pytest.approx(4 * 60)
    assert r.suspend_node_s == pytest.approx(4 * 10)
    fifo = {j.id: j for j in simulate(jobs, cfg, "fifo").jobs}
    assert fifo[2].first_start_s == 7200  # waits for the whole NORMAL job


def test_preemption_only_takes_nodes_from_lower_priorities_without_turn_taking():
    jobs = make_workload(DEFAULT_CLASSES, seed=2, max_nodes=64)
    r = simulate(jobs, SimConfig(nodes=64, zones=2, hours=24.0, policy=PolicyConfig(time_share_after=math.inf)), "hai")
    assert r.preemptions > 0
    for ev in r.preemption_events:
        assert ev.top_queued is not None and ev.priority < ev.top_queued, ev
        assert 0 <= ev.lost_s < 300


def test_with_turn_taking_a_task_is_only_preempted_for_its_own_priority_or_higher():
    jobs = make_workload(DEFAULT_CLASSES, seed=2, max_nodes=64)
    r = simulate(jobs, SimConfig(nodes=64, zones=2, hours=24.0, policy=PolicyConfig(time_share_after=3600.0)), "hai")
    assert r.preemptions > 0
    assert all(ev.top_queued is not None and ev.priority <= ev.top_queued for ev in r.preemption_events)


# ---------------------------------------------------------------------- determinism and the workload
def test_the_same_seed_gives_the_same_day_and_another_seed_another():
    a = compare(make_workload(seed=7, max_nodes=128), SimConfig())
    b = compare(make_workload(seed=7, max_nodes=128), SimConfig())
    for p in POLICIES:
        assert a[p].summary() == b[p].summary()
        assert a[p].steps == b[p].steps and a[p].jobs == b[p].jobs
    assert make_workload(seed=7) != make_workload(seed=8)


def test_the_workload_is_in_submission_order_with_backlog_and_bursts():
    jobs = make_workload(seed=0, max_nodes=48)
    assert [j.id for j in jobs] == list(range(1, len(jobs) + 1))
    assert [j.submit_s for j in jobs] == sorted(j.submit_s for j in jobs)
    assert len(jobs) == sum(c.count for c in DEFAULT_CLASSES)
    assert sum(1 for j in jobs if j.submit_s == 0) >= sum(c.at_start for c in DEFAULT_CLASSES)
    assert max(j.nodes for j in jobs) == 48  # clipped to the cluster
    high = sorted(j.submit_s for j in jobs if j.priority == P.HIGH)
    windows = {int(t // (2.5 * 3600)) for t in high}  # 8 bursts over 20 hours
    assert len(windows) <= 8
    for j in jobs:
        cls = next(c for c in DEFAULT_CLASSES if c.name == j.kind)
        assert cls.hours[0] * 3600 - 1 <= j.work_s <= cls.hours[1] * 3600 + 1
        assert j.priority == cls.priority
    # the documented day: offered work about equals 128 nodes x 24 h
    assert 0.95 < offered_node_hours() / (128 * 24) < 1.1


def test_bad_input_is_rejected_with_a_message():
    with pytest.raises(ValueError, match="unknown policy"):
        simulate([], SMALL, "lottery")
    with pytest.raises(ValueError, match="more than the cluster"):
        simulate([job(1, 17, 60, 0)], SMALL)
    with pytest.raises(ValueError, match="submission order"):
        simulate([job(2, 1, 60, 0), job(1, 1, 60, 0)], SMALL)
    with pytest.raises(ValueError, match="zones"):
        SimConfig(nodes=2, zones=3)
    with pytest.raises(ValueError, match="step_s"):
        SimConfig(step_s=0)
    with pytest.raises(ValueError, match="restart_cost_s"):
        SimConfig(restart_cost_s=-1)
    with pytest.raises(ValueError, match="hours"):
        JobClass(name="x", priority=P.LOW, count=1, sizes=(1,), hours=(2.0, 1.0))
    with pytest.raises(ValueError, match="at_start"):
        JobClass(name="x", priority=P.LOW, count=1, sizes=(1,), hours=(1.0, 2.0), at_start=2)


def test_percentile_is_nearest_rank():
    assert percentile([5.0], 95) == 5.0
    assert percentile(list(range(1, 101)), 95) == 95
    assert percentile([3, 1, 2], 50) == 2
    with pytest.raises(ValueError):
        percentile([], 50)


def test_waits_count_unstarted_jobs_with_their_wait_so_far_and_ignore_later_arrivals():
    jobs = [job(1, 4, 7200, 0), job(2, 4, 60, 0), job(3, 1, 60, 3 * 3600)]
    r = simulate(jobs, SimConfig(nodes=4, zones=1, hours=1.0), "fifo")
    w = r.waits(P.NORMAL)
    assert (w.jobs, w.started) == (2, 1)
    assert w.mean_s == pytest.approx(3600 / 2) and w.max_s == pytest.approx(3600)


# ---------------------------------------------------------------------- properties
jobs_strategy = st.lists(
    st.tuples(st.integers(1, 8), st.sampled_from(list(P)), st.integers(60, 4 * 3600), st.integers(0, 4 * 3600),
              st.integers(0, 3)),
    min_size=1, max_size=14)


@settings(max_examples=60, deadline=None)
@given(drafts=jobs_strategy, ckpt=st.sampled_from([120.0, 300.0]), share=st.sampled_from([1800.0, math.inf]))
def test_random_days_conserve_nodes_and_work(drafts, ckpt, share):
    drafts = sorted(drafts, key=lambda d: d[3])
    jobs = [Job(i + 1, "t", f"u{u}", "g0", p, n, float(w), float(at)) for i, (n, p, w, at, u) in enumerate(drafts)]
    cfg = SimConfig(nodes=8, zones=2, hours=8.0, step_s=120.0, checkpoint_every_s=ckpt,
                    policy=PolicyConfig(time_share_after=share))
    for policy in POLICIES:
        r = simulate(jobs, cfg, policy)  # double-booking would trip the simulator's own invariant
        assert all(s.busy <= cfg.nodes for s in r.steps)
        assert -1e-6 <= r.useful_node_s <= r.allocated_node_s + 1e-6 <= r.capacity_node_s + 1e-6
        assert r.useful_node_s <= work_node_s(jobs) + 1e-6
        finished = [j for j in r.jobs if j.finish_s is not None]
        assert all(j.finish_s <= cfg.hours * 3600 + 1e-6 for j in finished)
        if policy != "hai":
            assert r.preemptions == 0 and all(j.attempts <= 1 for j in r.jobs)
        else:
            assert all(ev.top_queued is not None and ev.priority <= ev.top_queued for ev in r.preemption_events)
            if share == math.inf:
                assert all(ev.priority < ev.top_queued for ev in r.preemption_events)
        if policy == "fifo":
            ran = [j.first_start_s for j in sorted(r.jobs, key=lambda j: j.id) if j.first_start_s is not None]
            assert ran == sorted(ran)
