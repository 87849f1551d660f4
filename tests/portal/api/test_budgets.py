"""GPU-hour budgets through the API: the 409 of a refused submission, the hold reason, the time
limit a budget requires, and ``GET /api/v1/budgets`` (who sees which)."""

from __future__ import annotations

import json

import pytest

from portal.choices import Role
from portal.models import Membership
from scheduling.choices import JobState
from scheduling.models import Job
from tests.factories import make_budget, make_job, make_queue, make_user
from tests.portal.api.conftest import DELETE, error_paths, job_spec

pytestmark = pytest.mark.usefixtures("fleet", "queue")
H = 3600


def post(client, document, path="/api/v1/jobs"):
    return client.post(path, json.dumps(document), content_type="application/json")


def test_a_refused_submission_is_a_409_naming_the_budget(api, alice, vision):
    make_budget(vision, 1000, used_gpu_seconds=int(987.5 * H))
    response = post(api(alice), job_spec(spec__timeLimit="8h"))  # 8 h100 × 8 h = 64 GPU-hours
    assert response.status_code == 409, response.content
    body = response.json()
    assert body["code"] == "budget_exhausted" and body["errors"] == []
    assert "vision has 12.5 of 1000 GPU-hours left this period" in body["detail"]
    assert body["detail"].endswith("this job asks 64.")
    assert not Job.objects.exists()


def test_a_held_submission_says_why(api, alice, vision):
    make_budget(vision, 10, on_overrun="hold")
    response = post(api(alice), job_spec(spec__timeLimit="8h"))
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["state"], body["reason"]) == (JobState.HELD, "BudgetExhausted")
    assert "this job asks 64" in body["reasonMessage"]


@pytest.mark.parametrize("path", ["/api/v1/jobs", "/api/v1/jobs/batch"], ids=["single", "batch"])
def test_a_gpu_job_without_a_time_limit_is_a_400_on_the_field(api, alice, vision, path):
    make_budget(vision, 100)
    document = job_spec(spec__timeLimit=DELETE)
    response = post(api(alice), {"jobs": [job_spec(), document]} if "batch" in path else document, path)
    assert response.status_code == 400, response.content
    expected = "jobs[1].spec.timeLimit" if "batch" in path else "spec.timeLimit"
    assert error_paths(response) == [expected]
    assert (
        response.json()["errors"][0]["message"] == "project vision has a GPU-hour budget; give a time limit"
    )


def test_the_queue_time_limit_stands_in_for_a_missing_one(api, alice, vision, queue):
    queue.max_time_limit_s = 2 * H
    queue.save()
    make_budget(vision, 100)
    response = post(api(alice), job_spec(spec__timeLimit=DELETE))
    assert response.status_code == 201, response.content
    assert vision.budgets.get().reserved_gpu_seconds == 16 * H


# --- GET /api/v1/budgets ------------------------------------------------------------------------


@pytest.fixture
def budgets(vision, queue, nlp, alice):
    make_job(alice, queue, state=JobState.HELD, reason="BudgetExhausted")
    return {
        "vision": make_budget(vision, 100, used_gpu_seconds=30 * H, reserved_gpu_seconds=20 * H),
        "vision/default": make_budget(vision, 40, queue=queue, on_overrun="hold"),
        "vision-old": make_budget(vision, 5, days=(-60, -30)),
        "nlp": make_budget(nlp, 7),
    }


def listing(client, **params):
    response = client.get("/api/v1/budgets", params)
    assert response.status_code == 200, response.content
    return response.json()["results"]


def test_a_member_sees_their_projects_budgets_and_where_they_stand(api, alice, budgets):
    rows = listing(api(alice))
    assert [(r["project"], r["queue"]) for r in rows] == [("vision", None), ("vision", "default")]
    whole = rows[0]
    assert {k: whole[k] for k in ("gpuHours", "usedGpuHours", "reservedGpuHours", "leftGpuHours")} == {
        "gpuHours": 100,
        "usedGpuHours": 30.0,
        "reservedGpuHours": 20.0,
        "leftGpuHours": 50.0,
    }
    assert (whole["percentUsed"], whole["period"], whole["onOverrun"], whole["heldJobs"]) == (
        50.0,
        "current",
        "refuse",
        1,
    )
    assert whole["endsAt"] > whole["startsAt"]


@pytest.mark.parametrize(
    "who, params, expected",
    [
        ("alice", {"all": "true"}, ["vision", "vision/default", "vision-old"]),
        ("alice", {"project": "nlp"}, []),  # not hers: as if it did not exist
        ("bob", {}, ["nlp"]),
        ("stranger", {}, []),
        ("manager", {}, ["vision", "vision/default"]),
        ("operator", {}, ["vision", "vision/default", "nlp"]),
        ("operator", {"project": "nlp"}, ["nlp"]),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_nobody_sees_another_projects_budgets(
    api, alice, bob, operator, vision, budgets, who, params, expected
):
    users = {"alice": alice, "bob": bob, "operator": operator, "stranger": make_user("stranger")}
    if who == "manager":
        users["manager"] = make_user("mgr")
        Membership.objects.create(user=users["manager"], project=vision, role=Role.MANAGER)
    ids = {b.pk: name for name, b in budgets.items()}
    rows = listing(api(users[who]), **params)
    assert sorted(ids[r["id"]] for r in rows) == sorted(expected)


def test_a_bad_flag_is_a_400_on_the_query(api, alice, budgets):
    response = api(alice).get("/api/v1/budgets", {"all": "maybe"})
    assert response.status_code == 400 and error_paths(response) == ["query.all"]


def test_a_queue_budget_counts_only_its_queue_held_jobs(api, alice, vision, budgets):
    other = make_queue(vision, "other")
    make_job(alice, other, state=JobState.HELD, reason="BudgetExhausted")
    held = {(r["project"], r["queue"]): r["heldJobs"] for r in listing(api(alice))}
    assert held == {("vision", None): 2, ("vision", "default"): 1}
