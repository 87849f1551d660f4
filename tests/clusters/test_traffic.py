"""Heartbeat traffic drives the real agent API of a live server over HTTP."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from clusters.choices import NodeState
from clusters.models import Node, NodeLastSeen
from clusters.services.aggregation import flush_heartbeats, sync_telemetry
from clusters.services.lifecycle import run_node_lifecycle
from clusters.traffic import HeartbeatTraffic, TrafficNode
from scheduling.models import JobAttempt
from scheduling.services.allocations import NodePlacement, bind_job
from scheduling.services.energy import meter_energy
from tests.factories import ensure_catalog, make_job, make_project, make_queue, make_user

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


@pytest.mark.parametrize(
    ("held", "busy"),
    [(set(), []), ({1}, [1]), ({0, 1, 2, 3}, [0, 1, 2, 3])],
    ids=["idle", "one-held", "all-held"],
)
def test_held_gpus_run_near_their_tdp_and_the_others_idle(held, busy):
    node = TrafficNode("n1", "c1", "a100-80g", 4, tdp_w=400.0)
    gpus = node.report(0.0, held)["gpus"]
    assert [g["index"] for g in gpus if g["util"] >= 88] == busy
    for g in gpus:
        low, high = (0.89 * 400, 400) if g["index"] in held else (0.12 * 400, 0.14 * 400)
        assert low <= g["power_w"] <= high, g


def test_a_job_on_a_simulated_node_draws_power_the_meter_reads(live_server):
    ensure_catalog()
    traffic = HeartbeatTraffic(live_server.url, clusters=1, nodes=2, gpus_per_node=2, prefix="tp")
    traffic.setup()
    node = Node.objects.get(name=traffic.nodes[0].name)
    owner, model = make_user(), node.gpus.first().model
    job = make_job(owner, make_queue(make_project(members=(owner,))), gpus=1, model=model.slug)
    attempt = bind_job(job, [NodePlacement(node, [1])])
    assert traffic.tick() == 2
    sync_telemetry()
    tdp = model.tdp_watts
    power = dict(node.gpus.values_list("index", "power_w"))
    assert power[1] >= 0.89 * tdp and power[0] <= 0.14 * tdp
    JobAttempt.objects.filter(pk=attempt.pk).update(energy_at=timezone.now() - timedelta(seconds=60))
    meter_energy()
    attempt.refresh_from_db()
    assert attempt.energy_wh == pytest.approx(power[1] * 60 / 3600, rel=1e-2)
