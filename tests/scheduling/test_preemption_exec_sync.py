"""Draining preempted attempts on polled clusters (scheduling/dispatch/sync.py ``_drain``) and on
simulated ones: the signal once, the cancel after the grace period, the cluster's report of the
end that requeues the job, and the shortcuts for work that never ran.

The step logic is driven here through a simulated cluster whose ``sync`` answers what a polled
cluster would say (a remote id, queued or running, then ended), with its ``signal`` and
``cancel`` recorded: a test double, because what a sync does must be checked step by step at
chosen times. The same story on a real Slurm is tests/clusters/test_preemption_slurm_live.py,
and on a real agent tests/clusters/test_preemption_exec_e2e.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from clusters.adapters.base import Phase, RemoteState, Synced
from clusters.adapters.simulated import SimulatedAdapter
from clusters.models import Cluster
from scheduling.choices import AttemptState, JobState, PendingReason
from scheduling.dispatch.outbox import drain_outbox
from scheduling.dispatch.sync import sync_cluster
from scheduling.dispatch.works import load_works
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import run_cycle
from scheduling.models import Allocation, DispatchOutbox, Job, JobAttempt
from scheduling.services.preemption import Victim, preempt_jobs
from tests.factories import make_cluster, make_job, make_node

pytestmark = pytest.mark.django_db
WHO = "preempted by job 99 (priority 10 over 1)"


@pytest.fixture
def sim(alice, queue):
    """One simulated cluster with one 8-GPU node."""
    cluster = make_cluster("sim-p")
    make_node(cluster, gpus=8, name="p0")
    return cluster


def running_job(alice, queue, **spec):
    job = make_job(alice, queue, gpus=2, spec={"sim": {"durationSeconds": 3600, "exitCode": 0}, **spec})
    assert run_cycle(SchedulerCache()).placed == 1
    assert drain_outbox() == 1
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING
    return job


def preempt(job, django_capture_on_commit_callbacks) -> JobAttempt:
    with django_capture_on_commit_callbacks(execute=True):
        assert preempt_jobs([Victim(job.pk, WHO)]) == [job.pk]
    assert Job.objects.get(pk=job.pk).state == JobState.PREEMPTED
    return JobAttempt.objects.get(job=job, active=True)


def assert_requeued(job, attempt: JobAttempt, words: str = "") -> Job:
    fresh = Job.objects.get(pk=job.pk)
    assert (fresh.state, fresh.reason) == (JobState.PENDING, PendingReason.PREEMPTED)
    said = fresh.reason_message
    assert said.startswith(f"{WHO}; requeued") and words in said
    assert not said.endswith("()")  # the cluster's own words in brackets, when it said any
    attempt.refresh_from_db()
    assert (attempt.state, attempt.active) == (AttemptState.PREEMPTED, False)
    assert not Allocation.objects.filter(job=job, active=True).exists()
    return fresh


# --- simulated clusters: nothing to drain -----------------------------------------------------------


def test_a_preempted_simulated_job_is_requeued_and_runs_again(
    alice, queue, sim, django_capture_on_commit_callbacks
):
    job = running_job(alice, queue)
    attempt = preempt(job, django_capture_on_commit_callbacks)
    assert Allocation.objects.filter(job=job, active=True).exists()  # it keeps its GPUs until drained
    assert sync_cluster(sim).moved == 1
    assert_requeued(job, attempt, "stopped on a simulated cluster")
    assert run_cycle(SchedulerCache()).placed == 1
    assert drain_outbox() == 1
    second = JobAttempt.objects.get(job=job, active=True)
    assert second.number == 2 and second.stop_requested_at is None
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING


def test_a_job_preempted_before_its_delivery_is_requeued_without_one(
    alice, queue, sim, django_capture_on_commit_callbacks
):
    job = make_job(alice, queue, gpus=1)
    run_cycle(SchedulerCache())
    attempt = preempt(job, django_capture_on_commit_callbacks)  # SCHEDULED: its outbox row waits
    assert sync_cluster(sim).moved == 1
    assert_requeued(job, attempt)
    assert drain_outbox() == 0  # its row is closed: nothing is delivered for an ended attempt
    assert DispatchOutbox.objects.get().state == DispatchOutbox.State.SENT


def test_works_carry_the_stop_of_a_preempted_attempt(alice, queue, sim, django_capture_on_commit_callbacks):
    queue.preemption_grace_s = 5
    queue.save()
    job = running_job(alice, queue, preemption={"signal": "USR1", "graceSeconds": 60})
    (before,) = load_works(JobAttempt.objects.filter(job=job))
    assert before.stop is None
    attempt = preempt(job, django_capture_on_commit_callbacks)
    (work,) = load_works([attempt.pk])
    assert (work.stop.signal, work.stop.grace_s, work.stop.signalled_at) == (
        "USR1",
        5,
        None,
    )  # the queue's cap
    assert work.stop.deadline == pytest.approx(attempt.stop_requested_at.timestamp() + 5)


# --- polled clusters, step by step ----------------------------------------------------------------


class PolledCluster:
    """What a polled cluster says (``phase`` of remote job ``r1``, or nothing), and the signals
    and cancels it is sent."""

    def __init__(self, monkeypatch, *, signals: bool = True, reach: bool = True) -> None:
        self.phase: Phase | None = Phase.RUNNING
        self.remote_id = "r1"
        self.signalled: list[tuple[list[str], str, int]] = []
        self.cancelled: list[list[str]] = []
        cluster = self

        def sync(adapter, c, works):
            if cluster.phase is None:
                return Synced()
            return Synced(states=[RemoteState(w.attempt_id, cluster.phase, cluster.remote_id) for w in works])

        def signal(adapter, c, remote_ids, sig, grace_s):
            cluster.signalled.append((list(remote_ids), sig, grace_s))
            return len(remote_ids) if reach else 0

        def cancel(adapter, c, remote_ids):
            cluster.cancelled.append(list(remote_ids))
            return len(remote_ids)

        monkeypatch.setattr(SimulatedAdapter, "sync", sync)
        monkeypatch.setattr(SimulatedAdapter, "cancel", cancel)
        if signals:
            monkeypatch.setattr(SimulatedAdapter, "signal", signal, raising=False)


def past_grace(attempt: JobAttempt) -> None:
    JobAttempt.objects.filter(pk=attempt.pk).update(
        stop_requested_at=timezone.now() - timedelta(seconds=attempt.stop_grace_s + 1)
    )


def test_a_running_job_is_signalled_once_then_cancelled_after_its_grace_then_requeued(
    alice, queue, sim, monkeypatch, django_capture_on_commit_callbacks
):
    job = running_job(alice, queue, preemption={"signal": "USR1"})
    polled = PolledCluster(monkeypatch)
    attempt = preempt(job, django_capture_on_commit_callbacks)

    counts = sync_cluster(sim)
    assert (counts.moved, counts.signalled, counts.cancelled) == (0, 1, 0)
    ((ids, sig, grace),) = polled.signalled
    assert (ids, sig) == (["r1"], "USR1") and 28 <= grace <= 30  # what is left of its 30 s
    attempt.refresh_from_db()
    assert attempt.signalled_at is not None and attempt.active
    assert Job.objects.get(pk=job.pk).state == JobState.PREEMPTED  # it drains, keeping its GPUs

    sync_cluster(sim)
    assert len(polled.signalled) == 1 and polled.cancelled == []  # once; no kill before the grace ends

    past_grace(attempt)
    assert sync_cluster(sim).cancelled == 1
    assert polled.cancelled == [["r1"]] and len(polled.signalled) == 1
    assert Job.objects.get(pk=job.pk).state == JobState.PREEMPTED  # until the cluster says it ended

    polled.phase = Phase.CANCELLED
    assert sync_cluster(sim).moved == 1
    assert_requeued(job, attempt)
    assert polled.cancelled == [["r1"]]  # an ended job is not cancelled again


def test_a_job_that_ends_on_its_signal_is_requeued_without_a_kill(
    alice, queue, sim, monkeypatch, django_capture_on_commit_callbacks
):
    job = running_job(alice, queue)
    polled = PolledCluster(monkeypatch)
    attempt = preempt(job, django_capture_on_commit_callbacks)
    sync_cluster(sim)
    polled.phase = Phase.SUCCEEDED  # it trapped the signal, saved its work and exited 0
    sync_cluster(sim)
    assert_requeued(job, attempt)
    assert polled.cancelled == [] and len(polled.signalled) == 1


def test_a_job_still_queued_on_the_cluster_is_withdrawn_at_once(
    alice, queue, sim, monkeypatch, django_capture_on_commit_callbacks
):
    job = running_job(alice, queue)
    polled = PolledCluster(monkeypatch)
    polled.phase = Phase.QUEUED
    attempt = preempt(job, django_capture_on_commit_callbacks)
    counts = sync_cluster(sim)
    assert (counts.moved, counts.cancelled, counts.signalled) == (1, 1, 0)
    assert polled.cancelled == [["r1"]] and polled.signalled == []  # a pending job cannot be signalled
    assert_requeued(job, attempt, "withdrawn while queued")


def test_a_job_the_cluster_does_not_have_yet_ends_at_once(
    alice, queue, sim, monkeypatch, django_capture_on_commit_callbacks
):
    job = running_job(alice, queue)
    JobAttempt.objects.filter(job=job).update(remote_id="")
    polled = PolledCluster(monkeypatch)
    polled.phase = None
    attempt = preempt(job, django_capture_on_commit_callbacks)
    assert sync_cluster(sim).moved == 1
    assert polled.cancelled == [] and polled.signalled == []
    assert_requeued(job, attempt, "before it reached the cluster")


def test_a_kind_that_cannot_signal_cancels_at_once_and_once_before_the_grace_ends(
    alice, queue, sim, monkeypatch, django_capture_on_commit_callbacks
):
    job = running_job(alice, queue)
    polled = PolledCluster(monkeypatch, signals=False)
    attempt = preempt(job, django_capture_on_commit_callbacks)
    assert sync_cluster(sim).signalled == 1
    assert polled.cancelled == [["r1"]]
    sync_cluster(sim)
    assert polled.cancelled == [["r1"]]  # signalled_at says it is done
    polled.phase = Phase.CANCELLED
    sync_cluster(sim)
    assert_requeued(job, attempt)


def test_a_signal_that_did_not_reach_the_job_is_sent_again(
    alice, queue, sim, monkeypatch, django_capture_on_commit_callbacks
):
    job = running_job(alice, queue)
    polled = PolledCluster(monkeypatch, reach=False)
    attempt = preempt(job, django_capture_on_commit_callbacks)
    assert sync_cluster(sim).signalled == 0
    sync_cluster(sim)
    assert len(polled.signalled) == 2
    attempt.refresh_from_db()
    assert attempt.signalled_at is None


def test_grace_zero_is_a_kill_at_the_first_sync(
    alice, queue, sim, monkeypatch, django_capture_on_commit_callbacks
):
    queue.preemption_grace_s = 0
    queue.save()
    job = running_job(alice, queue)
    polled = PolledCluster(monkeypatch)
    preempt(job, django_capture_on_commit_callbacks)
    assert sync_cluster(sim).cancelled == 1
    assert polled.signalled == [] and polled.cancelled == [["r1"]]


def test_a_native_cluster_is_never_drained_by_a_sync(alice, queue, django_capture_on_commit_callbacks):
    """Agents stop their own attempts: a sync woken for a native cluster must not end one that
    still runs there (it has no remote id)."""
    lab = make_cluster("lab-p", kind="native")
    make_node(lab, gpus=8, name="l0")
    job = make_job(alice, queue, gpus=1)
    run_cycle(SchedulerCache())
    drain_outbox()
    attempt = preempt(job, django_capture_on_commit_callbacks)
    assert sync_cluster(Cluster.objects.get(pk=lab.pk)).moved == 0
    attempt.refresh_from_db()
    assert attempt.active and Job.objects.get(pk=job.pk).state == JobState.PREEMPTED


# --- many victims at once -------------------------------------------------------------------------


def test_victims_of_many_preemptions_move_in_a_few_statements_whatever_their_number(
    alice, queue, sim, django_assert_max_num_queries
):
    """A cycle's victims are moved set-based: the statements do not grow with the victims, and
    each victim still gets its own preemptor's words and its own stop (signal, grace)."""
    make_node(sim, gpus=8, name="p1")
    jobs = [
        make_job(
            alice, queue, gpus=1, spec={"preemption": {"signal": "USR1", "graceSeconds": 5}} if i % 2 else {}
        )
        for i in range(16)
    ]
    assert run_cycle(SchedulerCache()).placed == 16
    Job.objects.filter(pk__in=[j.pk for j in jobs[8:]]).update(state=JobState.RUNNING)  # two states to leave

    def victims(few: list) -> list[Victim]:
        return [Victim(j.pk, f"preempted by job {900 + i % 2}") for i, j in enumerate(few)]

    with django_assert_max_num_queries(25) as few:
        assert sorted(preempt_jobs(victims(jobs[:4] + jobs[8:10]))) == sorted(
            j.pk for j in jobs[:4] + jobs[8:10]
        )
    with django_assert_max_num_queries(len(few.captured_queries)):
        assert len(preempt_jobs(victims(jobs[4:8] + jobs[10:]))) == 10
    assert preempt_jobs(victims(jobs[:1])) == []  # already PREEMPTED: left alone

    for i, job in enumerate(jobs):
        job.refresh_from_db()
        assert (job.state, job.reason) == (JobState.PREEMPTED, PendingReason.PREEMPTED)
        event = job.events.order_by("pk").last()
        assert (event.from_state, event.message) == (
            JobState.SCHEDULED if i < 8 else JobState.RUNNING,
            f"preempted by job {900 + i % 2}",
        )
        attempt = JobAttempt.objects.get(job=job, active=True)
        assert (attempt.stop_signal, attempt.stop_grace_s) == (("USR1", 5) if i % 2 else ("TERM", 30))
        assert attempt.stop_requested_at is not None
