"""The agent protocol over HTTP: registration, credential scope, stale reports, bad payloads."""

from __future__ import annotations

import pytest
from django.test import Client

from clusters.choices import GpuHealth, NodeState
from clusters.ingest.buffer import get_buffer
from clusters.models import GpuDevice, JoinToken, Node, NodeCredential
from clusters.services.credentials import create_join_token, issue_cluster_credential, revoke
from tests.factories import make_cluster, make_node

pytestmark = pytest.mark.django_db


def post(client: Client, path: str, body, bearer: str = ""):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {bearer}"} if bearer else {}
    return client.post(f"/api/v1/agent/{path}", body, content_type="application/json", **headers)


def description(name: str = "gpu-001", gpus: int = 2, model: str = "NVIDIA H100 80GB HBM3") -> dict:
    return {
        "name": name,
        "cpu_millicores": 64_000,
        "memory_bytes": 2**39,
        "agent_version": "0.1.0",
        "boot_id": "boot-1",
        "labels": {"rack": "r1"},
        "gpus": [
            {"index": i, "model": model, "uuid": f"GPU-{name}-{i}", "memory_total_mb": 81559}
            for i in range(gpus)
        ],
    }


def report(name: str = "gpu-001", seq: int = 1, boot: str = "boot-1", gpus: int = 2, **extra) -> dict:
    return {
        "node": name,
        "boot_id": boot,
        "seq": seq,
        "cpu": 0.5,
        "memory": 2**30,
        "power_w": 800.0,
        "gpus": [
            {"index": i, "util": 50.0, "power_w": 300.0, "temp_c": 55.0, "memory_used_mb": 1000}
            for i in range(gpus)
        ],
        **extra,
    }


@pytest.fixture
def cluster():
    return make_cluster("rack-a", kind="native")


@pytest.fixture
def registered(client, cluster):
    _, join = create_join_token(cluster)
    answer = post(client, "register", description(), join)
    assert answer.status_code == 201, answer.content
    return answer.json()


def test_registration_creates_the_node_and_a_scoped_credential(registered, cluster):
    node = Node.objects.get(cluster=cluster, name="gpu-001")
    assert registered["nodeId"] == node.pk and registered["credential"].startswith("orn_")
    assert node.state == NodeState.NOT_READY and node.gpu_capacity == 2
    assert list(GpuDevice.objects.filter(node=node).values_list("model__slug", flat=True)) == ["h100-80g"] * 2
    assert registered["credential"] not in {c.digest for c in NodeCredential.objects.all()}
    assert JoinToken.objects.get(cluster=cluster).uses == 1


def test_registering_again_revokes_the_old_credential(client, cluster, registered):
    _, join = create_join_token(cluster)
    again = post(client, "register", description(), join).json()
    assert post(client, "heartbeat", report(seq=1), again["credential"]).status_code == 200
    assert post(client, "heartbeat", report(seq=2), registered["credential"]).status_code == 401
    assert NodeCredential.objects.filter(node_id=again["nodeId"], revoked_at__isnull=True).count() == 1


@pytest.mark.parametrize("token", ["", "orj_nope", "orn_x"], ids=["missing", "unknown", "wrong-kind"])
def test_registration_needs_a_live_join_token(client, token):
    assert post(client, "register", description(), token).status_code == 401


def test_revoked_join_token_is_refused(client, cluster):
    token, join = create_join_token(cluster)
    revoke(token)
    assert post(client, "register", description(), join).status_code == 401


def test_heartbeat_is_buffered_not_written(client, registered, django_assert_max_num_queries):
    # The credential and the node's desired attempts, read once; then both come from caches.
    with django_assert_max_num_queries(2):
        answer = post(client, "heartbeat", report(seq=1), registered["credential"])
    assert answer.status_code == 200
    assert answer.json() == {"accepted": True, "interval": 10, "desired": [], "stop": []}
    assert get_buffer().latest([registered["nodeId"]])[registered["nodeId"]]["q"] == 1
    with django_assert_max_num_queries(0):
        post(client, "heartbeat", report(seq=2), registered["credential"])


def test_a_node_credential_speaks_for_its_node_only(client, cluster, registered):
    make_node(cluster, name="gpu-002")
    answer = post(client, "heartbeat", report(name="gpu-002"), registered["credential"])
    assert answer.status_code == 403
    assert get_buffer().latest() == {}


def test_replayed_and_stale_heartbeats_are_ignored(client, registered):
    cred = registered["credential"]
    assert post(client, "heartbeat", report(seq=5), cred).json()["accepted"] is True
    assert post(client, "heartbeat", report(seq=5), cred).json()["accepted"] is False
    assert post(client, "heartbeat", report(seq=3), cred).json()["accepted"] is False
    assert get_buffer().latest([registered["nodeId"]])[registered["nodeId"]]["q"] == 5
    assert get_buffer().counters()["stale"] == 2


BAD_REPORTS = [
    ({"seq": -1}, "seq"),
    ({"seq": "7"}, "seq"),
    ({"boot_id": None}, "boot_id"),
    ({"cpu": 1.5}, "cpu"),
    ({"memory": -5}, "memory"),
    ({"gpus": "lots"}, "gpus"),
    ({"gpus": [{"index": 0, "util": 120}]}, "gpus[0].util"),
    ({"gpus": [{"index": "zero"}]}, "gpus[0].index"),
    ({"gpus": [{"index": 0, "health": "meh"}]}, "gpus[0].health"),
    ({"gpus": [{"index": 0, "power_w": True}]}, "gpus[0].power_w"),
    ({"running": "all"}, "running"),
]


@pytest.mark.parametrize("change, path", BAD_REPORTS, ids=[p for _, p in BAD_REPORTS])
def test_malformed_heartbeats_are_400_with_a_path(client, registered, change, path):
    answer = post(client, "heartbeat", report() | change, registered["credential"])
    assert answer.status_code == 400
    assert answer.json()["errors"][0]["path"] == path
    assert get_buffer().latest() == {}


@pytest.mark.parametrize("body", [b"{", b"[]", b"null", b"\xff"], ids=["truncated", "list", "null", "binary"])
def test_garbage_is_400(client, registered, body):
    answer = client.post(
        "/api/v1/agent/heartbeat",
        body,
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {registered['credential']}",
    )
    assert answer.status_code == 400


def test_only_post(client):
    assert client.get("/api/v1/agent/heartbeat").status_code == 405


def test_unknown_gpu_model_in_registration_is_400(client, cluster):
    _, join = create_join_token(cluster)
    answer = post(client, "register", description(model="Quantum QPU 9000"), join)
    assert answer.status_code == 400 and answer.json()["errors"][0]["path"] == "gpus[0].model"
    assert not Node.objects.filter(cluster=cluster).exists()


def test_collectors_declare_nodes_and_report_in_batches(client, cluster):
    _, cred = issue_cluster_credential(cluster)
    declared = post(
        client, "nodes", {"cluster": "rack-a", "nodes": [description(f"n{i}") for i in range(3)]}, cred
    )
    assert declared.status_code == 200 and Node.objects.filter(cluster=cluster).count() == 3
    body = {"cluster": "rack-a", "nodes": [report(f"n{i}", seq=1) for i in range(3)] + [report("ghost")]}
    answer = post(client, "report", body, cred).json()
    assert (answer["accepted"], answer["stale"], answer["unknown"]) == (3, 0, ["ghost"])
    again = post(client, "report", {"cluster": "rack-a", "nodes": [report("n0", seq=1)]}, cred).json()
    assert (again["accepted"], again["stale"]) == (0, 1)


def test_a_cluster_credential_reports_for_its_cluster_only(client, cluster):
    other = make_cluster("rack-b")
    make_node(other, name="n0")
    _, cred = issue_cluster_credential(cluster)
    assert post(client, "report", {"cluster": "rack-b", "nodes": [report("n0")]}, cred).status_code == 403
    assert post(client, "nodes", {"cluster": "rack-b", "nodes": []}, cred).status_code == 403
    assert get_buffer().latest() == {}


def test_a_bad_record_in_a_batch_names_its_index(client, cluster):
    _, cred = issue_cluster_credential(cluster)
    post(client, "nodes", {"cluster": "rack-a", "nodes": [description("n0"), description("n1")]}, cred)
    body = {"cluster": "rack-a", "nodes": [report("n0"), report("n1", cpu=-1)]}
    answer = post(client, "report", body, cred)
    assert answer.status_code == 400 and answer.json()["errors"][0]["path"] == "nodes[1].cpu"
    assert get_buffer().latest() == {}


def test_gpu_health_in_registration_defaults_to_healthy(registered):
    assert set(GpuDevice.objects.values_list("health", flat=True)) == {GpuHealth.HEALTHY}
