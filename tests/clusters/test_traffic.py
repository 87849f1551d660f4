"""Heartbeat traffic drives the real agent API of a live server over HTTP."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from clusters.choices import NodeState
from clusters.models import Node, NodeLastSeen
from clusters.services.aggregation import flush_heartbeats
from clusters.services.lifecycle import run_node_lifecycle
from clusters.traffic import HeartbeatTraffic
from tests.factories import ensure_catalog

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("mode", ["batched", "per-node"])
def test_nodes_register_report_and_die(live_server, mode, settings):
    ensure_catalog()  # a transactional test before this one flushed the seeded catalog
    settings.NODE_RECOVERY = 0
    traffic = HeartbeatTraffic(
        live_server.url, clusters=2, nodes=10, mode=mode, interval=0.1, gpus_per_node=2, prefix=f"t{mode[0]}"
    )
    traffic.setup()
    assert Node.objects.filter(cluster__name__in=traffic.clusters).count() == 10
    for _ in range(3):
        assert traffic.tick() == 10
    flush_heartbeats()
    assert set(
        NodeLastSeen.objects.filter(node__cluster__name__in=traffic.clusters).values_list("seq", flat=True)
    ) == {3}

    run_node_lifecycle()  # on-time heartbeats (NODE_RECOVERY 0): all ready
    assert set(Node.objects.values_list("state", flat=True)) == {NodeState.READY}

    victim = traffic.nodes[0].name
    traffic.kill(victim, seconds=3600)
    assert traffic.tick() == 9
    flush_heartbeats()
    later = timezone.now() + timedelta(seconds=settings.NODE_GRACE + 1)
    for node in traffic.nodes[1:]:  # the others keep reporting
        NodeLastSeen.objects.filter(node__name=node.name).update(seen_at=later)
    result = run_node_lifecycle(later)
    assert [Node.objects.get(pk=pk).name for pk in result.not_ready] == [victim]
