"""Preemption in the contract every kind of cluster answers (the worlds of tests/test_adapters.py:
simulated, a real agent, a real Slurm, Kubernetes): a preempted job stops on the cluster and
comes back PENDING ("Preempted") with its attempt ``preempted``; placed again, it runs again."""

from __future__ import annotations

import time

import pytest

from scheduling.choices import AttemptState, JobState, PendingReason
from scheduling.models import Allocation, Job, JobAttempt
from scheduling.services.jobs import cancel_job
from scheduling.services.preemption import Victim, preempt_jobs
from tests.test_adapters import (  # noqa: F401  (the worlds are fixtures)
    _place,
    kubernetes_world,
    native_world,
    simulated_world,
    slurm_world,
    world,
)

pytestmark = pytest.mark.django_db(transaction=True)
WHO = "preempted by job 77 (priority 50 over 1)"


def test_a_preempted_job_stops_on_the_cluster_and_is_requeued(world):  # noqa: F811
    world.queue.preemption_grace_s = 5
    world.queue.save()
    job = world.job("sleep 300", seconds=300)
    _place(world, job)
    world.until(job, JobState.RUNNING)
    attempt = JobAttempt.objects.get(job=job)
    assert preempt_jobs([Victim(job.pk, WHO)]) == [job.pk]
    fresh = world.until(job, JobState.PENDING, timeout=60)
    assert (fresh.reason, fresh.reason_message.startswith(f"{WHO}; requeued")) == (
        PendingReason.PREEMPTED,
        True,
    )
    attempt.refresh_from_db()
    assert (attempt.state, attempt.active) == (AttemptState.PREEMPTED, False)
    assert not Allocation.objects.filter(job=job, active=True).exists()
    end = time.monotonic() + 30
    while not world.stopped(JobAttempt.objects.get(pk=attempt.pk)):
        assert time.monotonic() < end, "the preempted work kept running on the cluster"
        world.sync()
        time.sleep(0.3)

    _place(world, job)
    world.until(job, JobState.RUNNING)
    assert JobAttempt.objects.get(job=job, active=True).number == 2
    cancel_job(Job.objects.get(pk=job.pk), actor=None)
    world.sync()
