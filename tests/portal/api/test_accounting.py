"""The accounting API: the history of finished jobs (sacct) and usage reports (sreport), with
their filters, who sees what, keyset pages, CSV, and a 400 naming each bad parameter."""

from __future__ import annotations

import csv
import gc
import io
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from portal.choices import Role
from portal.models import Membership
from scheduling.choices import AttemptState, JobState
from scheduling.models import JobAttempt
from scheduling.services.accounting import record_ends
from tests.factories import make_cluster, make_job, make_project, make_queue, make_user
from tests.portal.api.conftest import error_paths

pytestmark = pytest.mark.django_db
NOW = timezone.now().replace(microsecond=0)
EARLIER = (NOW - timedelta(days=60)).date().isoformat()


WATTS_PER_GPU, PRICE_PER_KWH, CO2_G_PER_KWH = 500, 0.2, 300


def finish(owner, queue, cluster, *, hours_ago: float, ran_h: float = 1, gpus: int = 1, **fields):
    """A job that ran ``ran_h`` hours on ``cluster`` and ended ``hours_ago`` hours ago, charged
    as the state machine would charge it; its GPUs drew 500 W each, at 0.2 per kWh and 300 g of
    CO₂ per kWh."""
    kwh = WATTS_PER_GPU * gpus * ran_h / 1000
    state = fields.pop("state", JobState.SUCCEEDED)
    ended = NOW - timedelta(hours=hours_ago)
    started = ended - timedelta(hours=ran_h)
    job = make_job(
        owner, queue, gpus=gpus, state=state, started_at=started, finished_at=ended, attempt_count=1, **fields
    )
    JobAttempt.objects.create(
        job=job, number=1, cluster=cluster, state=AttemptState.SUCCEEDED, active=False,
        started_at=started, finished_at=ended,
        energy_wh=kwh * 1000, energy_cost=kwh * PRICE_PER_KWH, co2_g=kwh * CO2_G_PER_KWH,
    )  # fmt: skip
    record_ends([job.pk], ended)
    return job


@pytest.fixture
def world(alice, bob, queue, vision):
    """vision (alice, bob, manager carol) and nlp (dave); jobs on sim-a and sim-b."""
    carol, dave = make_user("carol"), make_user("dave")
    Membership.objects.create(user=bob, project=vision)
    Membership.objects.create(user=carol, project=vision, role=Role.MANAGER)
    nlp = make_queue(make_project("nlp", members=(dave,)))
    a, b = make_cluster("sim-a"), make_cluster("sim-b")
    jobs = {
        "a1": finish(alice, queue, a, hours_ago=1, gpus=2, name="train-1", exit_code=0),
        "a2": finish(alice, queue, b, hours_ago=30, state=JobState.FAILED, name="train-2", exit_code=3),
        "a3": finish(alice, queue, a, hours_ago=24 * 40, name="old"),
        "b1": finish(bob, queue, a, hours_ago=2, gpus=4, model="a100", name="eval"),
        "d1": finish(dave, nlp, b, hours_ago=3, gpus=8, name="train-nlp"),
    }
    make_job(alice, queue, state=JobState.RUNNING, name="running")
    return jobs | {"carol": carol, "dave": dave}


def ids(response) -> list[str]:
    assert response.status_code == 200, response.content
    return [row["id"] for row in response.json()["results"]]


def refs(world, *names: str) -> list[str]:
    return [str(world[n].pk) for n in names]


@pytest.mark.parametrize(
    ("who", "query", "expected"),
    [
        ("alice", {}, ["a1", "a2"]),
        ("alice", {"user": "all"}, ["a1", "b1", "a2"]),
        ("alice", {"user": "bob"}, ["b1"]),
        ("alice", {"user": "dave"}, []),
        ("alice", {"user": "all", "project": "nlp"}, []),
        ("carol", {"user": "all"}, ["a1", "b1", "a2"]),
        ("dave", {"user": "all"}, ["d1"]),
        (None, {"user": "all"}, ["a1", "b1", "d1", "a2"]),
        ("alice", {"state": "F"}, ["a2"]),
        ("alice", {"state": "SUCCEEDED,failed"}, ["a1", "a2"]),
        ("alice", {"since": "2000-01-01"}, ["a1", "a2", "a3"]),
        ("alice", {"since": "2000-01-01", "until": (NOW - timedelta(hours=29)).isoformat()}, ["a2", "a3"]),
        (None, {"user": "all", "cluster": "sim-b"}, ["d1", "a2"]),
        (None, {"user": "all", "gpuModel": "a100-80g,a100-40g"}, ["b1"]),
        (None, {"user": "all", "name": "train"}, ["a1", "d1", "a2"]),
        (None, {"user": "alice,dave", "queue": "default", "project": "nlp"}, ["d1"]),
    ],
    ids=[
        "own-by-default", "project-mates", "one-mate", "other-project-user", "other-project",
        "manager", "other-member", "operator", "state-code", "states", "since", "window",
        "cluster", "gpu-model", "name-prefix", "combined",
    ],
)  # fmt: skip
def test_history_filters_and_visibility(api, alice, world, who, query, expected):
    user = {"alice": alice, "carol": world["carol"], "dave": world["dave"]}.get(who) or make_user(
        "ops", staff=True
    )
    assert ids(api(user).get("/api/v1/accounting/jobs", query)) == refs(world, *expected)


def test_a_history_row_has_the_columns_sacct_users_expect(api, alice, world):
    row = api(alice).get("/api/v1/accounting/jobs").json()["results"][0]
    assert row == {
        "id": str(world["a1"].pk),
        "name": "train-1",
        "user": "alice",
        "project": "vision",
        "queue": "default",
        "state": "SUCCEEDED",
        "submitted": row["submitted"],
        "started": (NOW - timedelta(hours=2)).isoformat().replace("+00:00", "Z"),
        "ended": (NOW - timedelta(hours=1)).isoformat().replace("+00:00", "Z"),
        "elapsed": 3600,
        "nodes": 1,
        "gpus": 2,
        "gpuModel": world["a1"].gpu_model.slug,
        "gpuHours": 2.0,
        "exitCode": 0,
        "cluster": "sim-a",
        "attempts": 1,
    }


def test_pages_walk_every_row_once_in_order_even_with_equal_end_times(api, alice, queue):
    cluster = make_cluster("sim-a")
    jobs = [finish(alice, queue, cluster, hours_ago=1 + i // 3) for i in range(7)]  # ties of three
    client, seen, url = api(alice), [], "/api/v1/accounting/jobs?limit=2"
    while url:
        page = client.get(url).json()
        assert len(page["results"]) <= 2
        seen += [r["id"] for r in page["results"]]
        url = page["next"]
    expected = sorted(jobs, key=lambda j: (j.finished_at, j.pk), reverse=True)
    assert seen == [str(j.pk) for j in expected]


def test_history_as_csv(api, alice, queue):
    cluster = make_cluster("sim-a")
    for i in range(3):
        finish(alice, queue, cluster, hours_ago=i + 1, name="=HYPERLINK(1)" if i == 0 else f"j{i}")
    answer = api(alice).get("/api/v1/accounting/jobs?format=csv&limit=2")
    assert answer.status_code == 200 and answer["Content-Type"].startswith("text/csv")
    assert 'rel="next"' in answer["Link"]
    rows = list(csv.DictReader(io.StringIO(answer.content.decode())))
    assert list(rows[0]) == ["id", "name", "user", "project", "queue", "state", "submitted", "started",
                             "ended", "elapsed", "nodes", "gpus", "gpuModel", "gpuHours", "exitCode",
                             "cluster", "attempts"]  # fmt: skip
    assert [r["name"] for r in rows] == ["'=HYPERLINK(1)", "j1"]
    assert rows[0]["gpuHours"] == "1.0" and rows[0]["exitCode"] == ""
    by_accept = api(alice).get("/api/v1/accounting/jobs", HTTP_ACCEPT="text/csv")
    assert by_accept.content.decode().startswith("id,name,user")


@pytest.mark.parametrize(
    ("path", "query", "paths"),
    [
        ("jobs", {"since": "yesterday"}, ["query.since"]),
        ("jobs", {"until": "2026-13-45"}, ["query.until"]),
        ("jobs", {"since": "2026-11-02", "until": "2026-11-01"}, ["query.until"]),
        ("jobs", {"state": "RUNNING,XX"}, ["query.state", "query.state"]),
        ("jobs", {"limit": "0"}, ["query.limit"]),
        ("jobs", {"limit": "١٢"}, ["query.limit"]),
        ("jobs", {"cursor": "bm90IGEgY3Vyc29y"}, ["query.cursor"]),
        ("jobs", {"cursor": "WyJ4IiwgMV0"}, ["query.cursor"]),
        ("jobs", {"format": "xml"}, ["query.format"]),
        ("jobs", {"since": "9999-12-31T23:59:59Z"}, ["query.since"]),
        ("usage", {"by": "project,colour"}, ["query.by"]),
        ("usage", {"since": "2020-01-01", "until": "2026-01-01"}, ["query.since"]),
        ("usage", {"since": "2026-11-30", "until": "2026-11-29"}, ["query.until"]),
        ("usage", {"until": "0001-01-01"}, ["query.until"]),
        ("usage", {"format": "csv", "by": "nope"}, ["query.by"]),
    ],
    ids=[
        "word-date", "no-such-month", "until-before-since", "not-end-states", "limit-zero",
        "non-ascii-digits", "junk-cursor", "cursor-not-a-time", "unknown-format", "end-of-time",
        "unknown-group", "window-too-large", "usage-until-first", "start-of-time", "csv-error-is-json",
    ],
)  # fmt: skip
def test_bad_parameters_are_a_400_naming_them(api, alice, path, query, paths):
    answer = api(alice).get(f"/api/v1/accounting/{path}", query)
    assert answer.status_code == 400, answer.content
    assert answer["Content-Type"] == "application/json"
    assert error_paths(answer) == paths


def usage(client, **query) -> list[tuple]:
    answer = client.get("/api/v1/accounting/usage", query)
    assert answer.status_code == 200, answer.content
    body = answer.json()
    return [(*(r[k] for k in body["by"]), r["jobs"], r["gpuHours"]) for r in body["results"]]


def test_members_see_their_projects_totals_and_only_their_own_figures_per_user(api, alice, world):
    client = api(alice)
    assert usage(client) == [("vision", 3, 7.0)]  # a3 ended 40 days ago: outside the default 30
    assert usage(client, since=EARLIER) == [("vision", 4, 8.0)]
    assert usage(client, by="user") == [("alice", 2, 3.0)]
    assert usage(client, user="bob") == []


def test_managers_see_their_projects_per_user_and_operators_everything(api, world):
    assert usage(api(world["carol"]), by="project,user") == [
        ("vision", "alice", 2, 3.0),
        ("vision", "bob", 1, 4.0),
    ]
    ops = api(make_user("ops", staff=True))
    assert usage(ops, by="project") == [("nlp", 1, 8.0), ("vision", 3, 7.0)]
    assert usage(ops, by="cluster,state") == [
        ("sim-a", "SUCCEEDED", 2, 6.0),
        ("sim-b", "FAILED", 1, 1.0),
        ("sim-b", "SUCCEEDED", 1, 8.0),
    ]
    assert usage(ops, by="gpu-model", cluster="sim-a") == sorted(
        [(world["a1"].gpu_model.slug, 1, 2.0), (world["b1"].gpu_model.slug, 1, 4.0)]
    )


def test_usage_by_period_queue_and_as_csv(api, world):
    ops = api(make_user("ops", staff=True))
    day = lambda job: job.finished_at.astimezone(UTC).date()  # noqa: E731
    by_day = usage(ops, by="day", project="vision")
    assert sum(r[1] for r in by_day) == 3 and {r[0] for r in by_day} == {
        day(world[j]).isoformat() for j in ("a1", "a2", "b1")
    }
    assert [r[0] for r in usage(ops, by="month", since=EARLIER)] == sorted(
        {day(world[j]).replace(day=1).isoformat() for j in ("a1", "a2", "a3", "b1", "d1")}
    )
    assert usage(ops, by="queue") == [("nlp", "default", 1, 8.0), ("vision", "default", 3, 7.0)]
    answer = ops.get("/api/v1/accounting/usage?by=project&format=csv")
    assert answer["Content-Type"].startswith("text/csv")
    assert answer.content.decode().splitlines() == [
        "project,jobs,gpuHours,gpuSeconds,elapsedSeconds,energyKwh,energyCost,co2Kg",
        "nlp,1,8.0,28800,3600,4.0,0.8,1.2",
        "vision,3,7.0,25200,10800,3.5,0.7,1.05",
    ]


def test_usage_sums_energy_its_cost_and_co2_per_group(api, world):
    ops = api(make_user("ops", staff=True))
    body = ops.get("/api/v1/accounting/usage", {"by": "project,user"}).json()
    measures = lambda r: (r["energyKwh"], r["energyCost"], r["co2Kg"])  # noqa: E731
    energy = {(r["project"], r["user"]): measures(r) for r in body["results"]}
    # a1: 2 GPUs, a2: 1 GPU (alice); b1: 4 GPUs (bob); d1: 8 GPUs (dave); an hour each at 500 W
    assert energy == {
        ("vision", "alice"): (1.5, 0.3, 0.45),
        ("vision", "bob"): (2.0, 0.4, 0.6),
        ("nlp", "dave"): (4.0, 0.8, 1.2),
    }
    assert measures(body["total"]) == (7.5, 1.5, 2.25)


def test_the_report_says_its_period_and_total(api, alice, world):
    body = api(alice).get("/api/v1/accounting/usage?since=2026-01-01T06:00:00Z&until=2026-02-01").json()
    assert (body["since"], body["until"], body["by"]) == ("2026-01-01", "2026-02-01", ["project"])
    assert body["total"] == {
        "jobs": 0, "gpuSeconds": 0, "elapsedSeconds": 0, "gpuHours": 0.0, "energyKwh": 0, "energyCost": 0,
        "co2Kg": 0,
    }  # fmt: skip
    now = datetime.now(UTC).date()
    body = api(alice).get("/api/v1/accounting/usage").json()
    assert body["until"] == (now + timedelta(days=1)).isoformat() and body["total"]["jobs"] == 3


@pytest.mark.parametrize("path", ["/api/v1/accounting/usage?by=project,user", "/api/v1/accounting/jobs"])
def test_a_request_builds_its_rows_with_the_cyclic_collector_paused_and_resumes_it(
    api, world, monkeypatch, path
):
    """A thousand-row answer is tens of thousands of short-lived objects: collections of the
    whole heap while they live were the slow tail of these endpoints."""
    import portal.api.accounting as endpoints

    seen = []
    for name in ("usage_report", "job_history"):
        real = getattr(endpoints, name)
        monkeypatch.setattr(
            endpoints, name, lambda *a, real=real, **k: seen.append(gc.isenabled()) or real(*a, **k)
        )
    assert api(make_user("ops", staff=True)).get(path).status_code == 200
    assert seen == [False] and gc.isenabled()
