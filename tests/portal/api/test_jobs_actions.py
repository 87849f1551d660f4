"""POST /api/v1/jobs/{id}/cancel|hold|release|requeue: round trips, refusals, who may act."""

from __future__ import annotations

import pytest

from portal.choices import Role
from scheduling.choices import JobState
from scheduling.models import Allocation, Job, JobEvent
from scheduling.services.allocations import NodePlacement, bind_job
from scheduling.services.transitions import transition_job
from tests.factories import make_job, make_user
from tests.portal.api.conftest import error_paths

JOBS = "/api/v1/jobs"


def act(client, job, verb):
    return client.post(f"{JOBS}/{job.pk}/{verb}")


def running_job(owner, queue, node) -> Job:
    job = make_job(owner, queue, gpus=8)
    bind_job(job, [NodePlacement(node, range(8))])
    return transition_job(job.pk, JobState.RUNNING)


def test_cancel_a_pending_job(api, alice, alice_job):
    response = act(api(alice), alice_job, "cancel")
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["state"], body["stateCode"], body["reason"]) == ("CANCELLED", "CA", None)
    assert body["finishedAt"] is not None and "spec" in body
    assert Job.objects.get(pk=alice_job.pk).state == JobState.CANCELLED


def test_hold_then_release(api, alice, alice_job):
    client = api(alice)
    held = act(client, alice_job, "hold").json()
    assert (held["state"], held["reason"]) == ("HELD", "Held")
    released = act(client, alice_job, "release").json()
    assert (released["state"], released["reason"]) == ("PENDING", "None")


def test_hold_a_scheduled_job_gives_its_placement_back(api, alice, queue, fleet):
    job = make_job(alice, queue, gpus=8)
    bind_job(job, [NodePlacement(fleet.h100[0], range(8))])
    assert Job.objects.get(pk=job.pk).state == JobState.SCHEDULED
    body = act(api(alice), job, "hold").json()
    assert (body["state"], body["reason"], body["placement"]["active"]) == ("HELD", "Held", False)
    assert not Allocation.objects.filter(job=job, active=True).exists()


def test_requeue_a_running_job_frees_its_gpus(api, alice, queue, fleet):
    job = running_job(alice, queue, fleet.h100[0])
    response = act(api(alice), job, "requeue")
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["state"], body["reason"]) == ("PENDING", "Requeued")
    assert body["placement"]["active"] is False
    assert not Allocation.objects.filter(job=job, active=True).exists()


def test_cancel_a_running_job_frees_its_gpus(api, alice, queue, fleet):
    job = running_job(alice, queue, fleet.h100[0])
    assert act(api(alice), job, "cancel").json()["state"] == "CANCELLED"
    assert not Allocation.objects.filter(job=job, active=True).exists()


@pytest.mark.parametrize(
    "state, verb",
    [
        (JobState.HELD, "hold"),
        (JobState.PENDING, "release"),
        (JobState.PENDING, "requeue"),
        (JobState.HELD, "requeue"),
        (JobState.RUNNING, "hold"),
        (JobState.RUNNING, "release"),
        (JobState.CANCELLED, "cancel"),
        (JobState.SUCCEEDED, "cancel"),
        (JobState.FAILED, "requeue"),
        (JobState.TIMEOUT, "release"),
        (JobState.CANCELLED, "hold"),
    ],
    ids=lambda v: v if isinstance(v, str) and v.islower() else str(v),
)
def test_transitions_the_state_does_not_allow_are_a_409(api, alice, queue, state, verb):
    job = make_job(alice, queue, state=state)
    response = act(api(alice), job, verb)
    assert response.status_code == 409, response.content
    assert error_paths(response) == []
    assert state in response.json()["detail"]
    assert Job.objects.get(pk=job.pk).state == state
    assert not JobEvent.objects.filter(job=job).exists()


def test_events_record_the_actor(api, alice, alice_job, vision):
    manager = make_user("mgr")
    vision.memberships.create(user=manager, role=Role.MANAGER)
    act(api(alice), alice_job, "hold")
    act(api(manager), alice_job, "release")
    events = api(alice).get(f"{JOBS}/{alice_job.pk}/events").json()
    assert [(e["kind"], e["fromState"], e["toState"], e["actor"]) for e in events] == [
        ("transition", "PENDING", "HELD", "alice"),
        ("transition", "HELD", "PENDING", "mgr"),
    ]
    assert "alice" in events[0]["message"] and "mgr" in events[1]["message"]


@pytest.mark.parametrize("verb", ["cancel", "hold"])
def test_a_plain_member_who_is_not_the_owner_gets_a_403(api, vision, alice_job, verb):
    colleague = make_user("colleague")
    vision.memberships.create(user=colleague, role=Role.MEMBER)
    client = api(colleague)
    assert client.get(f"{JOBS}/{alice_job.pk}").status_code == 200  # may see it...
    response = act(client, alice_job, verb)  # ...but not touch it
    assert response.status_code == 403
    assert error_paths(response) == []
    assert Job.objects.get(pk=alice_job.pk).state == JobState.PENDING
    assert not JobEvent.objects.filter(job=alice_job).exists()


def test_a_manager_of_another_project_gets_a_404(api, alice_job, nlp):
    nlp_manager = make_user("nlp-mgr")
    nlp.memberships.create(user=nlp_manager, role=Role.MANAGER)
    assert act(api(nlp_manager), alice_job, "cancel").status_code == 404
    assert Job.objects.get(pk=alice_job.pk).state == JobState.PENDING


@pytest.mark.parametrize("who", ["manager", "operator"])
def test_managers_and_operators_may_act_on_any_job_they_see(api, vision, alice_job, operator, who):
    if who == "manager":
        actor = make_user("mgr")
        vision.memberships.create(user=actor, role=Role.MANAGER)
    else:
        actor = operator
    response = act(api(actor), alice_job, "cancel")
    assert response.status_code == 200
    event = JobEvent.objects.get(job=alice_job)
    assert event.actor == actor


@pytest.mark.parametrize("verb", ["cancel", "hold", "release", "requeue"])
def test_actions_only_accept_post(api, alice, alice_job, verb):
    client = api(alice)
    assert client.get(f"{JOBS}/{alice_job.pk}/{verb}").status_code == 405
    assert client.delete(f"{JOBS}/{alice_job.pk}/{verb}").status_code == 405


def test_unknown_verb_is_a_404(api, alice, alice_job):
    assert api(alice).post(f"{JOBS}/{alice_job.pk}/explode").status_code == 404


def test_an_action_ignores_any_body(api, alice, alice_job):
    response = api(alice).post(
        f"{JOBS}/{alice_job.pk}/cancel", {"state": "RUNNING", "owner": "bob"}, format="json"
    )
    assert response.json()["state"] == "CANCELLED"
    job = Job.objects.get(pk=alice_job.pk)
    assert (job.state, job.owner.username) == (JobState.CANCELLED, "alice")
