"""A preemption through the agent protocol (clusters/api/agent.py, scheduling/dispatch/agent.py):
the heartbeat's answer carries the stop, an agent's ``preempted`` report requeues the job, and an
agent that predates ``stop`` is still told to stop the attempt."""

from __future__ import annotations

import pytest
from django.test import Client

from clusters.choices import NodeState
from clusters.models import Node
from clusters.services.credentials import create_join_token
from scheduling.choices import AttemptState, JobState, PendingReason
from scheduling.dispatch.desired import forget_desired
from scheduling.dispatch.outbox import drain_outbox
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import run_cycle
from scheduling.models import Allocation, Job, JobAttempt
from scheduling.services.preemption import Victim, preempt_jobs
from tests.clusters.test_agent_api import description, post, report
from tests.factories import make_cluster, make_job

pytestmark = pytest.mark.django_db
WHO = "preempted by job 99 (priority 10 over 1)"


@pytest.fixture
def node(client: Client) -> dict:
    cluster = make_cluster("rack-p", kind="native")
    _, join = create_join_token(cluster)
    answer = post(client, "register", description("gpu-p1"), join).json()
    Node.objects.filter(pk=answer["nodeId"]).update(state=NodeState.READY)
    forget_desired([answer["nodeId"]])  # ids are reused between tests; the cache outlives them
    return answer


def place(alice, queue, **spec) -> tuple[Job, str]:
    job = make_job(alice, queue, gpus=1, placement={"clusters": ["rack-p"]}, spec=spec)
    assert run_cycle(SchedulerCache()).placed == 1
    return job, str(JobAttempt.objects.get(job=job).pk)


def heartbeat(client: Client, node: dict, seq: int, running: list[str]) -> dict:
    answer = post(client, "heartbeat", {**report("gpu-p1", seq=seq), "running": running}, node["credential"])
    assert answer.status_code == 200, answer.content
    return answer.json()


def tell(client: Client, node: dict, *reports: dict) -> dict:
    body = {"node": node["node"], "reports": list(reports), "logs": []}
    answer = post(client, "attempts", body, node["credential"])
    assert answer.status_code == 200, answer.content
    return answer.json()


@pytest.mark.parametrize(
    ("queue_grace", "asked", "stop"),
    [
        (30, {}, {"signal": "TERM", "grace_s": 30}),
        (2, {"signal": "USR1"}, {"signal": "USR1", "grace_s": 2}),
        (30, {"signal": "HUP", "graceSeconds": 5}, {"signal": "HUP", "grace_s": 5}),
        (10, {"graceSeconds": 600}, {"signal": "TERM", "grace_s": 10}),  # never past the queue's
    ],
    ids=["defaults", "usr1-short-queue", "hup-5s", "capped"],
)
def test_the_desired_entry_of_a_preempted_attempt_carries_its_stop(
    client, node, alice, queue, django_capture_on_commit_callbacks, queue_grace, asked, stop
):
    queue.preemption_grace_s = queue_grace
    queue.save()
    job, attempt = place(alice, queue, preemption=asked)
    (entry,) = heartbeat(client, node, 1, [])["desired"]
    assert "stop" not in entry  # cached now: the preemption must drop it
    tell(client, node, {"attempt": attempt, "state": "running"})
    with django_capture_on_commit_callbacks(execute=True):
        assert preempt_jobs([Victim(job.pk, WHO)]) == [job.pk]
    answer = heartbeat(client, node, 2, [attempt])
    (entry,) = answer["desired"]
    assert entry["attempt"] == attempt and entry["stop"] == stop
    # An agent that predates ``stop`` stops it as it stops a cancelled attempt.
    assert answer["stop"] == [attempt]


def test_a_preempted_report_requeues_the_job_and_keeps_who_preempted_it(
    client, node, alice, queue, django_capture_on_commit_callbacks
):
    job, attempt = place(alice, queue)
    tell(client, node, {"attempt": attempt, "state": "running"})
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING
    with django_capture_on_commit_callbacks(execute=True):
        preempt_jobs([Victim(job.pk, WHO)])
    fresh = Job.objects.get(pk=job.pk)
    assert (fresh.state, fresh.reason, fresh.reason_message) == (
        JobState.PREEMPTED,
        PendingReason.PREEMPTED,
        WHO,
    )
    assert Allocation.objects.filter(job=job, active=True).count() == 2  # the node row and its GPU

    # A late "running" of the draining attempt changes nothing.
    assert tell(client, node, {"attempt": attempt, "state": "running"})["applied"] == 0
    ended = {"attempt": attempt, "state": "preempted", "exit_code": 0, "reason": "SIGTERM, then exit code 0"}
    with django_capture_on_commit_callbacks(execute=True):
        assert tell(client, node, ended) == {"applied": 1, "ignored": 0, "errors": []}

    fresh = Job.objects.get(pk=job.pk)
    assert (fresh.state, fresh.reason) == (JobState.PENDING, PendingReason.PREEMPTED)
    assert fresh.reason_message == f"{WHO}; requeued (SIGTERM, then exit code 0)"
    first = JobAttempt.objects.get(pk=attempt)
    assert (first.state, first.active, first.exit_code) == (AttemptState.PREEMPTED, False, 0)
    assert first.finished_at is not None
    assert not Allocation.objects.filter(job=job, active=True).exists()
    answer = heartbeat(client, node, 3, [attempt])
    assert answer["desired"] == [] and answer["stop"] == [attempt]

    # Placed again: a second attempt, a plain entry.
    assert run_cycle(SchedulerCache()).placed == 1
    assert drain_outbox() == 1  # delivered: the node's desired list is read afresh
    second = JobAttempt.objects.get(job=job, active=True)
    assert second.number == 2
    (entry,) = heartbeat(client, node, 4, [])["desired"]
    assert entry["attempt"] == str(second.pk) and "stop" not in entry


def test_an_attempt_preempted_before_it_started_is_reported_at_once(
    client, node, alice, queue, django_capture_on_commit_callbacks
):
    job, attempt = place(alice, queue)  # SCHEDULED: the agent has not started it
    with django_capture_on_commit_callbacks(execute=True):
        preempt_jobs([Victim(job.pk, WHO)])
    answer = heartbeat(client, node, 1, [])
    assert answer["desired"][0]["stop"]["signal"] == "TERM" and answer["stop"] == []
    tell(client, node, {"attempt": attempt, "state": "preempted", "reason": "before it started"})
    fresh = Job.objects.get(pk=job.pk)
    assert (fresh.state, fresh.reason_message) == (JobState.PENDING, f"{WHO}; requeued (before it started)")


def test_a_preempted_report_about_a_job_not_preempted_requeues_it_as_the_clusters_own(
    client, node, alice, queue
):
    """An agent never says ``preempted`` unasked; if one does, the job is requeued (as when a
    cluster preempts on its own), never ended."""
    job, attempt = place(alice, queue)
    tell(client, node, {"attempt": attempt, "state": "running"})
    tell(client, node, {"attempt": attempt, "state": "preempted", "exit_code": 143})
    fresh = Job.objects.get(pk=job.pk)
    assert (fresh.state, fresh.reason) == (JobState.PENDING, PendingReason.PREEMPTED)
    assert fresh.reason_message.startswith("preempted by its cluster; requeued")


@pytest.mark.parametrize(
    ("item", "path"),
    [
        ({"state": "preempted", "exit_code": 10**6}, "reports[0].exit_code"),
        ({"state": "preempted", "reason": "x" * 501}, "reports[0].reason"),
        ({"state": "PREEMPTED"}, "reports[0]"),
        ({"state": "drained"}, "reports[0]"),
    ],
    ids=["huge-exit-code", "long-reason", "upper-case", "unknown-state"],
)
def test_a_bad_preempted_report_is_refused_alone(client, node, alice, queue, item, path):
    job, attempt = place(alice, queue)
    answer = tell(client, node, {"attempt": attempt, **item}, {"attempt": attempt, "state": "running"})
    assert [e["path"] for e in answer["errors"]] == [path] and answer["applied"] == 1
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING
