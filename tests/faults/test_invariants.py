"""The fault suite's invariant checker can fail: each check is shown a world that breaks it."""

from __future__ import annotations

import subprocess
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from clusters.models import Node
from scheduling.models import Allocation, Job, JobAttempt, JobEvent
from tests.factories import make_cluster, make_job, make_node, make_project, make_queue, make_user
from tests.faults.invariants import assert_invariants, database_violations, process_violations

pytestmark = pytest.mark.django_db


@pytest.fixture
def world():
    user = make_user()
    queue = make_queue(make_project(members=(user,)))
    node = make_node(make_cluster(), gpus=2)
    return user, queue, node


def _running(job: Job, node: Node) -> JobAttempt:
    attempt = JobAttempt.objects.create(job=job, number=1, cluster=node.cluster)
    Allocation.objects.create(attempt=attempt, job=job, node=node, cpu_millicores=1000, memory_bytes=1 << 20)
    JobEvent.objects.create(job=job, kind="transition", from_state="PENDING", to_state="RUNNING")
    Job.objects.filter(pk=job.pk).update(state="RUNNING")
    return attempt


def _found(**kwargs) -> list[str]:
    with connection.cursor() as cursor:
        return database_violations(cursor, **kwargs)


def test_a_consistent_world_passes(world):
    user, queue, node = world
    _running(make_job(user, queue), node)
    with connection.cursor() as cursor:
        assert_invariants(cursor)


def test_an_active_job_without_a_live_attempt_is_caught(world):
    user, queue, _ = world
    job = make_job(user, queue)
    JobEvent.objects.create(job=job, kind="transition", from_state="PENDING", to_state="RUNNING")
    Job.objects.filter(pk=job.pk).update(state="RUNNING")
    assert any("with no live attempt" in v for v in _found())


def test_an_ended_job_with_a_live_attempt_is_caught(world):
    user, queue, node = world
    job = make_job(user, queue)
    _running(job, node)
    Job.objects.filter(pk=job.pk).update(state="FAILED")
    found = _found()
    assert any("still has a live attempt" in v for v in found)
    assert any("has an event leading to RUNNING but is FAILED" in v for v in found)


def test_a_broken_history_chain_is_caught(world):
    user, queue, node = world
    job = make_job(user, queue)
    _running(job, node)
    JobEvent.objects.create(job=job, kind="transition", from_state="SCHEDULED", to_state="RUNNING")
    assert any("a transition from SCHEDULED follows one to RUNNING" in v for v in _found())


def test_overcommitted_capacity_is_caught(world):
    user, queue, node = world
    _running(make_job(user, queue), node)
    Node.objects.filter(pk=node.pk).update(cpu_millicores_allocatable=10)
    assert any("past what it offers" in v for v in _found())


def test_a_job_on_a_node_down_past_failover_is_caught(world):
    user, queue, node = world
    _running(make_job(user, queue), node)
    Node.objects.filter(pk=node.pk).update(
        state="down", state_changed_at=timezone.now() - timedelta(minutes=5)
    )
    assert any("down for more than" in v for v in _found(down_slack_s=60))
    assert not any("down for more than" in v for v in _found(down_slack_s=600))


def test_a_lost_job_is_caught(world):
    user, queue, _ = world
    job = make_job(user, queue)
    assert _found(accepted_jobs=[job.pk]) == []
    assert _found(accepted_jobs=[job.pk, job.pk + 1000]) == [f"job {job.pk + 1000} was accepted but is gone"]


def test_a_process_for_an_ended_attempt_is_caught(world, tmp_path):
    user, queue, node = world
    attempt = _running(make_job(user, queue), node)
    exit_file = tmp_path / "attempts" / str(attempt.pk) / "exit_code"
    shell = subprocess.Popen(["/bin/sh", "-c", f"sleep 30; echo $? > {exit_file}"])
    try:
        with connection.cursor() as cursor:
            assert process_violations(cursor) == []
            JobAttempt.objects.filter(pk=attempt.pk).update(active=False)
            assert process_violations(cursor) == [
                f"attempt {attempt.pk} has ended but process {shell.pid} still runs it"
            ]
    finally:
        shell.kill()
        shell.wait()
