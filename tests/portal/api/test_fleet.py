"""Projects, queues, clusters, nodes, GPU models, me and tokens."""

from __future__ import annotations

import io

import pytest
from django.core.cache import cache
from django.core.management import CommandError, call_command

from clusters.choices import GpuHealth, NodeState
from clusters.models import ClusterSecret, GpuDevice
from portal.choices import Role
from portal.models import ApiToken
from portal.services.tokens import issue_token
from scheduling.models import QueueQuota
from scheduling.services.allocations import NodePlacement, bind_job
from tests.factories import gpu_model, make_cluster, make_job, make_node, make_queue
from tests.portal.api.conftest import error_paths

API = "/api/v1"


def results(response):
    assert response.status_code == 200, response.content
    body = response.json()
    return body["results"] if isinstance(body, dict) else body


# --- projects and queues --------------------------------------------------------------------


def test_projects_lists_mine_with_my_role_and_queues(api, alice, queue, nlp_queue, vision):
    make_queue(vision, "batch")
    assert results(api(alice).get(f"{API}/projects")) == [
        {"name": "vision", "displayName": "", "role": "member", "queues": ["batch", "default"]}
    ]


def test_operators_see_every_project_without_a_role(api, operator, queue, nlp_queue):
    rows = results(api(operator).get(f"{API}/projects"))
    assert [(p["name"], p["role"]) for p in rows] == [("nlp", None), ("vision", None)]


def test_queues_show_quota_against_use(api, alice, queue, nlp_queue, fleet):
    QueueQuota.objects.create(queue=queue, gpu_model=gpu_model("h100"), gpus=16, borrowing_limit=8)
    QueueQuota.objects.create(queue=queue, gpu_model=gpu_model("a100"), gpus=4)
    running = make_job(alice, queue, gpus=8)
    bind_job(running, [NodePlacement(fleet.h100[0], range(8))])
    make_job(alice, queue)  # waiting: counts as a job, holds no GPUs

    rows = results(api(alice).get(f"{API}/queues"))
    assert [(q["project"], q["name"]) for q in rows] == [("vision", "default")]
    row = rows[0]
    assert row["gpus"] == [
        {"model": "a100-80g", "quota": 4, "borrowingLimit": None, "used": 0},
        {"model": "h100-80g", "quota": 16, "borrowingLimit": 8, "used": 8},
    ]
    assert row["jobs"] == {"SCHEDULED": 1, "PENDING": 1}
    assert (row["priority"], row["maxPendingJobs"], row["cohort"]) == (0, None, None)


def test_use_without_quota_is_still_shown(api, alice, queue, fleet):
    job = make_job(alice, queue, gpus=2, model="a100")
    bind_job(job, [NodePlacement(fleet.a100, [0, 1])])
    row = results(api(alice).get(f"{API}/queues"))[0]
    assert row["gpus"] == [{"model": "a100-80g", "quota": 0, "borrowingLimit": None, "used": 2}]


def test_other_projects_queues_are_not_listed(api, bob, queue, nlp_queue):
    assert [q["project"] for q in results(api(bob).get(f"{API}/queues"))] == ["nlp"]


# --- clusters and nodes ---------------------------------------------------------------------


def test_clusters_show_capacity_and_no_config_or_secret(api, alice, bob, nlp_queue, fleet):
    ClusterSecret.objects.create(cluster=fleet.cluster, data={"token": "s3cr3t-jwt"})
    bind_job(make_job(bob, nlp_queue), [NodePlacement(fleet.h100[2], [0])])
    response = api(alice).get(f"{API}/clusters")
    [cluster] = results(response)
    assert (cluster["name"], cluster["displayName"], cluster["state"]) == ("sim-a", "Simulated A", "ready")
    assert cluster["nodes"] == {"total": 4, "ready": 4}
    assert {g["model"]: (g["total"], g["allocated"], g["free"]) for g in cluster["gpus"]} == {
        "a100-80g": (4, 0, 4),
        "h100-80g": (24, 1, 23),
    }
    assert "config" not in cluster and "secret" not in cluster
    assert b"s3cr3t-jwt" not in response.content and b"a.invalid" not in response.content


def test_cluster_detail(api, alice, fleet):
    make_cluster("sim-b")
    response = api(alice).get(f"{API}/clusters/sim-a")
    assert response.status_code == 200
    body = response.json()
    assert body["name"] == "sim-a" and body["nodes"] == {"total": 4, "ready": 4}
    assert "config" not in body and b"a.invalid" not in response.content
    empty = api(alice).get(f"{API}/clusters/sim-b").json()
    assert (empty["nodes"], empty["gpus"]) == ({"total": 0, "ready": 0}, [])


@pytest.mark.parametrize("name", ["nope", "SIM-A", "sim-a%20"])
def test_unknown_cluster_is_a_404(api, alice, fleet, name):
    response = api(alice).get(f"{API}/clusters/{name}")
    assert response.status_code == 404, response.content[:200]
    assert response.json() == {"detail": "Not found.", "errors": []}


def test_a_nul_in_the_path_is_refused_up_front(api, alice, fleet):
    response = api(alice).get(f"{API}/clusters/%00")
    assert response.status_code == 400
    assert response.json()["errors"] == [{"path": "path", "message": "must not contain NUL characters"}]


def node_names(response):
    return [n["name"] for n in results(response)]


@pytest.fixture
def two_clusters(fleet):
    other = make_cluster("sim-b")
    make_node(other, gpus=8, model="h100", name="b-h0", state=NodeState.DRAINED)
    make_node(other, gpus=2, model="l40s", name="b-l0")
    return fleet


@pytest.mark.parametrize(
    "params, expected",
    [
        ({}, ["a-a0", "a-h0", "a-h1", "a-h2", "b-h0", "b-l0"]),
        ({"cluster": "sim-b"}, ["b-h0", "b-l0"]),
        ({"cluster": "nowhere"}, []),
        ({"state": "drained"}, ["b-h0"]),
        ({"state": "READY"}, ["a-a0", "a-h0", "a-h1", "a-h2", "b-l0"]),
        ({"state": "drained,ready", "cluster": "sim-b"}, ["b-h0", "b-l0"]),
        ({"gpuModel": "h100"}, ["a-h0", "a-h1", "a-h2", "b-h0"]),
        ({"gpuModel": "h100-80g", "cluster": "sim-b"}, ["b-h0"]),
        ({"gpuModel": "NVIDIA L40S"}, ["b-l0"]),
        ({"gpuModel": "mi300x"}, []),
    ],
    ids=lambda v: "&".join(f"{k}={x}" for k, x in v.items()) or "all" if isinstance(v, dict) else None,
)
def test_node_filters(api, alice, two_clusters, params, expected):
    assert node_names(api(alice).get(f"{API}/nodes", params)) == expected


def test_node_rows_count_healthy_and_allocated_gpus(api, alice, queue, fleet):
    node = fleet.h100[0]
    GpuDevice.objects.filter(node=node, index__in=[6, 7]).update(health=GpuHealth.UNHEALTHY)
    bind_job(make_job(alice, queue, gpus=3), [NodePlacement(node, [0, 1, 2])])
    [row] = [n for n in results(api(alice).get(f"{API}/nodes", {"gpuModel": "h100"})) if n["name"] == "a-h0"]
    assert (row["cluster"], row["gpuModel"], row["state"]) == ("sim-a", "h100-80g", "ready")
    assert row["gpus"] == {"total": 8, "healthy": 6, "allocated": 3}
    assert row["memoryBytes"] == 512 * 2**30 and row["cpuMillicores"] == 64_000


@pytest.mark.parametrize("name", ["z9000", "h100:8", "x" * 500, "h1\x0000"])
def test_unknown_gpu_model_filter_is_a_400(api, alice, fleet, name):
    response = api(alice).get(f"{API}/nodes", {"gpuModel": name})
    assert response.status_code == 400, response.content[:200]
    assert error_paths(response) == ["query.gpuModel"]


@pytest.mark.parametrize("key", ["cluster", "state"])
def test_nul_bytes_in_node_filters_are_never_a_500(api, alice, fleet, key):
    response = api(alice).get(f"{API}/nodes", {key: "sim\x00"})
    assert response.status_code in (200, 400), response.content[:200]


def test_nodes_are_cursor_paginated(api, alice, fleet):
    client = api(alice)
    first = client.get(f"{API}/nodes", {"limit": 3}).json()
    second = client.get(first["next"]).json()
    assert [n["name"] for n in first["results"] + second["results"]] == ["a-a0", "a-h0", "a-h1", "a-h2"]
    assert second["next"] is None


def test_gpu_models_list_the_catalog_with_aliases(api, alice):
    rows = {m["slug"]: m for m in results(api(alice).get(f"{API}/gpu-models"))}
    assert {"h100-80g", "a100-80g", "h200-141g", "mi300x-192g"} <= set(rows)
    h100 = rows["h100-80g"]
    assert {"h100", "h100-80gb"} <= set(h100["aliases"])
    assert h100["aliases"] == sorted(h100["aliases"])
    assert (h100["vendor"], h100["memoryMb"], h100["tdpWatts"]) == ("nvidia", 81559, 700)
    assert rows["mi300x-192g"]["vendor"] == "amd"


# --- me and tokens ----------------------------------------------------------------------------


def test_me(api, alice, vision, nlp):
    nlp.memberships.create(user=alice, role=Role.MANAGER)
    body = api(alice, scopes=["read"]).get(f"{API}/me").json()
    assert body.pop("token")["scopes"] == ["read"]
    assert body == {
        "username": "alice",
        "operator": False,
        "projects": [{"name": "nlp", "role": "manager"}, {"name": "vision", "role": "member"}],
        "authenticatedWith": "token",
    }


def test_me_for_an_operator(api, operator):
    body = api(operator).get(f"{API}/me").json()
    assert (body["username"], body["operator"], body["projects"]) == ("ops", True, [])


def test_a_new_token_is_shown_once_and_works(api, alice):
    client = api(alice)
    response = client.post(f"{API}/tokens", {"name": "ci", "expiresInDays": 30}, format="json")
    assert response.status_code == 201, response.content
    created = response.json()
    plaintext = created["token"]
    assert plaintext.startswith(created["prefix"]) and created["name"] == "ci"
    assert created["expiresAt"] is not None and created["revokedAt"] is None

    listed = client.get(f"{API}/tokens")
    assert plaintext.encode() not in listed.content
    rows = results(listed)
    assert all("token" not in row for row in rows)
    assert created["id"] in [row["id"] for row in rows]
    assert ApiToken.objects.get(pk=created["id"]).digest != plaintext

    fresh = api()
    fresh.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert fresh.get(f"{API}/me").json()["username"] == "alice"


@pytest.mark.parametrize(
    "body",
    [
        {"name": "x" * 81},
        {"expiresInDays": 0},
        {"expiresInDays": 4000},
        {"expiresInDays": "soon"},
        {"name": "a\x00b"},
    ],
    ids=["long-name", "zero-days", "too-many-days", "words", "nul"],
)
def test_bad_token_requests_are_a_400(api, alice, body):
    client = api(alice)
    before = ApiToken.objects.count()
    response = client.post(f"{API}/tokens", body, format="json")
    assert response.status_code == 400
    assert error_paths(response) == [next(iter(body))]
    assert ApiToken.objects.count() == before


def test_a_token_request_that_is_not_an_object_gets_defaults(api, alice):
    response = api(alice).post(f"{API}/tokens", [1, 2], format="json")
    assert response.status_code == 201
    assert response.json()["name"] == "default"


def test_deleting_a_token_revokes_it(api, alice):
    token, plaintext = issue_token(alice, name="laptop")
    victim = api()
    victim.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert victim.get(f"{API}/me").status_code == 200

    client = api(alice)
    assert client.delete(f"{API}/tokens/{token.pk}").status_code == 204
    assert victim.get(f"{API}/me").status_code == 401
    assert ApiToken.objects.get(pk=token.pk).revoked_at is not None
    [row] = [r for r in results(client.get(f"{API}/tokens")) if r["id"] == token.pk]
    assert row["revokedAt"] is not None
    assert client.delete(f"{API}/tokens/{token.pk}").status_code == 204  # idempotent


def test_a_token_can_revoke_itself(api, alice):
    token, plaintext = issue_token(alice)
    client = api()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert client.delete(f"{API}/tokens/{token.pk}").status_code == 204
    assert client.get(f"{API}/me").status_code == 401


def test_someone_elses_token_cannot_be_deleted(api, alice, bob):
    token, plaintext = issue_token(alice)
    response = api(bob).delete(f"{API}/tokens/{token.pk}")
    assert response.status_code == 404
    assert ApiToken.objects.get(pk=token.pk).revoked_at is None
    still = api()
    still.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert still.get(f"{API}/me").status_code == 200
    assert token.pk not in [r["id"] for r in results(api(bob).get(f"{API}/tokens"))]


def test_issue_token_command_prints_a_working_token(api, alice):
    out = io.StringIO()
    call_command("issue_token", "alice", "--name", "cli-test", stdout=out)
    plaintext = out.getvalue().strip()
    assert ApiToken.objects.filter(user=alice, name="cli-test").count() == 1
    client = api()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert client.get(f"{API}/me").json()["username"] == "alice"


def test_issue_token_command_refuses_unknown_and_inactive_users(alice):
    alice.is_active = False
    alice.save()
    for name in ("alice", "nobody"):
        with pytest.raises(CommandError):
            call_command("issue_token", name, stdout=io.StringIO())
    assert not ApiToken.objects.exists()


# --- the OpenAPI document ---------------------------------------------------------------------


def test_schema_and_docs_are_served(client, db):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    assert {"/api/v1/jobs", "/api/v1/jobs/batch", "/api/v1/jobs/{ref}/cancel", "/api/v1/tokens/{id}"} <= set(
        paths
    )
    assert "bearerAuth" in schema.json()["components"]["securitySchemes"]
    assert client.get("/api/docs/").status_code == 200


@pytest.mark.parametrize(
    "path, queries",
    [
        ("projects", 4),
        ("queues", 5),
        ("clusters", 5),
        ("clusters/sim-a", 5),
        ("nodes", 2),
        ("nodes?gpuModel=h100", 4),
        ("nodes/{node}/events", 3),
        ("gpu-models", 3),
        ("me", 2),
        ("tokens", 2),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_fleet_reads_take_a_fixed_number_of_queries(
    api, alice, queue, fleet, path, queries, django_assert_num_queries
):
    """Query-count baselines, whatever the size of the fleet (token lookup included)."""
    bind_job(make_job(alice, queue, gpus=2, nodes=2), [NodePlacement(n, [0, 1]) for n in fleet.h100[:2]])
    client, url = api(alice), f"{API}/{path.format(node=fleet.h100[0].pk)}"
    assert client.get(url).status_code == 200
    cache.clear()
    with django_assert_num_queries(queries):
        assert client.get(url).status_code == 200
