"""Fixtures shared by the fabric tests."""

from __future__ import annotations

import pytest

from fireflyer.fabric import topology
from fireflyer.fabric.routing import Network


@pytest.fixture(scope="module")
def net():
    """Fire-Flyer 2's network: two 800-port zones, 625 nodes in each."""
    return Network(topology.zoned(1250, 40, frames=True), nodes_per_zone=625)
