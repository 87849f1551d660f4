"""Node lifecycle on a controllable clock: grace, failover, recovery, rate limits, pauses."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from clusters.choices import ClusterState, NodeState
from clusters.models import Cluster, Node, NodeEvent, NodeLastSeen
from clusters.ports import ports_replaced
from clusters.services.lifecycle import run_node_lifecycle
from tests.factories import make_cluster, make_node

pytestmark = pytest.mark.django_db
T0 = timezone.now()


def seen(node: Node, at, good_since=None) -> None:
    NodeLastSeen.objects.update_or_create(node=node, defaults={"seen_at": at, "good_since": good_since or at})


def state(node: Node) -> str:
    return Node.objects.get(pk=node.pk).state


@pytest.fixture
def cluster():
    return make_cluster("sim-a")


@pytest.fixture
def nodes(cluster):
    nodes = [make_node(cluster, gpus=1, name=f"n{i}") for i in range(10)]
    for n in nodes:
        seen(n, T0, T0 - timedelta(hours=1))
    return nodes


def test_silence_past_grace_makes_a_node_not_ready(nodes, settings):
    settings.NODE_GRACE = 40
    assert run_node_lifecycle(T0 + timedelta(seconds=39)).not_ready == []
    seen(nodes[0], T0 - timedelta(seconds=5))
    result = run_node_lifecycle(T0 + timedelta(seconds=39))
    assert result.not_ready == [nodes[0].pk] and state(nodes[0]) == NodeState.NOT_READY
    event = NodeEvent.objects.get(node=nodes[0])
    assert (event.from_state, event.to_state, event.reason) == ("ready", "not_ready", "no heartbeat for 40s")


def test_longer_silence_makes_it_down_and_calls_the_failover_handler(
    nodes, settings, django_capture_on_commit_callbacks
):
    lost = []
    record_lost.calls = lost
    seen(nodes[0], T0 - timedelta(minutes=10))
    run_node_lifecycle(T0)  # → not_ready
    with ports_replaced(node_lost=record_lost), django_capture_on_commit_callbacks(execute=True):
        result = run_node_lifecycle(T0)
    assert result.down == [nodes[0].pk] and state(nodes[0]) == NodeState.DOWN
    assert lost == [[nodes[0].pk]]


def record_lost(node_ids):
    record_lost.calls.append(node_ids)


def test_recovery_needs_a_run_of_on_time_heartbeats(nodes, settings):
    settings.NODE_RECOVERY = 30
    node = nodes[0]
    Node.objects.filter(pk=node.pk).update(state=NodeState.DOWN)
    seen(node, T0, good_since=T0 - timedelta(seconds=10))  # back, but only for 10 s
    assert run_node_lifecycle(T0).ready == []
    seen(node, T0, good_since=T0 - timedelta(seconds=31))
    assert run_node_lifecycle(T0).ready == [node.pk] and state(node) == NodeState.READY


def test_operator_states_are_left_alone(nodes):
    Node.objects.filter(pk=nodes[0].pk).update(state=NodeState.CORDONED)
    seen(nodes[0], T0 - timedelta(hours=1))
    run_node_lifecycle(T0)
    run_node_lifecycle(T0)
    assert state(nodes[0]) == NodeState.CORDONED


def test_failover_is_rate_limited_per_cluster(cluster, settings):
    settings.ORRERY_FAILOVER_PER_MINUTE = 2
    silent = [make_node(cluster, gpus=1, name=f"s{i}") for i in range(4)]
    alive = [make_node(cluster, gpus=1, name=f"a{i}") for i in range(6)]
    for i, n in enumerate(silent):
        seen(n, T0 - timedelta(minutes=10, seconds=i))
        Node.objects.filter(pk=n.pk).update(state=NodeState.NOT_READY)
    for n in alive:
        seen(n, T0)
    first = run_node_lifecycle(T0)
    assert len(first.down) == 2 and first.deferred == 2
    assert set(first.down) == {silent[3].pk, silent[2].pk}  # the longest silent first
    assert run_node_lifecycle(T0 + timedelta(seconds=5)).down == []  # budget spent this minute
    later = timezone.now() + timedelta(seconds=61)  # past the minute of the first downs
    for n in alive:
        seen(n, later)
    assert len(run_node_lifecycle(later).down) == 2


def test_failover_pauses_when_most_of_a_cluster_goes_silent(nodes, cluster, caplog):
    for n in nodes[:6]:
        seen(n, T0 - timedelta(minutes=10))
    run_node_lifecycle(T0)  # all six → not_ready
    result = run_node_lifecycle(T0)
    assert result.down == [] and result.paused == ["sim-a"]
    assert "failover PAUSED" in caplog.text
    assert Cluster.objects.get(pk=cluster.pk).state == ClusterState.UNREACHABLE


def test_cluster_state_follows_its_nodes(nodes, cluster):
    run_node_lifecycle(T0)
    assert Cluster.objects.get(pk=cluster.pk).state == ClusterState.READY
    seen(nodes[0], T0 - timedelta(minutes=2))
    run_node_lifecycle(T0)
    refreshed = Cluster.objects.get(pk=cluster.pk)
    assert (refreshed.state, refreshed.state_reason) == (ClusterState.DEGRADED, "1/10 nodes not ready")


def test_a_node_that_never_reported_goes_not_ready_after_grace(cluster, settings):
    node = make_node(cluster, gpus=1, name="quiet")
    Node.objects.filter(pk=node.pk).update(state_changed_at=T0 - timedelta(seconds=settings.NODE_GRACE + 1))
    assert run_node_lifecycle(T0).not_ready == [node.pk]


def test_node_events_are_in_the_api(nodes, client, alice):
    from rest_framework.test import APIClient

    seen(nodes[0], T0 - timedelta(minutes=2))
    run_node_lifecycle(T0)
    api = APIClient()
    api.force_authenticate(alice)
    body = api.get(f"/api/v1/nodes/{nodes[0].pk}/events").json()
    assert [(e["fromState"], e["toState"]) for e in body["results"]] == [("ready", "not_ready")]
    assert api.get("/api/v1/nodes/999999/events").status_code == 404
