"""Reads of the scheduling app that the portal renders: placement and the heatmap's columns."""

from __future__ import annotations

import pytest

from clusters.models import GpuDevice
from scheduling.models import Job
from scheduling.selectors import job_placement, jobs_with_placement, node_heatmap
from scheduling.services.allocations import NodePlacement, bind_job
from tests.factories import make_cluster, make_job, make_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def placed(alice, queue):
    cluster = make_cluster("sim-a")
    nodes = [make_node(cluster, gpus=8, name=name) for name in ("a-2", "a-1")]
    job = make_job(alice, queue, gpus=2, nodes=2)
    bind_job(job, [NodePlacement(nodes[0], [5, 1]), NodePlacement(nodes[1], [0, 7])])
    return job


def test_placement_groups_gpu_indices_per_node_by_name(placed):
    placement = job_placement(Job.objects.get(pk=placed.pk))
    assert placement is not None and placement.attempt.number == 1
    assert placement.nodes == {"a-1": [0, 7], "a-2": [1, 5]}
    assert sorted(GpuDevice.objects.filter(pk__in=placement.gpu_ids).values_list("index", flat=True)) == [
        0,
        1,
        5,
        7,
    ]


def test_a_job_never_placed_has_no_placement(alice, queue):
    assert job_placement(make_job(alice, queue)) is None


def test_placement_reads_what_was_prefetched(placed, django_assert_num_queries):
    [job] = jobs_with_placement(Job.objects.filter(pk=placed.pk))
    with django_assert_num_queries(0):
        assert job_placement(job) is not None
    bare = Job.objects.get(pk=placed.pk)
    with django_assert_num_queries(2):  # attempts, then their allocations
        assert job_placement(bare) == job_placement(job)


def test_heatmap_columns_line_up_per_node(placed):
    GpuDevice.objects.filter(node__name="a-1", index__in=[0, 1]).update(utilization=30)
    GpuDevice.objects.filter(node__name="a-1", index=2).update(utilization=60)
    heatmap = node_heatmap()
    assert heatmap.names == ["a-1", "a-2"] and heatmap.clusters == ["sim-a", "sim-a"]
    assert heatmap.held == [2, 2] and heatmap.gpus == [8, 8] and heatmap.util == [40.0, None]
    assert node_heatmap("elsewhere").ids == []


def test_held_gpu_indices_per_node(placed):
    from clusters.ports import held_gpus

    nodes = dict(placed.allocations.values_list("node__name", "node_id").distinct())
    assert held_gpus()([*nodes.values(), 0]) == {nodes["a-2"]: {1, 5}, nodes["a-1"]: {0, 7}}
