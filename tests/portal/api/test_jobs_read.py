"""Reading jobs: list, detail, events, logs, filters, cursor pages, and who may see what."""

from __future__ import annotations

import base64
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.utils import timezone
from rest_framework.test import APIClient

from scheduling.choices import JobState
from scheduling.models import Job
from scheduling.services.allocations import NodePlacement, bind_job
from tests.factories import make_job
from tests.portal.api.conftest import error_paths

JOBS = "/api/v1/jobs"


def ids(response) -> list[int]:
    assert response.status_code == 200, response.content
    return [job["id"] for job in response.json()["results"]]


def test_list_shows_the_users_jobs_newest_first(api, alice, queue):
    older, newer = make_job(alice, queue), make_job(alice, queue)
    response = api(alice).get(JOBS)
    assert ids(response) == [newer.pk, older.pk]
    row = response.json()["results"][0]
    assert (row["owner"], row["project"], row["state"], row["stateCode"]) == (
        "alice",
        "vision",
        "PENDING",
        "PD",
    )
    assert "spec" not in row


def test_detail_has_the_spec_and_placement(api, alice, queue, fleet):
    job = make_job(alice, queue, gpus=2, spec={"run": "x"})
    bind_job(job, [NodePlacement(fleet.h100[1], [3, 5])])
    body = api(alice).get(f"{JOBS}/{job.pk}").json()
    assert (body["id"], body["state"], body["spec"], body["reason"]) == (
        job.pk,
        "SCHEDULED",
        {"run": "x"},
        None,
    )
    assert body["placement"]["cluster"] == "sim-a"
    assert body["placement"]["nodes"] == [{"node": "a-h1", "gpus": [3, 5]}]
    assert body["placement"]["active"] is True and body["attempts"] == 1


def test_events_list_the_history_in_order(api, alice, queue):
    job = make_job(alice, queue)
    client = api(alice)
    client.post(f"{JOBS}/{job.pk}/hold")
    client.post(f"{JOBS}/{job.pk}/release")
    events = client.get(f"{JOBS}/{job.pk}/events").json()
    assert [(e["fromState"], e["toState"], e["actor"]) for e in events] == [
        ("PENDING", "HELD", "alice"),
        ("HELD", "PENDING", "alice"),
    ]


@pytest.mark.parametrize("query", ["", "?tail=1", "?tail=10000", "?tail=50"])
def test_logs_are_empty_for_now(api, alice, queue, query):
    job = make_job(alice, queue)
    response = api(alice).get(f"{JOBS}/{job.pk}/logs{query}")
    assert response.status_code == 200
    assert response.json() == {"jobId": job.pk, "ref": str(job.pk), "lines": [], "truncated": False}


@pytest.mark.parametrize(
    "tail",
    ["0", "10001", "-1", "abc", "1.5", " 5", "", "²", "1" * 5000, "٣"],
    ids=lambda tail: tail if len(tail) < 10 else f"{len(tail)}-digits",
)
def test_bad_tail_is_a_400(api, alice, queue, tail):
    job = make_job(alice, queue)
    response = api(alice).get(f"{JOBS}/{job.pk}/logs", {"tail": tail})
    assert response.status_code == 400, response.content
    assert error_paths(response) == ["query.tail"]


# --- filters ------------------------------------------------------------------------------


@pytest.fixture
def jobs(alice, queue, fleet):
    """Five jobs of alice's in vision: two pending, a held, a running on sim-a, a cancelled one."""
    batch_queue = queue.project.queues.create(name="batch")
    pending = make_job(alice, queue, name="train-a")
    pending2 = make_job(alice, batch_queue, name="train-b")
    held = make_job(alice, queue, name="eval-1", state=JobState.HELD)
    running = make_job(alice, queue, name="train-c", gpus=8)
    bind_job(running, [NodePlacement(fleet.h100[0], range(8))])
    Job.objects.filter(pk=running.pk).update(state=JobState.RUNNING)
    cancelled = make_job(alice, queue, name="old", state=JobState.CANCELLED)
    return {
        "pending": pending,
        "pending2": pending2,
        "held": held,
        "running": running,
        "cancelled": cancelled,
    }


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"state": "PENDING"}, {"pending", "pending2"}),
        ({"state": "pending"}, {"pending", "pending2"}),
        ({"state": "PD"}, {"pending", "pending2", "held"}),
        ({"state": "R"}, {"running"}),
        ({"state": "pd, r"}, {"pending", "pending2", "held", "running"}),
        ({"state": "CA,HELD"}, {"cancelled", "held"}),
        ({"queue": "batch"}, {"pending2"}),
        ({"queue": "default,batch"}, {"pending", "pending2", "held", "running", "cancelled"}),
        ({"project": "vision"}, {"pending", "pending2", "held", "running", "cancelled"}),
        ({"project": "nlp"}, set()),
        ({"user": "alice"}, {"pending", "pending2", "held", "running", "cancelled"}),
        ({"user": "bob"}, set()),
        ({"name": "train"}, {"pending", "pending2", "running"}),
        ({"name": "train-a"}, {"pending"}),
        ({"name": "rain"}, set()),
        ({"cluster": "sim-a"}, {"running"}),
        ({"cluster": "sim-b"}, set()),
        ({"state": "PD", "queue": "default"}, {"pending", "held"}),
    ],
    ids=lambda v: "&".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else None,
)
def test_filters(api, alice, jobs, params, expected):
    by_id = {job.pk: key for key, job in jobs.items()}
    assert {by_id[i] for i in ids(api(alice).get(JOBS, params))} == expected


def test_submitted_time_filters(api, alice, jobs):
    Job.objects.filter(pk=jobs["cancelled"].pk).update(submitted_at=timezone.now() - timedelta(days=10))
    week_ago = (timezone.now() - timedelta(days=7)).isoformat()
    client = api(alice)
    recent = ids(client.get(JOBS, {"submittedAfter": week_ago}))
    older = ids(client.get(JOBS, {"submittedBefore": week_ago.replace("+00:00", "Z")}))
    assert older == [jobs["cancelled"].pk]
    assert set(recent) == {j.pk for k, j in jobs.items() if k != "cancelled"}


@pytest.mark.parametrize(
    "params, path",
    [
        ({"state": "BOGUS"}, "query.state"),
        ({"state": "PD,NOPE"}, "query.state"),
        ({"state": "PD,"}, "query.state"),
        ({"submittedAfter": "yesterday"}, "query.submittedAfter"),
        ({"submittedAfter": "2026-01-01T00:00:00"}, "query.submittedAfter"),
        ({"submittedBefore": "2026-13-01T00:00:00Z"}, "query.submittedBefore"),
        ({"submittedBefore": "2026-01-01T00:00:00+99:00"}, "query.submittedBefore"),
    ],
    ids=["unknown-state", "one-unknown", "trailing-comma", "words", "no-zone", "month-13", "bad-offset"],
)
def test_bad_filter_values_are_a_400(api, alice, queue, params, path):
    response = api(alice).get(JOBS, params)
    assert response.status_code == 400
    assert error_paths(response) == [path]


def test_all_bad_filters_are_reported_at_once(api, alice):
    response = api(alice).get(JOBS, {"state": "X", "submittedAfter": "x", "submittedBefore": "y"})
    assert response.status_code == 400
    assert error_paths(response) == ["query.state", "query.submittedAfter", "query.submittedBefore"]


@pytest.mark.parametrize("key", ["project", "queue", "user", "name", "cluster"])
def test_nul_bytes_in_filters_are_never_a_500(api, alice, queue, key):
    response = api(alice).get(JOBS, {key: "vis\x00ion"})
    assert response.status_code in (200, 400), response.content[:200]
    if response.status_code == 200:
        assert response.json()["results"] == []


# --- pagination -----------------------------------------------------------------------------


def test_cursor_pagination_walks_every_job_once(api, alice, queue):
    made = [make_job(alice, queue).pk for _ in range(5)]
    client = api(alice)
    page = client.get(JOBS, {"limit": 2}).json()
    assert page["previous"] is None
    seen, sizes = [], []
    while True:
        seen += [job["id"] for job in page["results"]]
        sizes.append(len(page["results"]))
        if page["next"] is None:
            break
        page = client.get(page["next"]).json()
        assert page["previous"] is not None
    assert sizes == [2, 2, 1]
    assert seen == sorted(made, reverse=True)

    back = client.get(page["previous"]).json()
    assert [job["id"] for job in back["results"]] == seen[2:4]


def test_page_size_is_capped(api, alice, queue):
    for _ in range(3):
        make_job(alice, queue)
    assert len(ids(api(alice).get(JOBS, {"limit": 100_000}))) == 3


@pytest.mark.parametrize(
    "cursor",
    ["garbage", base64.b64encode(b"r=x").decode(), base64.b64encode(b"p=abc").decode()],
    ids=["not-base64", "bad-reverse", "non-integer-position"],
)
def test_forged_cursors_are_a_404_not_a_500(api, alice, queue, cursor):
    make_job(alice, queue)
    response = api(alice).get(JOBS, {"cursor": cursor})
    assert response.status_code == 404, response.content[:200]
    assert response.json()["detail"]


# --- tenancy ------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["", "/events", "/logs"])
def test_another_projects_job_is_missing_not_forbidden(api, bob, nlp_queue, alice_job, suffix):
    response = api(bob).get(f"{JOBS}/{alice_job.pk}{suffix}")
    assert response.status_code == 404
    assert response.json() == {"detail": "Not found.", "errors": []}


@pytest.mark.parametrize("verb", ["cancel", "hold", "release", "requeue"])
def test_another_projects_job_cannot_be_acted_on(api, bob, nlp_queue, alice_job, verb):
    response = api(bob).post(f"{JOBS}/{alice_job.pk}/{verb}")
    assert response.status_code == 404
    assert Job.objects.get(pk=alice_job.pk).state == JobState.PENDING


def test_a_missing_job_and_a_hidden_job_look_the_same(api, bob, nlp_queue, alice_job):
    client = api(bob)
    hidden = client.get(f"{JOBS}/{alice_job.pk}")
    missing = client.get(f"{JOBS}/{alice_job.pk + 10_000}")
    assert (hidden.status_code, hidden.json()) == (missing.status_code, missing.json())


@pytest.mark.parametrize(
    "params",
    [{}, {"project": "vision"}, {"user": "alice"}, {"name": "alice"}, {"state": "PD"}],
    ids=["plain", "project", "user", "name", "state"],
)
def test_list_never_shows_another_projects_jobs(api, bob, alice_job, bob_job, params):
    shown = ids(api(bob).get(JOBS, params))
    assert alice_job.pk not in shown
    if not params or params == {"state": "PD"}:
        assert shown == [bob_job.pk]


def test_operators_see_every_job(api, operator, alice_job, bob_job):
    client = api(operator)
    assert set(ids(client.get(JOBS))) == {alice_job.pk, bob_job.pk}
    assert client.get(f"{JOBS}/{alice_job.pk}").status_code == 200
    assert client.get(f"{JOBS}/{bob_job.pk}/events").status_code == 200


def test_a_member_of_both_projects_sees_both(api, alice, bob, alice_job, bob_job, nlp):
    nlp.memberships.create(user=alice)
    assert set(ids(api(alice).get(JOBS))) == {alice_job.pk, bob_job.pk}


@pytest.mark.parametrize(
    "method, path",
    [
        ("get", JOBS),
        ("post", JOBS),
        ("post", f"{JOBS}/batch"),
        ("get", f"{JOBS}/1"),
        ("get", f"{JOBS}/1/events"),
        ("get", f"{JOBS}/1/logs"),
        ("post", f"{JOBS}/1/cancel"),
        ("get", "/api/v1/projects"),
        ("get", "/api/v1/queues"),
        ("get", "/api/v1/clusters"),
        ("get", "/api/v1/nodes"),
        ("get", "/api/v1/gpu-models"),
        ("get", "/api/v1/me"),
        ("get", "/api/v1/tokens"),
        ("post", "/api/v1/tokens"),
        ("delete", "/api/v1/tokens/1"),
    ],
)
@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer orr_not-a-token", "Bearer", "Bearer a b", "Token abc", "Bearer \u00e9t\u00e9"],
    ids=["none", "unknown-token", "no-token", "two-words", "other-scheme", "non-ascii"],
)
def test_unauthenticated_requests_are_a_401(api, alice_job, method, path, authorization):
    client = api()
    if authorization:
        client.credentials(HTTP_AUTHORIZATION=authorization)
    response = getattr(client, method)(path)
    assert response.status_code == 401, response.content
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert error_paths(response) == []
    assert Job.objects.get().state == JobState.PENDING


def test_session_login_works_and_writes_need_csrf(alice, queue):
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(alice)
    me = client.get("/api/v1/me")
    assert (me.status_code, me.json()["authenticatedWith"]) == (200, "session")
    refused = client.post(JOBS, {}, format="json")
    assert refused.status_code == 403
    assert "CSRF" in refused.json()["detail"]


@pytest.mark.parametrize("pk", ["0", "99999999999999999999999999"])
def test_out_of_range_ids_are_a_404(api, alice, queue, pk):
    assert api(alice).get(f"{JOBS}/{pk}").status_code == 404
    assert api(alice).post(f"{JOBS}/{pk}/cancel").status_code == 404


@pytest.mark.parametrize(
    "path, queries",
    [("", 4), ("/{job}", 5), ("/{job}/events", 3)],  # detail: + its dependencies, one query
    ids=["list", "detail", "events"],
)
def test_job_reads_take_a_fixed_number_of_queries(
    api, alice, queue, fleet, path, queries, django_assert_num_queries
):
    """Query-count baselines: placement is prefetched, not read per job (token lookup included)."""
    job = make_job(alice, queue, gpus=2, nodes=2)
    bind_job(job, [NodePlacement(n, [0, 1]) for n in fleet.h100[:2]])
    for index in range(3):
        bind_job(make_job(alice, queue, model="a100"), [NodePlacement(fleet.a100, [index])])
    client, url = api(alice), f"{JOBS}{path.format(job=job.pk)}"
    assert client.get(url).status_code == 200
    cache.clear()
    with django_assert_num_queries(queries):
        assert client.get(url).status_code == 200
