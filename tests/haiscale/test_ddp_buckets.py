"""Bucket planning for haiscale DDP: pure, so checked on many shapes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fireflyer.haiscale.buckets import plan_buckets


@settings(max_examples=200, deadline=None)
@given(
    numels=st.lists(st.integers(1, 5000), min_size=1, max_size=40),
    data=st.data(),
    cap=st.integers(4, 20000),
    first=st.integers(4, 20000),
)
def test_buckets_partition_in_order_within_caps(numels, data, cap, first):
    n = len(numels)
    order = data.draw(st.permutations(range(n)))
    itemsizes = data.draw(st.lists(st.sampled_from([2, 4]), min_size=n, max_size=n))
    keys = itemsizes  # dtype stands in for (device, dtype)
    plan = plan_buckets(order, numels, itemsizes, keys, cap_bytes=cap, first_cap_bytes=first)
    assert [p for b in plan.buckets for p in b] == list(order)
    for b, params in enumerate(plan.buckets):
        assert len({keys[p] for p in params}) == 1
        nbytes = sum(numels[p] * itemsizes[p] for p in params)
        limit = first if b == 0 else cap
        assert nbytes <= limit or len(params) == 1
        offs = plan.offsets[b]
        assert offs[0] == 0
        for k in range(1, len(params)):
            assert offs[k] == offs[k - 1] + numels[params[k - 1]]
        assert plan.numels[b] == sum(numels[p] for p in params)
    where = plan.bucket_of()
    assert sorted(where) == list(range(n))


def test_first_bucket_is_smaller():
    plan = plan_buckets(list(range(10)), [100] * 10, [4] * 10, [0] * 10, cap_bytes=2000, first_cap_bytes=400)
    assert plan.buckets[0] == (0,) and plan.buckets[1] == (1, 2, 3, 4, 5)


@pytest.mark.parametrize("order,cap", [([0, 0], 10), ([0], 0)])
def test_bad_plans_are_rejected(order, cap):
    with pytest.raises(ValueError):
        plan_buckets(order, [1, 2][: len(order)], [4, 4][: len(order)], [0, 0][: len(order)], cap_bytes=cap, first_cap_bytes=4)


@settings(max_examples=200, deadline=None)
@given(
    numels=st.lists(st.integers(1, 3000), min_size=1, max_size=30),
    data=st.data(),
    cap=st.integers(4, 12000),
    first=st.integers(4, 12000),
)
def test_groups_never_share_a_bucket_and_buckets_follow_readiness(numels, data, cap, first):
    n = len(numels)
    order = data.draw(st.permutations(range(n)))
    groups = data.draw(st.lists(st.sampled_from(["dense", "expert"]), min_size=n, max_size=n))
    itemsizes = [4] * n
    plan = plan_buckets(order, numels, itemsizes, [0] * n, cap_bytes=cap, first_cap_bytes=first, groups=groups)
    assert sorted(p for b in plan.buckets for p in b) == list(range(n))
    position = {p: i for i, p in enumerate(order)}
    for params in plan.buckets:
        assert len({groups[p] for p in params}) == 1
        assert [position[p] for p in params] == sorted(position[p] for p in params)
    # launched in the order they fill: by the ready position of each bucket's last parameter
    lasts = [position[b[-1]] for b in plan.buckets]
    assert lasts == sorted(lasts)
    # per group, the buckets are exactly that group's one-group plan
    for g in set(groups):
        members = [p for p in order if groups[p] == g]
        alone = [b for b in plan.buckets if groups[b[0]] == g]
        assert [p for b in alone for p in b] == members


def test_one_group_plans_exactly_as_without_groups():
    order, numels = [3, 1, 0, 2], [50, 60, 70, 80]
    a = plan_buckets(order, numels, [4] * 4, [0] * 4, cap_bytes=400, first_cap_bytes=200)
    b = plan_buckets(order, numels, [4] * 4, [0] * 4, cap_bytes=400, first_cap_bytes=200, groups=["g"] * 4)
    assert a == b


def test_a_label_per_parameter_is_required():
    with pytest.raises(ValueError, match="one label per parameter"):
        plan_buckets([0, 1], [1, 1], [4, 4], [0, 0], cap_bytes=8, first_cap_bytes=8, groups=["a"])
