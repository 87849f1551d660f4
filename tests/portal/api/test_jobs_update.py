"""PATCH /api/v1/jobs/{ref}: change a waiting job as ``scontrol update`` does."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest

from foundation.models import AuditEntry
from portal.choices import Role
from portal.models import Membership
from scheduling.choices import EventKind, JobState, PendingReason
from scheduling.models import Job, JobEvent
from tests.factories import make_job, make_queue, make_user
from tests.portal.api.conftest import error_paths, job_spec

pytestmark = pytest.mark.usefixtures("fleet")

JOBS = "/api/v1/jobs"


@pytest.fixture
def queue(vision):
    return make_queue(vision, max_time_limit_s=4 * 3600, max_member_priority=50)


@pytest.fixture
def job(alice, queue):
    return make_job(alice, queue, name="train", time_limit_s=7200, priority=0)


def patch(client, ref, body):
    path = f"{JOBS}/{quote(str(ref), safe='')}"
    return client.patch(path, json.dumps(body), content_type="application/json")


def updates(job):
    return list(JobEvent.objects.filter(job=job, kind=EventKind.UPDATED).values_list("message", flat=True))


@pytest.mark.parametrize(
    "body, column, value, message",
    [
        ({"timeLimit": "1h"}, "time_limit_s", 3600, "time limit 2:00:00 → 1:00:00"),
        ({"timeLimit": 90}, "time_limit_s", 5400, "time limit 2:00:00 → 1:30:00"),
        ({"priority": 10}, "priority", 10, "priority 0 → 10"),
        ({"priority": "low"}, "priority", -100, "priority 0 → -100"),
        ({"name": "renamed"}, "name", "renamed", "name train → renamed"),
    ],
    ids=["time-down", "time-minutes", "priority", "priority-name", "name"],
)
def test_an_owner_changes_a_waiting_job(api, alice, job, body, column, value, message):
    response = patch(api(alice), job.pk, body)
    assert response.status_code == 200, response.content
    job.refresh_from_db()
    assert getattr(job, column) == value and job.version == 1
    assert updates(job) == [message]
    assert response.json()["version"] == 1
    entry = AuditEntry.objects.get(action="job.update")
    assert entry.target == f"job:{job.pk}" and entry.actor_name == "alice"


@pytest.mark.parametrize(
    "body, path, words",
    [
        ({"timeLimit": "3h"}, "timeLimit", "may only be lowered"),
        ({"timeLimit": "5h"}, "timeLimit", "at most 4:00:00"),
        ({"priority": 51}, "priority", "at most 50"),
        ({"priority": 5000}, "priority", "between"),
        ({"timeLimit": "soon"}, "timeLimit", "not a duration"),
        ({"timeLimit": 0}, "timeLimit", "more than 0"),
        ({"name": "bad name"}, "name", "letters"),
        ({"name": 7}, "name", "job name"),
        ({"hold": "yes"}, "hold", "true"),
        ({"throttle": 2}, "throttle", "not a member of an array"),
        ({"throttle": -1}, "throttle", "between"),
        ({"colour": "red"}, "colour", "unknown field"),
        ({}, "(body)", "at least one"),
        ([1], "(body)", "at least one"),
        ({"version": "x"}, "version", "version"),
    ],
    ids=[
        "raise-time",
        "above-queue-max",
        "priority-above-member-max",
        "priority-out-of-range",
        "bad-duration",
        "zero-time",
        "bad-name",
        "name-number",
        "hold-string",
        "throttle-plain-job",
        "negative-throttle",
        "unknown-field",
        "empty",
        "list",
        "bad-version",
    ],
)
def test_bad_values_are_a_400_at_their_field(api, alice, job, body, path, words):
    response = patch(api(alice), job.pk, body)
    assert response.status_code == 400, response.content
    assert error_paths(response) == [path]
    assert words in response.json()["errors"][0]["message"]
    job.refresh_from_db()
    assert (job.time_limit_s, job.priority, job.name, job.version) == (7200, 0, "train", 0)
    assert not updates(job)


@pytest.mark.parametrize("role", ["manager", "operator"])
def test_managers_and_operators_raise_within_the_queues_limits(api, alice, vision, operator, job, role):
    if role == "manager":
        who = make_user("carol")
        Membership.objects.create(user=who, project=vision, role=Role.MANAGER)
    else:
        who = operator
    response = patch(api(who), job.pk, {"timeLimit": "4h", "priority": 500})
    assert response.status_code == 200, response.content
    job.refresh_from_db()
    assert (job.time_limit_s, job.priority) == (4 * 3600, 500)
    assert sorted(updates(job)) == ["priority 0 → 500", "time limit 2:00:00 → 4:00:00"]
    assert patch(api(who), job.pk, {"timeLimit": "5h"}).status_code == 400


def test_hold_and_release_through_update(api, alice, job):
    held = patch(api(alice), job.pk, {"hold": True})
    assert held.json()["state"] == JobState.HELD and held.json()["reason"] == PendingReason.HELD
    assert patch(api(alice), job.pk, {"hold": False, "priority": 5}).json()["state"] == JobState.PENDING
    kinds = list(JobEvent.objects.filter(job=job).values_list("kind", "to_state"))
    assert kinds == [("transition", "HELD"), ("updated", "HELD"), ("transition", "PENDING")]


def test_an_operators_hold_is_not_released_by_the_owner(api, alice, job):
    Job.objects.filter(pk=job.pk).update(state=JobState.HELD, reason=PendingReason.HELD_BY_OPERATOR)
    response = patch(api(alice), job.pk, {"hold": False})
    assert response.status_code == 403
    assert Job.objects.get(pk=job.pk).state == JobState.HELD


@pytest.mark.parametrize("state", [JobState.RUNNING, JobState.SCHEDULED, JobState.SUCCEEDED])
def test_a_job_that_left_the_queue_is_a_409(api, alice, queue, state):
    job = make_job(alice, queue, state=state, time_limit_s=7200)
    response = patch(api(alice), job.pk, {"timeLimit": "1h"})
    assert response.status_code == 409 and state in response.json()["detail"]
    assert Job.objects.get(pk=job.pk).time_limit_s == 7200


def test_a_stale_version_is_a_409(api, alice, job):
    assert patch(api(alice), job.pk, {"priority": 1, "version": 0}).status_code == 200
    stale = patch(api(alice), job.pk, {"priority": 2, "version": 0})
    assert stale.status_code == 409 and "version 1" in stale.json()["detail"]
    assert Job.objects.get(pk=job.pk).priority == 1


def test_others_may_not_change_a_job(api, alice, bob, vision, job):
    carol = make_user("carol")
    Membership.objects.create(user=carol, project=vision, role=Role.MEMBER)
    assert patch(api(carol), job.pk, {"priority": 1}).status_code == 403
    assert patch(api(bob), job.pk, {"priority": 1}).status_code == 404  # another project: not found
    token_read_only = api(alice, scopes=("read",))
    assert patch(token_read_only, job.pk, {"priority": 1}).status_code == 403
    assert Job.objects.get(pk=job.pk).priority == 0


def test_an_array_is_updated_as_a_whole_and_its_throttle_is_shared(api, alice, queue):
    client = api(alice)
    body = {"jobs": [job_spec(metadata__name="sweep", spec__array="0-4%2", spec__timeLimit="2h")]}
    jobs = client.post(f"{JOBS}/batch", json.dumps(body), content_type="application/json").json()["jobs"]
    first = jobs[0]["id"]
    Job.objects.filter(array_id=first, array_index=0).update(state=JobState.RUNNING)

    whole = patch(client, first, {"timeLimit": "1h", "throttle": 3, "name": "sweep2"})
    assert whole.status_code == 200, whole.content
    assert (whole.json()["matched"], whole.json()["changed"], whole.json()["unchanged"]) == (5, 4, 1)
    members = {j.array_index: j for j in Job.objects.filter(array_id=first)}
    assert members[0].time_limit_s == 7200 and members[0].name == "sweep-0"  # running: left alone
    assert {members[i].time_limit_s for i in range(1, 5)} == {3600}
    assert [members[i].name for i in range(1, 5)] == ["sweep2-1", "sweep2-2", "sweep2-3", "sweep2-4"]
    assert {j.array_throttle for j in members.values()} == {3}
    assert "array throttle 2 → 3" in updates(members[3])

    ranged = patch(client, f"{first}_[3-4]", {"priority": 7})
    assert ranged.json()["changedRefs"] == [f"{first}_3", f"{first}_4"]
    assert dict(Job.objects.filter(array_id=first).values_list("array_index", "priority")) == {
        0: 0,
        1: 0,
        2: 0,
        3: 7,
        4: 7,
    }
    one = patch(client, f"{first}_2", {"throttle": 0})  # a throttle is the array's, whoever names it
    assert one.json()["arrayThrottle"] is None
    assert set(Job.objects.filter(array_id=first).values_list("array_throttle", flat=True)) == {None}
    assert patch(client, f"{first}_0", {"priority": 1}).status_code == 409
