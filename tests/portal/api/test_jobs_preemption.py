"""Preemption and predicted starts as the API shows them: POST jobs/{id}/checkpoint, a job's
``estimatedStart``, ``gpuModel``/``gpuModels`` and ``preemptible``, the reason of a preempted
job, and the queues' preemption settings."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from portal.choices import Role, Scope
from scheduling.choices import JobState, PendingReason, PreemptWithinQueue, ReclaimWithinCohort
from scheduling.models import Job, JobEvent
from scheduling.services.allocations import NodePlacement, bind_job
from scheduling.services.preemption import Victim, preempt_jobs
from scheduling.services.transitions import transition_job
from tests.factories import gpu_model, make_job, make_user
from tests.portal.api.conftest import error_paths

JOBS = "/api/v1/jobs"


def running_job(owner, queue, node, **fields) -> Job:
    job = make_job(owner, queue, gpus=8, **fields)
    bind_job(job, [NodePlacement(node, range(8))])
    return transition_job(job.pk, JobState.RUNNING)


def checkpoint(client, job):
    return client.post(f"{JOBS}/{job.pk}/checkpoint")


# --- checkpoint ---------------------------------------------------------------------------------


def test_a_running_job_records_its_checkpoint(api, alice, queue, fleet):
    job = running_job(alice, queue, fleet.h100[0])
    events = JobEvent.objects.filter(job=job).count()
    before = timezone.now()
    response = checkpoint(api(alice), job)
    assert response.status_code == 200, response.content
    stamped = Job.objects.get(pk=job.pk).checkpointed_at
    assert stamped is not None and before <= stamped <= timezone.now()
    body = response.json()
    assert parse_datetime(body["checkpointedAt"]) == stamped
    # A stamp, not a transition: the job runs on and its history is unchanged.
    assert body["state"] == "RUNNING" and JobEvent.objects.filter(job=job).count() == events


def test_a_later_checkpoint_moves_the_stamp(api, alice, queue, fleet):
    job = running_job(alice, queue, fleet.h100[0])
    old = timezone.now() - timedelta(hours=1)
    Job.objects.filter(pk=job.pk).update(checkpointed_at=old)
    assert checkpoint(api(alice), job).status_code == 200
    assert Job.objects.get(pk=job.pk).checkpointed_at > old


def test_a_draining_preempted_job_may_still_checkpoint(api, alice, queue, fleet):
    job = running_job(alice, queue, fleet.h100[0])
    assert preempt_jobs([Victim(job.pk, "preempted by job 42")]) == [job.pk]
    response = checkpoint(api(alice), job)
    assert response.status_code == 200, response.content
    assert response.json()["state"] == "PREEMPTED"
    assert Job.objects.get(pk=job.pk).checkpointed_at is not None


@pytest.mark.parametrize(
    "state", [JobState.PENDING, JobState.HELD, JobState.SUCCEEDED, JobState.CANCELLED, JobState.FAILED]
)
def test_a_job_that_is_not_placed_cannot_checkpoint(api, alice, queue, state):
    job = make_job(alice, queue, state=state)
    response = checkpoint(api(alice), job)
    assert response.status_code == 409, response.content
    assert error_paths(response) == [] and state in response.json()["detail"]
    assert Job.objects.get(pk=job.pk).checkpointed_at is None


def test_another_projects_user_gets_a_404_and_changes_nothing(api, alice, bob, nlp, queue, fleet):
    job = running_job(alice, queue, fleet.h100[0])
    nlp.memberships.filter(user=bob).update(role=Role.MANAGER)  # a manager, but of another project
    assert checkpoint(api(bob), job).status_code == 404
    assert checkpoint(api(bob), make_job(alice, queue)).status_code == 404  # whatever the state
    assert Job.objects.get(pk=job.pk).checkpointed_at is None


def test_a_member_who_is_not_the_owner_gets_a_403(api, alice, vision, queue, fleet):
    job = running_job(alice, queue, fleet.h100[0])
    colleague = make_user("colleague")
    vision.memberships.create(user=colleague, role=Role.MEMBER)
    response = checkpoint(api(colleague), job)
    assert response.status_code == 403 and error_paths(response) == []
    assert Job.objects.get(pk=job.pk).checkpointed_at is None


@pytest.mark.parametrize("who", ["manager", "operator"])
def test_managers_and_operators_may_checkpoint(api, alice, vision, queue, fleet, operator, who):
    job = running_job(alice, queue, fleet.h100[0])
    actor = operator
    if who == "manager":
        actor = make_user("mgr")
        vision.memberships.create(user=actor, role=Role.MANAGER)
    assert checkpoint(api(actor), job).status_code == 200


def test_a_read_only_token_cannot_checkpoint(api, alice, queue, fleet):
    job = running_job(alice, queue, fleet.h100[0])
    assert checkpoint(api(alice, scopes=(Scope.READ,)), job).status_code == 403
    assert Job.objects.get(pk=job.pk).checkpointed_at is None


def test_checkpoint_only_accepts_post(api, alice, queue, fleet):
    job = running_job(alice, queue, fleet.h100[0])
    assert api(alice).get(f"{JOBS}/{job.pk}/checkpoint").status_code == 405
    assert api(alice).post(f"{JOBS}/999999/checkpoint").status_code == 404


# --- how a job shows it -------------------------------------------------------------------------


def test_a_waiting_job_shows_when_and_where_it_is_expected_to_start(api, alice, queue):
    at = timezone.now() + timedelta(minutes=20)
    job = make_job(
        alice, queue, estimated_start_at=at, estimated_where="sim-b: node-3, node-4", reserved=True
    )
    body = api(alice).get(f"{JOBS}/{job.pk}").json()
    assert body["estimatedStart"]["where"] == "sim-b: node-3, node-4"
    assert body["estimatedStart"]["reserved"] is True
    assert parse_datetime(body["estimatedStart"]["at"]) == at
    listed = api(alice).get(JOBS).json()["results"][0]
    assert listed["estimatedStart"] == body["estimatedStart"]


def test_no_estimate_is_null_and_a_placed_job_shows_none(api, alice, queue, fleet):
    waiting = make_job(alice, queue)
    assert api(alice).get(f"{JOBS}/{waiting.pk}").json()["estimatedStart"] is None
    placed = running_job(alice, queue, fleet.h100[0])
    Job.objects.filter(pk=placed.pk).update(estimated_start_at=timezone.now(), estimated_where="x")
    assert api(alice).get(f"{JOBS}/{placed.pk}").json()["estimatedStart"] is None  # stale: not shown


def test_an_any_model_job_shows_its_chosen_model_once_placed(api, alice, queue, fleet):
    job = make_job(alice, queue, gpus=8)
    Job.objects.filter(pk=job.pk).update(gpu_model=None, placement={"gpuModels": ["h100-80g", "a100-80g"]})
    waiting = api(alice).get(f"{JOBS}/{job.pk}").json()
    assert (waiting["gpuModel"], waiting["gpuModels"]) == (None, ["h100-80g", "a100-80g"])
    assert waiting["resources"]["gpus"] == {"model": None, "count": 8}
    Job.objects.filter(pk=job.pk).update(gpu_model=gpu_model("h100"))  # as the scheduler records it
    bind_job(Job.objects.get(pk=job.pk), [NodePlacement(fleet.h100[0], range(8))])
    placed = api(alice).get(f"{JOBS}/{job.pk}").json()
    assert (placed["state"], placed["gpuModel"], placed["gpuModels"]) == (
        "SCHEDULED",
        "h100-80g",
        ["h100-80g", "a100-80g"],
    )


def test_preemptible_is_shown(api, alice, queue):
    job = make_job(alice, queue, preemptible=False)
    assert api(alice).get(f"{JOBS}/{job.pk}").json()["preemptible"] is False


def test_a_preempted_job_says_who_preempted_it_while_it_drains_and_once_requeued(api, alice, queue, fleet):
    job = running_job(alice, queue, fleet.h100[0])
    preempt_jobs([Victim(job.pk, "preempted by job 42 (priority 100 over 0)")])
    draining = api(alice).get(f"{JOBS}/{job.pk}").json()
    assert (draining["state"], draining["stateCode"], draining["reason"]) == ("PREEMPTED", "PR", "Preempted")
    assert draining["reasonMessage"] == "preempted by job 42 (priority 100 over 0)"
    # Its cluster reports the attempt ended: requeued, with who preempted it.
    transition_job(
        job.pk,
        JobState.PENDING,
        reason=PendingReason.PREEMPTED,
        message="preempted by job 42 (priority 100 over 0); requeued (signalled)",
    )
    requeued = api(alice).get(f"{JOBS}/{job.pk}").json()
    assert (requeued["state"], requeued["reason"]) == ("PENDING", "Preempted")
    assert requeued["reasonMessage"].startswith("preempted by job 42")
    listed = api(alice).get(JOBS, {"state": "PD"}).json()["results"][0]
    assert listed["reason"] == "Preempted"


def test_a_preempted_job_without_a_message_still_says_why(api, alice, queue):
    job = make_job(alice, queue, reason=PendingReason.PREEMPTED)
    assert api(alice).get(f"{JOBS}/{job.pk}").json()["reasonMessage"].startswith("Preempted by a job")


# --- queues -------------------------------------------------------------------------------------


def test_queues_show_their_preemption_settings(api, alice, queue):
    row = api(alice).get("/api/v1/queues").json()["results"][0]
    assert (
        row["preemptWithinQueue"],
        row["reclaimWithinCohort"],
        row["preemptionGraceSeconds"],
        row["gpuModelPreference"],
    ) == ("never", "never", 30, [])
    queue.preempt_within_queue = PreemptWithinQueue.LOWER_PRIORITY
    queue.reclaim_within_cohort = ReclaimWithinCohort.ANY
    queue.preemption_grace_s = 120
    queue.gpu_model_preference = ["h100-80g", "a100-80g"]
    queue.save()
    row = api(alice).get("/api/v1/queues").json()["results"][0]
    assert (
        row["preemptWithinQueue"],
        row["reclaimWithinCohort"],
        row["preemptionGraceSeconds"],
        row["gpuModelPreference"],
    ) == ("lower_priority", "any", 120, ["h100-80g", "a100-80g"])
