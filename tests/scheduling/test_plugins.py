"""Each plugin, table-driven, on tiny snapshots: columns in, a mask or a vector out."""

from __future__ import annotations

import numpy as np
import pytest

from scheduling.choices import PendingReason
from scheduling.engine.framework import Placement
from scheduling.engine.plugins.binpack import Binpack
from scheduling.engine.plugins.cluster_affinity import ClusterAffinity
from scheduling.engine.plugins.fair_share import FairShare
from scheduling.engine.plugins.gang import Gang
from scheduling.engine.plugins.gpu_model_match import GpuModelMatch
from scheduling.engine.plugins.node_ready import NodeReady
from scheduling.engine.plugins.node_selector import NodeSelector
from scheduling.engine.plugins.priority import Priority
from scheduling.engine.plugins.quota import Quota
from scheduling.engine.plugins.resources_fit import ResourcesFit
from scheduling.engine.plugins.spread import Spread
from tests.scheduling.snapshots import job, node, snapshot, state

SNAP = snapshot(
    node(free=8),  # 0: empty h100 node
    node(free=2),  # 1: nearly full
    node(free=8, ready=False),  # 2: not ready
    node(model=1, free=8, cluster=1),  # 3: a100, other cluster
    node(gpus=0, free=0, cpu=128_000),  # 4: CPU only
    node(free=8, cpu=1_000, labels={"rack": "r1"}),  # 5: little cpu, labelled
)
ROWS = SNAP.all_rows


def mask(plugin, j) -> list[bool]:
    return plugin.filter(state(), SNAP, j, ROWS).tolist()


@pytest.mark.parametrize(
    "plugin, j, expected",
    [
        (NodeReady(), job(gpus=1), [True, True, False, True, False, True]),
        (NodeReady(), job(gpus=0), [True, True, False, True, True, True]),
        (GpuModelMatch(), job(gpus=1, model=0), [True, True, True, False, False, True]),
        (GpuModelMatch(), job(gpus=1, model=1), [False, False, False, True, False, False]),
        (GpuModelMatch(), job(gpus=0), [True] * 6),
        (ResourcesFit(), job(gpus=4), [True, False, True, True, False, True]),
        (ResourcesFit(), job(gpus=2, cpu=2_000), [True, True, True, True, False, False]),
        (ResourcesFit(), job(gpus=0, cpu=100_000), [False, False, False, False, True, False]),
        (NodeSelector(), job(selector=(("rack", "r1"),)), [False, False, False, False, False, True]),
        (NodeSelector(), job(selector=(("rack", "r1"), ("zone", "a"))), [False] * 6),
        (NodeSelector(), job(), [True] * 6),
        (ClusterAffinity(), job(clusters=(1,)), [False, False, False, True, False, False]),
        (ClusterAffinity(), job(clusters=()), [True] * 6),
        (ClusterAffinity(), job(clusters=(-1,)), [False] * 6),
    ],
    ids=[
        "state-gpu",
        "state-cpu",
        "model-h100",
        "model-a100",
        "model-cpu-job",
        "fit-4",
        "fit-cpu",
        "fit-cpu-only",
        "selector",
        "selector-two",
        "selector-none",
        "affinity",
        "affinity-any",
        "affinity-unknown",
    ],
)
def test_filters(plugin, j, expected):
    assert mask(plugin, j) == expected


def test_filters_answer_for_the_rows_asked():
    rows = np.array([5, 0])
    assert ResourcesFit().filter(state(), SNAP, job(gpus=4), rows).tolist() == [True, True]
    assert NodeReady().filter(state(), SNAP, job(gpus=1), np.array([2])).tolist() == [False]


@pytest.mark.parametrize(
    "plugin, words",
    [
        (NodeReady(), "3 not ready"),
        (GpuModelMatch(), "3 have no h100-80g"),
        (ResourcesFit(), "3 lack 4 free h100-80g"),
        (NodeSelector(), "3 do not match rack=r1"),
        (ClusterAffinity(), "3 are in other clusters"),
    ],
)
def test_explanations(plugin, words):
    assert plugin.explain(job(gpus=4, selector=(("rack", "r1"),)), SNAP, 3) == words


def test_binpack_prefers_the_fullest_node_and_spread_the_emptiest():
    rows = np.array([0, 1])
    packed = Binpack().score(state(), SNAP, job(gpus=2), rows)
    spread = Spread().score(state(), SNAP, job(gpus=2), rows)
    assert packed.argmax() == 1 and spread.argmax() == 0
    assert ((packed >= 0) & (packed <= 1)).all() and ((spread >= 0) & (spread <= 1)).all()


QUOTA_CASES = [
    # queue 1: nominal, used; queue 2 (same cohort): nominal, used; borrowing limit; job GPUs; fits?
    (8, 0, 0, 0, None, 8, True),
    (8, 4, 0, 0, None, 8, False),  # no cohort member lends anything
    (8, 4, 8, 0, None, 8, True),  # borrows 4 of queue 2's idle 8
    (8, 4, 8, 0, 2, 8, False),  # but may borrow 2 at most
    (8, 4, 8, 6, None, 8, False),  # queue 2 uses 6 of its 8: only 2 to lend
    (0, 0, 16, 0, None, 16, True),  # no nominal quota of its own: all borrowed
]


@pytest.mark.parametrize("nominal, used, other, other_used, limit, gpus, fits", QUOTA_CASES)
def test_quota_and_borrowing_in_a_cohort(nominal, used, other, other_used, limit, gpus, fits):
    snap = snapshot(node())
    book = snap.quota
    book.limited.update({1, 2})
    book.nominal.update({(1, 0): nominal, (2, 0): other})
    book.borrowing_limit.update({(1, 0): limit, (2, 0): None})
    book.used.update({(1, 0): used, (2, 0): other_used})
    book.cohort_of.update({1: "research", 2: "research"})
    book.members["research"] = [1, 2]
    snap.queue_names = {1: "vision/default"}
    status = Quota().pre_filter(state(), snap, job(gpus=gpus, queue=1))
    assert status.ok is fits
    if not fits:
        assert status.reason == PendingReason.QUOTA_EXCEEDED
        assert f"queue vision/default at {used}/{nominal} h100-80g; this job needs {gpus}" == status.message


def test_queues_without_quota_are_not_limited():
    assert Quota().pre_filter(state(), snapshot(node()), job(gpus=64, queue=9)).ok


def test_gang_needs_enough_nodes_in_one_cluster():
    snap = snapshot(node(cluster=0), node(cluster=0), node(cluster=1), node(cluster=1, ready=False))
    assert Gang().pre_filter(state(), snap, job(gpus=8, nodes=2)).ok
    refused = Gang().pre_filter(state(), snap, job(gpus=8, nodes=3))
    assert not refused.ok and "largest has 2 ready" in refused.message


def test_priority_orders_by_queue_then_job():
    s = state(queue_priority={1: 10, 2: 50})
    keys = [Priority().sort_key(s, SNAP, job(queue=q, priority=p)) for q, p in ((1, 0), (1, 100), (2, 0))]
    assert sorted(range(3), key=lambda i: keys[i]) == [2, 1, 0]


def test_fair_share_puts_the_project_with_less_first_and_learns_from_placements():
    snap = snapshot(node(), node())  # 16 h100 in all
    snap.quota.used.update({(1, 0): 8})  # queue 1 (project 1) holds half the fleet
    s = state(queue_project={1: 1, 2: 2}, project_weight={1: 1.0, 2: 1.0})
    plugin = FairShare()
    assert plugin.sort_key(s, snap, job(project=2)) < plugin.sort_key(s, snap, job(project=1))
    placement = Placement(job(gpus=8, project=2, queue=2), 0, ())
    plugin.reserve(s, snap, placement)
    plugin.reserve(s, snap, placement)  # project 2 now holds all 16
    assert plugin.sort_key(s, snap, job(project=1)) < plugin.sort_key(s, snap, job(project=2))


def test_fair_share_divides_by_weight():
    snap = snapshot(node(), node())
    snap.quota.used.update({(1, 0): 8, (2, 0): 8})
    s = state(queue_project={1: 1, 2: 2}, project_weight={1: 1.0, 2: 4.0})
    plugin = FairShare()
    assert plugin.sort_key(s, snap, job(project=2)) < plugin.sort_key(s, snap, job(project=1))


def test_gpu_indices_come_from_one_topology_group_when_they_can():
    snap = snapshot(node(gpus=8, free=8, groups={i: f"g{i // 4}" for i in range(8)}))
    snap.take(0, (0, 1, 4), 0, 0)  # g0 has 2 free (2, 3), g1 has 3 free (5, 6, 7)
    assert snap.choose_gpus(0, 2) == (2, 3)  # the fullest group that fits
    assert snap.choose_gpus(0, 3) == (5, 6, 7)
    assert snap.choose_gpus(0, 4) == (2, 3, 5, 6)  # no group fits: lowest indices
