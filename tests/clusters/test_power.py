"""Power saving: the recommendation rules (idle bound, keep-idle floor, measured and estimated
watts), the actions and their switch, the periodic pass, and the console's power page."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from clusters.choices import ClusterKind, ClusterState, NodeState, PowerState
from clusters.models import Cluster, Node, NodeEvent
from clusters.services.power import (
    GPU_IDLE_SHARE,
    IdleNode,
    PowerActionRefused,
    apply_power_saving,
    idle_nodes,
    node_watts,
    power_down_nodes,
    power_plan,
    power_up_nodes,
    recommend,
)
from foundation.models import AuditEntry
from scheduling.models import Allocation
from scheduling.services.allocations import NodePlacement, bind_job
from tests.factories import make_cluster, make_job, make_node, make_user

HOUR = 3600
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def idle(node_id: int, idle_h: float, *, cluster: int = 1, model: str = "h100-80g") -> IdleNode:
    return IdleNode(node_id, f"n{node_id}", cluster, model, 8, T0 - timedelta(hours=idle_h), 500.0, True)


# --- the rule, pure ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nodes, idle_s, keep, expected",
    [
        pytest.param([idle(1, 2), idle(2, 3), idle(3, 4)], HOUR, 0, [3, 2, 1], id="all-past-the-bound"),
        pytest.param([idle(1, 0.2), idle(2, 3)], HOUR, 0, [2], id="one-not-idle-long-enough"),
        pytest.param([idle(1, 1)], HOUR, 0, [1], id="exactly-at-the-bound"),
        pytest.param([idle(1, 2), idle(2, 3), idle(3, 4)], HOUR, 2, [3], id="floor-keeps-two"),
        pytest.param([idle(1, 2), idle(2, 3)], HOUR, 2, [], id="floor-keeps-all"),
        pytest.param([idle(1, 2), idle(2, 3)], HOUR, 5, [], id="floor-above-the-idle-count"),
        # the young idle node counts toward the floor: one of the two old ones may go
        pytest.param([idle(1, 0.1), idle(2, 2), idle(3, 3)], HOUR, 2, [3], id="young-idle-counts-in-floor"),
        pytest.param(
            [idle(1, 2, model="h100-80g"), idle(2, 2, model="a100-80g")], HOUR, 1, [], id="floor-per-model"
        ),
        pytest.param(
            [idle(1, 2, cluster=1), idle(2, 2, cluster=2), idle(3, 3, cluster=2)],
            HOUR,
            1,
            [3],
            id="floor-per-cluster",
        ),
        pytest.param([idle(1, 2), idle(2, 3)], HOUR, -4, [2, 1], id="negative-floor-is-none"),
        pytest.param([], HOUR, 0, [], id="nothing-idle"),
    ],
)
def test_recommendation_rules(nodes, idle_s, keep, expected):
    chosen = recommend(nodes, T0, idle_s=idle_s, keep_idle=keep)
    assert [r.node.node_id for r in chosen] == expected  # per cluster and model, longest idle first
    for r in chosen:
        assert r.idle_s == (T0 - r.node.idle_since).total_seconds()


def test_no_node_of_a_model_jobs_wait_for_is_recommended():
    nodes = [idle(1, 2, model="h100-80g"), idle(2, 2, model="a100-80g"), idle(3, 5, model="")]
    chosen = recommend(nodes, T0, idle_s=HOUR, keep_idle=0, wanted=frozenset({"h100-80g"}))
    assert [r.node.node_id for r in chosen] == [3, 2]


@pytest.mark.parametrize(
    "power_w, reported_s_ago, tdps, expected",
    [
        pytest.param(640.0, 30, [700] * 8, (640.0, True), id="fresh-reading"),
        pytest.param(640.0, 500, [700] * 8, (250 + GPU_IDLE_SHARE * 5600, False), id="stale-reading"),
        pytest.param(None, 30, [700] * 8, (250 + GPU_IDLE_SHARE * 5600, False), id="no-reading"),
        pytest.param(640.0, None, [400] * 4, (250 + GPU_IDLE_SHARE * 1600, False), id="never-reported"),
        pytest.param(None, None, [], (250.0, False), id="cpu-only-node"),
    ],
)
def test_watts_saved_measured_when_fresh_else_estimated(power_w, reported_s_ago, tdps, expected):
    reported = None if reported_s_ago is None else T0 - timedelta(seconds=reported_s_ago)
    assert node_watts(power_w, reported, tdps, T0, fresh_s=120, base_w=250) == pytest.approx(expected)


# --- from the database ------------------------------------------------------------------------


@pytest.fixture
def fleet(db, settings):
    """Four idle ready H100 nodes of a simulated cluster, ready since 3 h ago."""
    settings.ORRERY_POWER_IDLE_S = HOUR
    settings.ORRERY_POWER_KEEP_IDLE = 1
    cluster = make_cluster("sim-p", kind=ClusterKind.SIMULATED, power_saving=True)
    nodes = [make_node(cluster, gpus=8, model="h100", name=f"p{i}") for i in range(4)]
    Node.objects.filter(cluster=cluster).update(state_changed_at=timezone.now() - timedelta(hours=3))
    return cluster, nodes


def _ran(node: Node, user, queue, released_ago: timedelta | None) -> None:
    """A job held GPU 0 of the node; released ``released_ago`` ago (None: still holds it)."""
    job = make_job(user, queue, gpus=1)
    attempt = bind_job(job, [NodePlacement(node, [0])])
    if released_ago is not None:
        Allocation.objects.filter(attempt=attempt).update(
            active=False, released_at=timezone.now() - released_ago
        )


def test_idle_since_the_last_release_or_since_ready(fleet, alice, queue):
    cluster, (_, p1, p2, p3) = fleet
    _ran(p1, alice, queue, timedelta(minutes=10))  # idle for 10 min only
    _ran(p2, alice, queue, None)  # busy
    _ran(p3, alice, queue, timedelta(days=2))  # released before it became ready: ready time counts
    now = timezone.now()
    found = {n.name: (now - n.idle_since).total_seconds() for n in idle_nodes(now, [cluster.pk])}
    assert set(found) == {"p0", "p1", "p3"}
    assert found["p1"] == pytest.approx(600, abs=5)
    assert found["p0"] == pytest.approx(3 * HOUR, abs=5)
    assert found["p3"] == pytest.approx(3 * HOUR, abs=5)
    chosen = {p.node.name for p in power_plan(now)[0].recommendations}
    # p1 is not idle long enough but counts toward the floor of one: p0 and p3 may both go
    assert chosen == {"p0", "p3"}


@pytest.mark.parametrize(
    "change, expected",
    [
        pytest.param({"state": NodeState.CORDONED}, {"p1", "p2"}, id="cordoned-not-counted"),
        pytest.param({"power_state": PowerState.SUSPENDED}, {"p1", "p2"}, id="already-powered-down"),
    ],
)
def test_only_ready_powered_nodes_are_candidates(fleet, change, expected):
    _, nodes = fleet
    Node.objects.filter(pk=nodes[0].pk).update(**change)
    assert {r.node.name for r in power_plan()[0].recommendations} == expected


@pytest.mark.parametrize("state", [ClusterState.DRAINING, ClusterState.DISABLED, ClusterState.UNREACHABLE])
def test_clusters_that_take_no_work_get_no_recommendations(fleet, operator, state):
    cluster, nodes = fleet
    power_down_nodes(cluster, [nodes[0].pk], actor=operator)
    cluster.state = state
    cluster.save(update_fields=["state"])
    (plan,) = power_plan()  # still listed: its powered-down node may be powered up
    assert plan.recommendations == () and [n.name for n in plan.powered_down] == ["p0"]
    assert apply_power_saving() == 0


def test_fresh_node_reading_is_believed_and_stale_one_estimated(fleet):
    cluster, nodes = fleet
    now = timezone.now()
    Node.objects.filter(pk=nodes[0].pk).update(power_w=812.5, last_heartbeat_at=now - timedelta(seconds=20))
    Node.objects.filter(pk=nodes[1].pk).update(power_w=812.5, last_heartbeat_at=now - timedelta(hours=1))
    found = {n.name: (n.watts, n.measured) for n in idle_nodes(now, [cluster.pk])}
    estimate = 250 + GPU_IDLE_SHARE * 8 * nodes[0].gpus.first().model.tdp_watts
    assert found["p0"] == (812.5, True)
    assert found["p1"] == (pytest.approx(estimate), False)


# --- actions and the switch -------------------------------------------------------------------


def test_power_down_drains_suspends_records_and_audits(fleet, operator):
    cluster, nodes = fleet
    result = power_down_nodes(cluster, [nodes[0].pk], actor=operator)
    assert (result.done, result.refused) == (["p0"], [])
    node = Node.objects.get(pk=nodes[0].pk)
    assert (node.state, node.power_state) == (NodeState.DRAINED, PowerState.SUSPENDED)
    assert node.state_reason.startswith("power saving: powered down after 180 min idle")
    event = NodeEvent.objects.get(node=node)
    assert (event.from_state, event.to_state, event.actor_id) == (
        NodeState.READY,
        NodeState.DRAINED,
        operator.pk,
    )
    entry = AuditEntry.objects.get(target="node:sim-p/p0")
    assert (entry.action, entry.actor_id, entry.details["power"]) == ("node.drain", operator.pk, "down")


def test_power_down_refuses_nodes_not_recommended(fleet, operator, alice, queue):
    cluster, nodes = fleet
    _ran(nodes[1], alice, queue, None)  # busy
    result = power_down_nodes(cluster, [nodes[1].pk, 10**12], actor=operator)
    assert result.done == []
    assert [why.split(":")[0] for why in result.refused] == ["p1", "node 1000000000000"]
    assert Node.objects.get(pk=nodes[1].pk).state == NodeState.READY


def test_the_floor_holds_across_actions(fleet, operator):
    cluster, nodes = fleet
    first = power_down_nodes(cluster, [n.pk for n in nodes], actor=operator)
    assert len(first.done) == 3 and len(first.refused) == 1  # one idle node stays ready
    again = power_down_nodes(cluster, [n.pk for n in nodes], actor=operator)
    assert again.done == []
    assert Node.objects.filter(cluster=cluster, state=NodeState.READY).count() == 1


def test_switch_off_refuses_actions_and_the_task_does_nothing(fleet, operator):
    cluster, nodes = fleet
    cluster.power_saving = False
    cluster.save(update_fields=["power_saving"])
    with pytest.raises(PowerActionRefused, match="switched off"):
        power_down_nodes(cluster, [nodes[0].pk], actor=operator)
    assert apply_power_saving() == 0
    assert not Node.objects.filter(cluster=cluster).exclude(state=NodeState.READY).exists()
    assert not Node.objects.filter(power_state=PowerState.SUSPENDED).exists()
    assert not NodeEvent.objects.exists() and not AuditEntry.objects.exists()
    assert len(power_plan()[0].recommendations) == 3  # still recommended


def test_switch_on_the_task_acts_on_every_recommendation(fleet):
    cluster, _ = fleet
    assert apply_power_saving() == 3
    assert Node.objects.filter(cluster=cluster, power_state=PowerState.SUSPENDED).count() == 3
    assert set(AuditEntry.objects.values_list("actor_id", flat=True)) == {None}
    assert apply_power_saving() == 0  # the floor: one idle node stays ready


def test_kinds_that_cannot_power_nodes_are_refused(db, settings, operator):
    cluster = make_cluster("nat", kind=ClusterKind.NATIVE, power_saving=True)
    node = make_node(cluster, name="x1")
    with pytest.raises(PowerActionRefused, match="cannot power nodes"):
        power_down_nodes(cluster, [node.pk], actor=operator)
    assert power_plan()[0].supported is False
    assert apply_power_saving() == 0


def test_power_up_brings_the_node_back_through_the_lifecycle(fleet, operator):
    cluster, nodes = fleet
    power_down_nodes(cluster, [nodes[0].pk], actor=operator)
    cluster.power_saving = False  # a switch turned off must not strand powered-down nodes
    cluster.save(update_fields=["power_saving"])
    result = power_up_nodes(cluster, [nodes[0].pk, nodes[1].pk], actor=operator)
    assert result.done == ["p0"] and result.refused[0].startswith("node ")
    node = Node.objects.get(pk=nodes[0].pk)
    assert (node.state, node.power_state) == (NodeState.NOT_READY, PowerState.ON)
    assert AuditEntry.objects.filter(action="node.resume", details__power="up").count() == 1


def test_a_refusal_of_the_cluster_gives_the_node_back(fleet, operator, monkeypatch):
    """The simulated adapter never refuses; this one refusal is injected (no cluster here can)."""
    from clusters.adapters.base import AdapterError
    from clusters.adapters.simulated import SimulatedAdapter

    def refuse(self, cluster, node):
        raise AdapterError("SuspendProgram is not configured")

    monkeypatch.setattr(SimulatedAdapter, "power_down", refuse)
    cluster, nodes = fleet
    result = power_down_nodes(cluster, [nodes[0].pk], actor=operator)
    assert result.done == [] and "SuspendProgram" in result.refused[0]
    node = Node.objects.get(pk=nodes[0].pk)
    assert (node.state, node.power_state) == (NodeState.READY, PowerState.ON)
    assert list(NodeEvent.objects.filter(node=node).values_list("to_state", flat=True)) == [
        NodeState.DRAINED,
        NodeState.READY,
    ]


# --- the console's power page -----------------------------------------------------------------


def _staff(*perms: str):
    user = make_user()
    user.is_staff = True
    user.save(update_fields=["is_staff"])
    user.user_permissions.add(*Permission.objects.filter(codename__in=perms))
    client = Client()
    client.force_login(user)
    return user, client


def test_page_lists_recommendations_with_totals(fleet, client, operator):
    client.force_login(operator)
    page = client.get(reverse("admin:clusters_cluster_power")).content.decode()
    assert "3 of 4 idle ready nodes recommended" in page
    assert "estimated" in page and "Power down the selected nodes" in page
    assert page.count('name="node"') == 3


@pytest.mark.parametrize(
    "perms, get_status, post_status, powered",
    [
        pytest.param((), 403, 403, 0, id="staff-without-node-permissions"),
        pytest.param(("view_node",), 200, 403, 0, id="may-view-only"),
        pytest.param(("view_node", "change_node"), 200, 302, 1, id="may-change-nodes"),
    ],
)
def test_page_and_action_are_permission_checked(fleet, perms, get_status, post_status, powered):
    cluster, nodes = fleet
    user, client = _staff(*perms)
    url = reverse("admin:clusters_cluster_power")
    assert client.get(url).status_code == get_status
    answer = client.post(url, {"action": "down", "cluster": cluster.pk, "node": [nodes[0].pk]})
    assert answer.status_code == post_status
    assert Node.objects.filter(power_state=PowerState.SUSPENDED).count() == powered
    assert AuditEntry.objects.filter(actor_id=user.pk, action="node.drain").count() == powered


def test_action_needs_the_csrf_token(fleet, operator):
    cluster, nodes = fleet
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)
    answer = client.post(
        reverse("admin:clusters_cluster_power"),
        {"action": "down", "cluster": cluster.pk, "node": [nodes[0].pk]},
    )
    assert answer.status_code == 403
    assert not Node.objects.filter(power_state=PowerState.SUSPENDED).exists()


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"action": "down", "cluster": "x", "node": ["1"]}, id="cluster-not-an-id"),
        pytest.param({"action": "explode", "cluster": "{c}", "node": ["1"]}, id="unknown-action"),
        pytest.param({"action": "down", "cluster": "{c}", "node": ["1; DROP"]}, id="node-not-an-id"),
        pytest.param({"action": "down", "cluster": "{c}", "node": ["9" * 40]}, id="node-id-too-big"),
        pytest.param({"action": "down", "cluster": "{c}", "node": ["١٢"]}, id="non-ascii-digits"),
        pytest.param({"action": "down", "cluster": "99999999999999999999"}, id="cluster-id-too-big"),
    ],
)
def test_hostile_posts_are_400_and_change_nothing(fleet, client, operator, body):
    cluster, _ = fleet
    client.force_login(operator)
    body = {k: (v.replace("{c}", str(cluster.pk)) if isinstance(v, str) else v) for k, v in body.items()}
    answer = client.post(reverse("admin:clusters_cluster_power"), body)
    assert answer.status_code == 400
    assert not Node.objects.exclude(state=NodeState.READY).exists()


def test_action_on_a_switched_off_cluster_says_so(fleet, client, operator):
    cluster, nodes = fleet
    cluster.power_saving = False
    cluster.save(update_fields=["power_saving"])
    client.force_login(operator)
    url = reverse("admin:clusters_cluster_power")
    page = client.get(url).content.decode()
    assert "Recommendations only: switch power saving on" in page and 'name="node"' not in page
    answer = client.post(url, {"action": "down", "cluster": cluster.pk, "node": [nodes[0].pk]}, follow=True)
    assert "power saving is switched off" in answer.content.decode()
    assert not Node.objects.filter(power_state=PowerState.SUSPENDED).exists()


# --- jobs waiting for a model -----------------------------------------------------------------


def test_jobs_waiting_for_a_model_keep_its_nodes_on(fleet, alice, queue, client, operator):
    make_job(alice, queue, gpus=8, nodes=6, reason="Resources")  # a gang bigger than what is idle
    make_job(alice, queue, gpus=1, model="a100", reason="QuotaExceeded")  # not waiting for GPUs
    assert power_plan()[0].recommendations == ()
    assert apply_power_saving() == 0
    client.force_login(operator)
    page = client.get(reverse("admin:clusters_cluster_power")).content.decode()
    assert "Jobs wait for free GPUs of h100-80g (48 GPUs)" in page and "a100" not in page


@pytest.mark.parametrize(
    "switch, waiting_gpus, powered_up",
    [
        pytest.param(True, 8, 1, id="one-node-for-one-node-of-work"),
        pytest.param(True, 9, 2, id="rounded-up"),
        pytest.param(True, 80, 3, id="every-powered-down-node"),
        pytest.param(False, 80, 0, id="switch-off-nothing"),
    ],
)
def test_powered_down_nodes_come_up_for_waiting_jobs(fleet, alice, queue, switch, waiting_gpus, powered_up):
    cluster, _ = fleet
    assert apply_power_saving() == 3  # p0..p2 down, one idle node kept
    Cluster.objects.filter(pk=cluster.pk).update(power_saving=switch)
    make_job(alice, queue, gpus=waiting_gpus, reason="Resources")
    assert apply_power_saving() == powered_up
    assert Node.objects.filter(
        cluster=cluster, state=NodeState.NOT_READY, power_state=PowerState.ON
    ).count() == (powered_up)
    assert apply_power_saving() == 0  # those coming up count: no more for the same jobs
