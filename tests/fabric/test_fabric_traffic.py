"""The PCIe-traffic table (IV-B) and the 24x memory-traffic accounting (IV-D3)."""

import pytest

from fireflyer.fabric import paper
from fireflyer.fabric.traffic import (
    hfreduce_pcie_units,
    memory_traffic,
    ring_pcie_units,
    ring_pcie_units_paper,
)


@pytest.mark.parametrize("n", [2, 8, 16, 128, 1024])
def test_pcie_table(n):
    assert ring_pcie_units_paper(n) == pytest.approx((2 * n - 1) / n)
    assert ring_pcie_units(n) == pytest.approx(2 * (n - 1) / n)
    assert hfreduce_pcie_units() == 1.0
    # about twice HFReduce's, either way
    assert 1.0 <= ring_pcie_units(n) < ring_pcie_units_paper(n) < 2.0


def test_pcie_table_values():
    assert ring_pcie_units_paper(8) == pytest.approx(1.875)
    assert ring_pcie_units(8) == pytest.approx(1.75)
    assert hfreduce_pcie_units(nvlink=True) == 0.5


def test_memory_traffic_is_24x_and_caps_at_13_3():
    m = memory_traffic(8)
    assert m.phases == {"D2H": 8, "intra-node reduce": 9, "inter-node allreduce": 5, "H2D": 2}
    assert m.total == paper.MEMORY_TOTAL == 24
    assert m.ceiling_gb_s(paper.MEMORY_GB_S) == pytest.approx(paper.MEMORY_CEILING_GB_S, abs=0.05)


def test_memory_traffic_variants():
    assert memory_traffic(8, h2d="memcpy").total == 30          # 10.7 GB/s ceiling
    assert memory_traffic(8, h2d="memcpy").ceiling_gb_s(320) == pytest.approx(10.67, abs=0.01)
    assert memory_traffic(8, nvlink=True).total == 16           # 20 GB/s ceiling
