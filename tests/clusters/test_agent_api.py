"""The agent protocol over HTTP: registration, credential scope, stale reports, bad payloads."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from clusters.choices import GpuHealth, NodeState
from clusters.ingest.buffer import get_buffer
from clusters.models import GpuDevice, JoinToken, Node, NodeCredential, NodeEvent, NodeLastSeen
from clusters.services.credentials import (
    allow_reregistration,
    create_join_token,
    forget_cached_identities,
    issue_cluster_credential,
    revoke,
)
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


def test_registering_again_with_the_current_credential_rotates_it(client, cluster, registered):
    _, join = create_join_token(cluster)
    again = post(client, "register", description() | {"credential": registered["credential"]}, join).json()
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
    # The credential, its cluster's credentials and the node's desired attempts, read once;
    # then all come from caches.
    with django_assert_max_num_queries(3):
        answer = post(client, "heartbeat", report(seq=1), registered["credential"])
    assert answer.status_code == 200
    expected = {"accepted": True, "interval": 10, "failover_after_s": 300, "desired": [], "stop": []}
    assert answer.json() == expected
    assert get_buffer().latest([registered["nodeId"]])[registered["nodeId"]]["q"] == 1
    with django_assert_max_num_queries(0):
        post(client, "heartbeat", report(seq=2), registered["credential"])


def test_one_read_caches_the_credentials_of_the_whole_cluster(client, cluster, registered):
    _, join = create_join_token(cluster)
    second = post(client, "register", description(name="gpu-002"), join).json()
    forget_cached_identities()
    assert post(client, "heartbeat", report(seq=1), registered["credential"]).status_code == 200
    with CaptureQueriesContext(connection) as queries:
        answer = post(client, "heartbeat", report(name="gpu-002", seq=1), second["credential"])
    assert answer.status_code == 200
    assert not [q for q in queries if "credential" in q["sql"]]


def test_a_revoked_credential_is_refused_though_its_cluster_was_cached(client, cluster, registered):
    _, join = create_join_token(cluster)
    second = post(client, "register", description(name="gpu-002"), join).json()
    forget_cached_identities()
    assert post(client, "heartbeat", report(seq=1), registered["credential"]).status_code == 200
    revoke(NodeCredential.objects.get(node_id=second["nodeId"], revoked_at__isnull=True))
    assert post(client, "heartbeat", report(name="gpu-002", seq=1), second["credential"]).status_code == 401


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


# --- the attacker's side: join tokens, takeovers, ---------------------------------------------------


def test_a_join_token_admits_one_machine_unless_told_otherwise(client, cluster):
    _, join = create_join_token(cluster)
    assert post(client, "register", description("gpu-001"), join).status_code == 201
    again = post(client, "register", description("gpu-002"), join)
    assert again.status_code == 401 and "used up" in again.json()["detail"]
    assert not Node.objects.filter(name="gpu-002").exists()
    token, fleet = create_join_token(cluster, max_uses=2)
    assert [post(client, "register", description(f"n{i}"), fleet).status_code for i in range(3)] == [
        201,
        201,
        401,
    ]
    assert JoinToken.objects.get(pk=token.pk).uses == 2


def test_a_join_token_expires(client, cluster, settings):
    from datetime import timedelta

    from django.utils import timezone

    token, join = create_join_token(cluster)
    assert token.expires_at - timezone.now() > timedelta(minutes=59)  # an hour by default
    JoinToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    answer = post(client, "register", description(), join)
    assert answer.status_code == 401 and "expired" in answer.json()["detail"]
    assert not Node.objects.filter(cluster=cluster).exists()


def test_a_registered_node_cannot_be_taken_over(client, cluster, registered):
    node = Node.objects.get(pk=registered["nodeId"])
    _, join = create_join_token(cluster)
    hijack = description(gpus=1) | {"labels": {"orrery.io/address": "evil.example"}}
    answer = post(client, "register", hijack, join)
    assert answer.status_code == 409 and "current credential" in answer.json()["detail"]
    assert post(client, "heartbeat", report(seq=1), registered["credential"]).status_code == 200
    node.refresh_from_db()
    assert node.labels == {"rack": "r1"} and node.gpu_capacity == 2  # nothing changed
    assert JoinToken.objects.filter(uses=1).count() == 1  # the refused attempt used no token
    # A wrong credential is no better than none.
    _, other = create_join_token(cluster)
    assert post(client, "register", hijack | {"credential": "orn_guess"}, other).status_code == 409


def test_an_operator_lets_a_node_register_again(client, cluster, registered):
    node = Node.objects.get(pk=registered["nodeId"])
    assert allow_reregistration(node) == 1
    assert post(client, "heartbeat", report(seq=1), registered["credential"]).status_code == 401
    Node.objects.filter(pk=node.pk).update(state=NodeState.READY)
    _, join = create_join_token(cluster)
    assert post(client, "register", description(), join).status_code == 201
    node.refresh_from_db()  # not ready until the new agent's first heartbeat, and the history says why
    assert node.state == NodeState.NOT_READY
    assert NodeEvent.objects.filter(
        node=node, to_state=NodeState.NOT_READY, reason="registered again"
    ).exists()


def test_a_new_node_is_not_ready_until_its_first_heartbeat(client, cluster, registered, settings):
    from datetime import timedelta

    from django.utils import timezone

    from clusters.services.aggregation import flush_heartbeats
    from clusters.services.lifecycle import run_node_lifecycle

    settings.NODE_RECOVERY = 30
    assert not NodeLastSeen.objects.filter(node_id=registered["nodeId"]).exists()
    later = timezone.now() + timedelta(seconds=35)
    assert run_node_lifecycle(later).ready == []  # registered 35 s ago, never heard from
    assert Node.objects.get(pk=registered["nodeId"]).state == NodeState.NOT_READY
    post(client, "heartbeat", report(seq=1), registered["credential"])
    flush_heartbeats()
    assert NodeLastSeen.objects.filter(node_id=registered["nodeId"]).exists()


@pytest.mark.parametrize(
    "change, path",
    [
        ({"boot_id": "b\x00"}, "boot_id"),
        ({"labels": {"rack": "r\x00"}}, "labels"),
        ({"agent_version": "0\x00"}, "agent_version"),
        ({"labels": {f"k{i}": "v" for i in range(65)}}, "labels"),
    ],
    ids=["nul-boot", "nul-label", "nul-version", "too-many-labels"],
)
def test_a_nul_or_an_oversized_field_in_a_registration_is_400(client, cluster, change, path):
    _, join = create_join_token(cluster)
    answer = post(client, "register", description() | change, join)
    assert answer.status_code == 400 and answer.json()["errors"][0]["path"] == path


# --- the attacker's side: reports about attempts ----------------------------------------------------


@pytest.fixture
def placed(client, cluster, registered, alice, queue):
    """A job of alice's placed on gpu-001, and a second node (gpu-002) of the same cluster."""
    from scheduling.engine.cache import SchedulerCache
    from scheduling.engine.cycle import run_cycle
    from scheduling.models import JobAttempt
    from tests.factories import make_job

    Node.objects.filter(pk=registered["nodeId"]).update(state=NodeState.READY)
    job = make_job(alice, queue, gpus=1, placement={"clusters": ["rack-a"]})
    assert run_cycle(SchedulerCache()).placed == 1
    _, join = create_join_token(cluster)
    other = post(client, "register", description("gpu-002"), join).json()
    return {
        "job": job,
        "attempt": str(JobAttempt.objects.get(job=job).pk),
        "node": registered,
        "other": other,
    }


def attempts(client, node: dict, reports=(), logs=()):
    body = {"node": node["node"], "reports": list(reports), "logs": list(logs)}
    return post(client, "attempts", body, node["credential"])


def test_output_is_kept_only_for_attempts_placed_on_the_reporting_node(client, placed):
    from scheduling.selectors import log_tail

    chunk = {"attempt": placed["attempt"], "offset": 0, "data": "alice's secret output\n"}
    answer = attempts(client, placed["other"], logs=[chunk])  # gpu-002 writes into gpu-001's job
    assert answer.status_code == 200
    assert answer.json()["errors"] == [{"path": "logs[0]", "message": "not an attempt placed on this node"}]
    assert log_tail(placed["job"].pk, 10) == ([], False)
    assert attempts(client, placed["node"], logs=[chunk]).json()["errors"] == []
    assert log_tail(placed["job"].pk, 10) == (["alice's secret output"], False)


def test_an_absurd_offset_cannot_freeze_a_log(client, placed):
    from scheduling.selectors import log_tail

    far = {"attempt": placed["attempt"], "offset": 1 << 39, "data": "x"}
    beyond = {"attempt": placed["attempt"], "offset": 1 << 50, "data": "x"}
    answer = attempts(client, placed["node"], logs=[far, beyond]).json()
    assert [e["path"] for e in answer["errors"]] == ["logs[0]", "logs[1]"]
    first = {"attempt": placed["attempt"], "offset": 0, "data": "epoch 1\n"}
    assert attempts(client, placed["node"], logs=[first]).json()["errors"] == []
    assert log_tail(placed["job"].pk, 10) == (["epoch 1"], False)  # the log still follows


def test_a_nul_byte_in_output_is_stored_and_later_reports_flow(client, placed):
    from scheduling.models import Job
    from scheduling.selectors import log_tail

    nul = {"attempt": placed["attempt"], "offset": 0, "data": "before\x00after\n"}
    answer = attempts(client, placed["node"], logs=[nul])
    assert answer.status_code == 200 and answer.json()["errors"] == []
    assert log_tail(placed["job"].pk, 10) == (["before\ufffdafter"], False)
    more = {"attempt": placed["attempt"], "offset": len(b"before\x00after\n"), "data": "next\n"}
    running = {"attempt": placed["attempt"], "state": "running"}
    assert attempts(client, placed["node"], reports=[running], logs=[more]).json()["applied"] == 1
    assert log_tail(placed["job"].pk, 10)[0] == ["before\ufffdafter", "next"]
    assert Job.objects.get(pk=placed["job"].pk).state == "RUNNING"


def test_one_bad_item_is_refused_alone(client, placed):
    from scheduling.models import Job

    answer = attempts(
        client,
        placed["node"],
        reports=[
            {"attempt": "not-a-uuid", "state": "running"},
            {"attempt": placed["attempt"], "state": "running"},
            {"attempt": placed["attempt"], "state": "failed", "exit_code": 999},
            {"attempt": placed["attempt"], "state": "failed", "reason": "r\x00"},
        ],
        logs=[{"attempt": placed["attempt"], "offset": -1, "data": "x"}],
    )
    assert answer.status_code == 200
    body = answer.json()
    assert [e["path"] for e in body["errors"]] == [
        "logs[0]",
        "reports[0]",
        "reports[2].exit_code",
        "reports[3].reason",
    ]
    assert body["applied"] == 1 and Job.objects.get(pk=placed["job"].pk).state == "RUNNING"


NOT_ATTEMPT_IDS = [
    "not-a-uuid",
    "",
    "{12345678-1234-5678-1234-567812345678}",  # uuid.UUID() reads braces and urn:uuid: too
    "urn:uuid:12345678-1234-5678-1234-567812345678",
    "12345678123456781234567812345678",
    "٠" * 32,  # int(…, 16) reads Arabic-Indic digits
    "12345678-1234-5678-1234-56781234567\x00",
    "x" * 100_000,
    5,
    2**64,
    None,
    ["12345678-1234-5678-1234-567812345678"],
    {"id": "12345678-1234-5678-1234-567812345678"},
]


@pytest.mark.parametrize("attempt", NOT_ATTEMPT_IDS, ids=range(len(NOT_ATTEMPT_IDS)))
def test_an_attempt_id_that_is_not_a_uuid_is_refused_alone(client, placed, attempt):
    """Not a 500, whatever stands for the attempt id: that item is refused with its path and the
    valid one beside it is applied."""
    from scheduling.models import Job

    running = {"attempt": placed["attempt"], "state": "running"}
    answer = attempts(
        client,
        placed["node"],
        reports=[{"attempt": attempt, "state": "running"}, running],
        logs=[{"attempt": attempt, "offset": 0, "data": "x"}],
    )
    assert answer.status_code == 200, answer.content[:300]
    assert [e["path"] for e in answer.json()["errors"]] == ["logs[0]", "reports[0]"]
    assert Job.objects.get(pk=placed["job"].pk).state == "RUNNING"


@pytest.mark.parametrize("attempt", ["not-a-uuid", "٠" * 32, "x" * 64])
def test_a_heartbeat_naming_unknown_running_attempts_is_answered(client, placed, attempt):
    body = {**report("gpu-001"), "running": [attempt]}
    answer = post(client, "heartbeat", body, placed["node"]["credential"])
    assert answer.status_code == 200, answer.content[:300]
    assert attempt in answer.json()["stop"]  # not the server's: the node is told to stop it
