"""Preemption through the real cycle and database: a higher-priority job of a queue that preempts
within itself moves a running job to PREEMPTED with its stop, is held the GPUs while the victim
drains, and is placed on them once the cluster reports the victim stopped."""

from __future__ import annotations

import re

import pytest
from django.core.cache import cache as django_cache
from django.utils import timezone

from clusters.adapters.base import Phase, RemoteState
from scheduling.choices import AttemptState, EventKind, JobState, PendingReason, PreemptWithinQueue
from scheduling.dispatch.remote import apply_remote_states
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import RECENT_CYCLES_KEY, run_cycle
from scheduling.models import Allocation, Job, JobAttempt, JobEvent
from tests.factories import make_cluster, make_job, make_node, make_queue

pytestmark = pytest.mark.django_db

TOKEN = "scrape-0123456789abcdefghijklmnopqrstuvwxyz"


def submit(owner, queue, **fields) -> Job:
    job = make_job(owner, queue, **fields)
    JobEvent.objects.create(job=job, kind=EventKind.SUBMITTED, to_state=JobState.PENDING)
    return job


def preemptions_counted(client, settings) -> float:
    settings.ORRERY_METRICS_TOKEN = TOKEN
    page = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").content.decode()
    found = re.search(r'^orrery_scheduler_preemptions_total\{reason="within_queue"\} (\S+)$', page, re.M)
    return float(found.group(1)) if found else 0.0


def gpus_of(job: Job) -> set[int]:
    return set(
        Allocation.objects.filter(job=job, active=True, gpu__isnull=False).values_list("gpu_id", flat=True)
    )


@pytest.fixture
def urgent(vision):
    return make_queue(
        vision, "urgent", preempt_within_queue=PreemptWithinQueue.LOWER_PRIORITY, preemption_grace_s=30
    )


def test_a_higher_priority_job_preempts_a_lower_one_of_its_queue_and_takes_its_gpus(
    alice, urgent, client, settings
):
    make_node(make_cluster("sim-a"), gpus=8, name="a0")
    cache = SchedulerCache()
    low = submit(
        alice, urgent, gpus=8, priority=0, spec={"preemption": {"signal": "USR1", "graceSeconds": 20}}
    )
    run_cycle(cache)
    attempt = JobAttempt.objects.get(job=low, active=True)
    apply_remote_states([RemoteState(str(attempt.pk), Phase.RUNNING)])
    assert Job.objects.get(pk=low.pk).state == JobState.RUNNING
    held = gpus_of(low)
    assert len(held) == 8
    counted = preemptions_counted(client, settings)

    high = submit(alice, urgent, gpus=8, priority=10, time_limit_s=3600)
    report = run_cycle(cache)
    assert (report.preempted, report.placed) == (1, 0)
    low.refresh_from_db()
    assert low.state == JobState.PREEMPTED
    assert low.reason_message == (
        f"preempted by job {high.pk} (vision/urgent, priority 10): "
        "a higher-priority job of its queue needs its GPUs"
    )
    attempt.refresh_from_db()
    assert attempt.active and attempt.stop_requested_at is not None
    assert (attempt.stop_signal, attempt.stop_grace_s) == ("USR1", 20), "the victim's own terms"
    assert gpus_of(low) == held, "a draining job keeps its GPUs"
    high.refresh_from_db()
    assert high.state == JobState.PENDING and high.reserved
    wait = (high.estimated_start_at - attempt.stop_requested_at).total_seconds()
    assert 20 <= wait <= 35, "it starts when the victim's grace period ends"
    assert high.estimated_where == "sim-a: a0"
    assert preemptions_counted(client, settings) == counted + 1
    assert django_cache.get(RECENT_CYCLES_KEY)[-1]["preempted"] == 1

    again = run_cycle(cache)  # the victim still drains: nothing new happens
    assert (again.preempted, again.placed) == (0, 0)
    other = submit(alice, urgent, gpus=8, priority=5)  # arrives while the victim drains
    run_cycle(cache)
    assert Job.objects.get(pk=other.pk).state == JobState.PENDING
    assert Job.objects.get(pk=low.pk).state == JobState.PREEMPTED, "a draining job is not preempted again"

    apply_remote_states([RemoteState(str(attempt.pk), Phase.CANCELLED, message="stopped by SIGTERM")])
    low.refresh_from_db()
    assert (low.state, low.reason) == (JobState.PENDING, PendingReason.PREEMPTED)
    attempt.refresh_from_db()
    assert not attempt.active and attempt.state == AttemptState.PREEMPTED
    assert gpus_of(low) == set()

    report = run_cycle(cache)
    assert report.placed == 1
    high.refresh_from_db()
    assert high.state == JobState.SCHEDULED and gpus_of(high) == held
    assert (high.estimated_start_at, high.estimated_where, high.reserved) == (None, "", False)
    assert Job.objects.get(pk=other.pk).state == JobState.PENDING
    assert Job.objects.get(pk=low.pk).state == JobState.PENDING
    assert preemptions_counted(client, settings) == counted + 1


def test_a_queue_that_never_preempts_leaves_running_jobs_alone(alice, queue, client, settings):
    make_node(make_cluster("sim-a"), gpus=8, name="a0")
    cache = SchedulerCache()
    low = submit(alice, queue, gpus=8, priority=0)
    run_cycle(cache)
    counted = preemptions_counted(client, settings)
    high = submit(alice, queue, gpus=8, priority=10)
    assert run_cycle(cache).preempted == 0
    assert Job.objects.get(pk=low.pk).state == JobState.SCHEDULED
    assert Job.objects.get(pk=high.pk).state == JobState.PENDING
    assert not JobAttempt.objects.filter(stop_requested_at__lte=timezone.now()).exists()
    assert preemptions_counted(client, settings) == counted
