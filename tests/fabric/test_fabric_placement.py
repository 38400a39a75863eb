"""The placement study: HAI (one cross-zone task at most, one crossing pair) against naive."""

import pytest

from fireflyer.errors import UserError
from fireflyer.fabric import catalog
from fireflyer.fabric.placement import place_hai, place_naive, render, study

TASKS = [400, 300, 200, 150, 100, 50, 50]


@pytest.fixture(scope="module")
def results(net):
    return study(net, catalog.default().node("pcie-a100"), TASKS)


def test_hai_lets_at_most_one_task_cross_zones_through_one_pair(results):
    hai = results["hai"]
    assert not hai.unplaced
    assert hai.cross_zone_tasks == 1
    crossing = [t for t in hai.tasks if t.zones > 1]
    assert len(crossing) == 1 and crossing[0].cross_zone_pairs == 1
    assert all(t.cross_zone_pairs == 0 for t in hai.tasks if t.zones == 1)
    # one pair: half a unit each way in each of the two trees
    assert hai.max_bridge_load == pytest.approx(1.0)


def test_naive_placement_floods_the_bridges(results):
    hai, naive = results["hai"], results["naive"]
    assert naive.cross_zone_tasks > 1
    assert naive.max_bridge_load > 10 * hai.max_bridge_load
    assert naive.bridge_traffic > 100 * hai.bridge_traffic
    assert naive.mean_algbw_gb_s < hai.mean_algbw_gb_s / 5
    assert naive.slowest_seconds > 5 * hai.slowest_seconds
    assert all(t.result.bottleneck.startswith("network") for t in naive.tasks)


def test_hai_tasks_run_near_their_single_task_speed(results):
    for t in results["hai"].tasks:
        assert 5.5 < t.result.algbw_gb_s < 9.4


def test_placements_use_each_node_once(net):
    for placed, _ in (place_hai(net, TASKS), place_naive(net, TASKS, seed=3)):
        slots = [(int(z), int(p)) for pl in placed for z, p in zip(pl.zone, pl.port)]
        assert len(slots) == len(set(slots)) == sum(TASKS)


def test_hai_refuses_a_second_cross_zone_task(net):
    placed, unplaced = place_hai(net, [500, 500, 200, 50])
    assert unplaced == [50] or sum(p.zones_used > 1 for p in placed if p is not None) <= 1
    assert sum(p.zones_used > 1 for p in placed if p is not None) <= 1


def test_render_and_errors(net, results):
    text = render(results)
    assert "hai" in text and "naive" in text
    with pytest.raises(UserError):
        study(net, catalog.default().node("pcie-a100"), [])
