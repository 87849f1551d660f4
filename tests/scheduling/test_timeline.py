"""The timeline behind reservations: when each node has enough GPUs free, for one node or a gang."""

from __future__ import annotations

import numpy as np
import pytest

from scheduling.engine.framework import NEVER
from scheduling.engine.timeline import Slot, Timeline
from tests.scheduling.snapshots import node, snapshot
from tests.scheduling.worlds import NOW, view


def everywhere(snap) -> np.ndarray:
    return np.ones(len(snap), dtype=bool)


@pytest.fixture
def busy():
    """Row 0 (8 GPUs): 2 free, 2 more at +100 s, 4 more at +300 s. Row 1 (8): all 8 at +200 s.
    Row 2 (4 GPUs): all free."""
    snap = snapshot(node(gpus=8, free=2), node(gpus=8, free=0), node(gpus=4))
    ends = [(NOW + 300, ((0, 4),)), (NOW + 100, ((0, 2),)), (NOW + 200, ((1, 8),))]
    return snap, Timeline(snap, ends, NOW)


@pytest.mark.parametrize(
    ("gpus", "rows", "start", "row"),
    [
        pytest.param(4, [0, 1, 2], NOW, 2, id="free-now"),
        pytest.param(4, [0, 1], NOW + 100, 0, id="after-the-first-release"),
        pytest.param(6, [0, 1], NOW + 200, 1, id="the-node-that-frees-enough-first"),
        pytest.param(8, [0], NOW + 300, 0, id="after-every-release-on-the-node"),
    ],
)
def test_a_single_node_job_starts_where_enough_gpus_come_free_first(busy, gpus, rows, start, row):
    snap, timeline = busy
    candidates = np.isin(np.arange(len(snap)), rows)
    assert timeline.earliest(view(1, gpus), candidates) == Slot(start, 0, (row,))


def test_no_slot_when_the_gpus_never_come_free():
    snap = snapshot(node(gpus=8, free=2))
    timeline = Timeline(snap, [(NEVER, ((0, 6),))], NOW)
    assert timeline.earliest(view(1, 4), everywhere(snap)) is None
    assert timeline.earliest(view(1, 2), everywhere(snap)) == Slot(NOW, 0, (0,))


def test_no_slot_on_a_fleet_without_nodes():
    snap = snapshot()
    timeline = Timeline(snap, [], NOW)
    assert timeline.earliest(view(1, 4), everywhere(snap)) is None
    assert timeline.earliest(view(2, 8, nodes=2), everywhere(snap)) is None


def test_a_job_past_its_time_limit_frees_its_gpus_now():
    snap = snapshot(node(gpus=8, free=0))
    timeline = Timeline(snap, [(NOW - 50, ((0, 8),))], NOW)
    assert timeline.earliest(view(1, 8), everywhere(snap)) == Slot(NOW, 0, (0,))


def test_a_gang_starts_when_its_last_node_is_free_in_the_cluster_that_is_ready_first():
    snap = snapshot(
        node(cluster=0, free=0), node(cluster=0), node(cluster=1, free=0), node(cluster=1, free=0)
    )
    ends = [(NOW + 500, ((0, 8),)), (NOW + 100, ((2, 8),)), (NOW + 200, ((3, 8),))]
    timeline = Timeline(snap, ends, NOW)
    assert timeline.earliest(view(1, 8, nodes=2), everywhere(snap)) == Slot(NOW + 200, 1, (2, 3))
    assert timeline.earliest(view(1, 8, nodes=3), everywhere(snap)) is None, "no cluster has 3 nodes"
    only_cluster_0 = np.array([True, True, False, False])
    assert timeline.earliest(view(1, 8, nodes=2), only_cluster_0) == Slot(NOW + 500, 0, (1, 0))


def test_a_claimed_start_holds_its_gpus_until_its_end(busy):
    snap, timeline = busy
    first = timeline.earliest(view(1, 8), everywhere(snap))
    assert first == Slot(NOW + 200, 0, (1,))
    timeline.claim(first, 8, NOW + 900)
    assert timeline.earliest(view(2, 8), everywhere(snap)) == Slot(NOW + 300, 0, (0,))
    timeline.claim(Slot(NOW + 300, 0, (0,)), 8, NEVER)
    assert timeline.earliest(view(3, 8), np.array([True, True, False])) == Slot(NOW + 900, 0, (1,))
    assert timeline.released_by(1, NOW + 900) == 16, "the running job's 8, then the claimed job's 8"
    fresh = timeline.fresh(NOW)
    assert fresh.earliest(view(4, 8), everywhere(snap)) == Slot(NOW + 200, 0, (1,)), "a new cycle: no claims"
