"""The port a gang agrees on (scheduling/dispatch/ports.py), chosen when its start is dispatched:
the drain and a native agent's desired list agree on it, a delivery made again keeps it, and two
gangs headed on one node never share one."""

from __future__ import annotations

import pytest
from django.core.cache import cache

from clusters.choices import ClusterKind
from scheduling.dispatch.agent import desired_for_node
from scheduling.dispatch.outbox import drain_outbox
from scheduling.dispatch.ports import assign_master_ports
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import run_cycle
from scheduling.models import DispatchOutbox, Job, JobAttempt
from scheduling.services.jobs import cancel_job
from tests.factories import make_cluster, make_job, make_node

pytestmark = pytest.mark.django_db


def port_of(job: Job) -> int | None:
    return JobAttempt.objects.get(job=job, active=True).master_port


@pytest.fixture
def lab():
    """A native cluster of two 8-GPU nodes: every gang of two is headed on n0 (the lowest id)."""
    cache.clear()  # desired lists are cached per node id, and ids are reused between tests
    cluster = make_cluster("lab", kind=ClusterKind.NATIVE)
    return [make_node(cluster, gpus=8, name=f"n{i}") for i in range(2)]


def test_gangs_headed_on_one_node_get_their_own_ports_and_a_freed_port_is_reused(alice, queue, lab, settings):
    settings.ORRERY_MASTER_PORT_BASE = 29500
    first, second = (make_job(alice, queue, gpus=1, nodes=2) for _ in range(2))
    assert run_cycle(SchedulerCache()).placed == 2
    assert drain_outbox() == 2
    assert sorted([port_of(first), port_of(second)]) == [29500, 29501]

    # A delivery made again (a drain that died before recording) keeps the ports.
    before = {port_of(first), port_of(second)}
    DispatchOutbox.objects.update(state=DispatchOutbox.State.PENDING)
    assert drain_outbox() == 2
    assert {port_of(first), port_of(second)} == before

    # The port of an attempt that ended is free again: the lowest free one is taken.
    freed = first if port_of(first) == 29500 else second
    cancel_job(Job.objects.get(pk=freed.pk), actor=None)
    third = make_job(alice, queue, gpus=1, nodes=2)
    assert run_cycle(SchedulerCache()).placed == 1
    drain_outbox()
    assert port_of(third) == 29500


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (ClusterKind.NATIVE, [29600, 29601, 29602]),  # one node's network: a port each
        (ClusterKind.KUBERNETES, [29600, 29600, 29600]),  # a pod each, its own network
        (ClusterKind.SIMULATED, [None, None, None]),  # nothing runs, nothing listens
    ],
    ids=["native", "kubernetes", "simulated"],
)
def test_the_port_rule_of_each_kind(alice, queue, settings, kind, expected):
    settings.ORRERY_MASTER_PORT_BASE, settings.ORRERY_MASTER_PORTS = 29600, 10
    make_node(make_cluster("one", kind=kind), gpus=8, name="solo")
    jobs = [make_job(alice, queue, gpus=1, spec={"image": "busybox"}) for _ in range(3)]
    assert run_cycle(SchedulerCache()).placed == 3
    attempts = [str(JobAttempt.objects.get(job=j).pk) for j in jobs]
    assert assign_master_ports(attempts[:1]) == ({attempts[0]: 29600} if expected[0] else {})
    ports = assign_master_ports(attempts)
    assert sorted(ports.get(a) or 0 for a in attempts) == sorted(p or 0 for p in expected)
    assert assign_master_ports(attempts) == ports  # idempotent


def test_a_full_range_is_shared_rather_than_refused(alice, queue, settings):
    settings.ORRERY_MASTER_PORT_BASE, settings.ORRERY_MASTER_PORTS = 29700, 2
    make_node(make_cluster("small", kind=ClusterKind.NATIVE), gpus=8, name="solo")
    jobs = [make_job(alice, queue, gpus=1) for _ in range(3)]
    run_cycle(SchedulerCache())
    ports = assign_master_ports(str(JobAttempt.objects.get(job=j).pk) for j in jobs)
    assert sorted(ports.values()) == [29700, 29700, 29701]


def test_an_agent_reading_before_the_drain_gets_the_port_the_drain_keeps(alice, queue, lab):
    gang = make_job(alice, queue, gpus=2, nodes=2)
    assert run_cycle(SchedulerCache()).placed == 1
    head, other = lab
    (entry,) = desired_for_node(other.pk)  # before the drain: the agent's read dispatches it
    port = port_of(gang)
    assert port is not None and entry["launch"]["MASTER_PORT"] == str(port)
    assert entry["launch"] | {"MASTER_ADDR": "n0"} == {
        "NNODES": "2",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_PORT": str(port),
        "NODE_RANK": "1",
        "RANK": "2",
        "MASTER_ADDR": "n0",
        "ORRERY_NNODES": "2",
        "ORRERY_WORLD_SIZE": "4",
        "ORRERY_LOCAL_WORLD_SIZE": "2",
        "ORRERY_MASTER_PORT": str(port),
        "ORRERY_NODE_RANK": "1",
        "ORRERY_HEAD_ADDR": "n0",
    }
    assert entry["launch"]["MASTER_ADDR"] == entry["head_addr"] == "n0"
    assert drain_outbox() == 1 and port_of(gang) == port
    (first,) = desired_for_node(head.pk)
    assert (first["launch"]["NODE_RANK"], first["launch"]["RANK"], first["launch"]["MASTER_PORT"]) == (
        "0",
        "0",
        str(port),
    )
