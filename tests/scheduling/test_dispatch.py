"""The kind-agnostic dispatcher: the outbox drain, the remote-state mapper, syncs and wake-ups,
log storage and node-loss failover (scheduling/dispatch/, scheduling/services/)."""

from __future__ import annotations

import time

import pytest

from clusters.adapters.base import LogChunk, Phase, RemoteState
from clusters.choices import NodeState
from clusters.models import Cluster, Node
from scheduling import wakeup
from scheduling.choices import EventKind, JobState, PendingReason
from scheduling.dispatch.outbox import drain_outbox
from scheduling.dispatch.remote import apply_remote_states, past_time_limit, target_state
from scheduling.dispatch.sync import sync_cluster, sync_due_clusters
from scheduling.dispatch.works import load_works
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import run_cycle
from scheduling.models import Allocation, DispatchOutbox, Job, JobAttempt, JobEvent
from scheduling.selectors import log_tail
from scheduling.services.failover import sweep_lost_nodes
from scheduling.services.logs import store_log
from tests.factories import make_job

pytestmark = pytest.mark.django_db


def sync_simulated() -> int:
    return sum(sync_cluster(c).moved for c in Cluster.objects.filter(kind="simulated"))


def attempt_of(job) -> str:
    return str(JobAttempt.objects.get(job=job, active=True).pk)


# --- simulated clusters through the one drain loop and the one sync ------------------------------


def test_simulated_jobs_end_on_time_not_on_the_next_beat(alice, queue, fleet, settings, monkeypatch):
    from django.core.cache import cache

    settings.REDIS_URL = "redis://wake-ups-only"  # wake-ups are a Celery feature
    cache.clear()
    asked: list[tuple[str, float]] = []
    monkeypatch.setattr(wakeup, "_send", lambda task, **o: asked.append((task, o.get("countdown", 0))))
    soon = make_job(alice, queue, gpus=1, spec={"sim": {"durationSeconds": 0.4, "exitCode": 0}})
    run_cycle(SchedulerCache())
    assert drain_outbox() == 1
    assert Job.objects.get(pk=soon.pk).state == JobState.RUNNING
    assert asked == [(wakeup.SYNC_TASK, 0.05)]  # a polled cluster is read at once after a delivery
    asked.clear()
    assert sync_simulated() == 0
    assert len(asked) == 1 and 0.3 < asked[0][1] <= 0.5  # at its end, not at the beat a second later
    time.sleep(asked[0][1])
    assert sync_simulated() == 1
    assert Job.objects.get(pk=soon.pk).state == JobState.SUCCEEDED
    make_job(alice, queue, gpus=1, spec={"sim": {"durationSeconds": 30, "exitCode": 0}})
    run_cycle(SchedulerCache())
    drain_outbox()
    asked.clear()
    sync_simulated()
    assert asked == []  # ends after the next beat: the beat will see it


def test_simulated_clusters_run_what_is_placed_on_them(alice, queue, fleet):
    job = make_job(alice, queue, gpus=2, spec={"sim": {"durationSeconds": 0, "exitCode": 0}})
    failing = make_job(alice, queue, gpus=1, spec={"sim": {"durationSeconds": 0, "exitCode": 3}})
    run_cycle(SchedulerCache())
    assert drain_outbox() == 2  # started
    assert sync_simulated() == 2  # zero-second jobs: one finished, one failed
    assert drain_outbox() == 0 and sync_simulated() == 0
    job.refresh_from_db()
    failing.refresh_from_db()
    assert (job.state, job.exit_code) == (JobState.SUCCEEDED, 0)
    assert (failing.state, failing.exit_code) == (JobState.FAILED, 3)
    assert not Allocation.objects.filter(active=True).exists()
    assert DispatchOutbox.objects.filter(state="sent").count() == 2


def test_the_periodic_sync_visits_each_polled_kind_at_its_own_interval(alice, queue, fleet):
    from django.core.cache import cache

    cache.clear()
    assert sync_due_clusters(now=1000.0) == 2  # both simulated clusters; native ones are not polled
    assert sync_due_clusters(now=1000.2) == 0  # not due yet
    assert sync_due_clusters(now=1000.6) == 2  # a one-second beat never skips a turn


def test_a_row_whose_attempt_ended_is_closed_without_a_delivery(alice, queue, fleet):
    from scheduling.services.jobs import cancel_job

    job = make_job(alice, queue, gpus=1)
    run_cycle(SchedulerCache())
    cancel_job(Job.objects.get(pk=job.pk), actor=None)
    assert drain_outbox() == 0
    assert DispatchOutbox.objects.get().state == DispatchOutbox.State.SENT
    assert Job.objects.get(pk=job.pk).state == JobState.CANCELLED


def test_works_say_where_and_what(alice, queue, fleet):
    job = make_job(
        alice,
        queue,
        gpus=2,
        command="python train.py",
        spec={"setup": "source env", "workdir": "/w d", "env": {"A": 1}},
    )
    run_cycle(SchedulerCache())
    (work,) = load_works([attempt_of(job)])
    assert work.job_id == job.pk and work.number == 1 and work.remote_id == ""
    assert work.script == "cd '/w d' && source env && python train.py"
    assert dict(work.env) == {"A": "1"}
    assert len(work.shares) == 1 and len(work.shares[0].gpu_indices) == 2 and work.gpus_per_node == 2
    assert work.nodes == (Node.objects.get(pk=work.shares[0].node_id).name,)


# --- the one mapper -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "current", "head", "expected"),
    [
        (Phase.STARTING, JobState.SCHEDULED, True, JobState.STARTING),
        (Phase.STARTING, JobState.RUNNING, True, None),
        (Phase.RUNNING, JobState.SCHEDULED, True, JobState.RUNNING),
        (Phase.RUNNING, JobState.STARTING, True, JobState.RUNNING),
        (Phase.RUNNING, JobState.RUNNING, True, None),
        (Phase.QUEUED, JobState.SCHEDULED, True, None),
        (Phase.HELD, JobState.SCHEDULED, True, None),
        (Phase.SUCCEEDED, JobState.RUNNING, True, JobState.SUCCEEDED),
        (Phase.SUCCEEDED, JobState.RUNNING, False, None),  # a gang member's success waits for the head
        (Phase.FAILED, JobState.RUNNING, False, JobState.FAILED),  # any failure decides at once
        (Phase.TIMEOUT, JobState.SCHEDULED, True, JobState.TIMEOUT),
        (Phase.CANCELLED, JobState.COMPLETING, True, JobState.CANCELLED),
        (Phase.PREEMPTED, JobState.RUNNING, True, JobState.PREEMPTED),
        (Phase.SUCCEEDED, JobState.CANCELLED, True, None),  # terminal: no way out
        (Phase.RUNNING, JobState.PENDING, True, None),
    ],
    ids=lambda v: str(v),
)
def test_the_mapper_table(phase, current, head, expected):
    assert target_state(phase, current, head=head) == expected


def test_remote_states_move_jobs_and_a_stale_attempt_moves_nothing(alice, queue, fleet):
    first, second = (make_job(alice, queue, gpus=1) for _ in range(2))
    run_cycle(SchedulerCache())
    a, b = attempt_of(first), attempt_of(second)
    moved = apply_remote_states(
        [
            RemoteState(a, Phase.STARTING, message="starting on node x"),
            RemoteState(a, Phase.RUNNING, message="running on node x"),
            RemoteState(b, Phase.RUNNING),
            RemoteState(a, Phase.FAILED, exit_code=7, message="exit code 7"),
        ]
    )
    assert moved == 4  # a's three in order (one round each), b's start
    assert list(
        JobEvent.objects.filter(job=first, kind=EventKind.TRANSITION).values_list("to_state", flat=True)
    )[-3:] == [JobState.STARTING, JobState.RUNNING, JobState.FAILED]
    assert Job.objects.get(pk=first.pk).exit_code == 7
    # a is no longer active: whatever is said of it now is fenced out
    assert apply_remote_states([RemoteState(a, Phase.SUCCEEDED, exit_code=0)]) == 0
    assert Job.objects.get(pk=first.pk).state == JobState.FAILED


def test_a_queued_attempt_says_why_it_waits_there(alice, queue, fleet):
    job = make_job(alice, queue, gpus=1)
    run_cycle(SchedulerCache())
    said = "pending in Slurm: waiting for resources in Slurm"
    assert apply_remote_states([RemoteState(attempt_of(job), Phase.QUEUED, message=said)]) == 0
    assert Job.objects.get(pk=job.pk).reason_message == said


def test_many_alike_move_in_one_set_based_transition(alice, queue, fleet, django_assert_max_num_queries):
    jobs = [make_job(alice, queue, gpus=1) for _ in range(12)]
    run_cycle(SchedulerCache())
    states = [RemoteState(attempt_of(j), Phase.RUNNING, message="running") for j in jobs]
    with django_assert_max_num_queries(20):  # not one transition per job
        assert apply_remote_states(states) == 12


@pytest.mark.parametrize(
    ("phase", "started_ago", "limit", "expected"),
    [
        (Phase.RUNNING, 61, 60, True),
        (Phase.RUNNING, 59, 60, False),
        (Phase.RUNNING, 61, None, False),
        (Phase.QUEUED, 61, 60, False),
    ],
)
def test_time_limits_are_enforced_to_the_second(phase, started_ago, limit, expected):
    now = time.time()
    state = RemoteState("a", phase, started_at=now - started_ago)
    assert past_time_limit(state, limit, now) is expected
    assert past_time_limit(RemoteState("a", phase), limit, now) is False  # no start time given


# --- logs and failover ----------------------------------------------------------------------------


def test_log_chunks_are_bytes_and_a_resend_keeps_only_what_is_new(alice, queue, fleet):
    job = make_job(alice, queue, gpus=1)
    run_cycle(SchedulerCache())
    attempt = attempt_of(job)
    node = Allocation.objects.filter(job=job, gpu__isnull=True).values_list("node__name", flat=True).get()
    first = "épοch 1 ✓\n"
    store_log(LogChunk(attempt, node, 0, first))
    # the agent missed our answer and sends from the same offset, with more output
    store_log(LogChunk(attempt, node, 0, first + "épοch 2 ✓\n"))
    store_log(LogChunk(attempt, node, len(first.encode()), "épοch 2 ✓\n"))
    assert log_tail(job.pk, 10) == (["épοch 1 ✓", "épοch 2 ✓"], False)


def test_a_gap_in_the_output_is_marked_and_an_unknown_attempt_is_refused(alice, queue, fleet):
    job = make_job(alice, queue, gpus=1)
    run_cycle(SchedulerCache())
    store_log(LogChunk(attempt_of(job), "a0", 10, "late\n"))
    assert log_tail(job.pk, 10) == (["[… 10 bytes not received …]", "late"], False)
    assert store_log(LogChunk("00000000-0000-0000-0000-000000000000", "a0", 0, "x")) is False


def test_the_failover_sweep_decides_jobs_left_on_a_down_node(alice, queue, fleet):
    job = make_job(alice, queue, gpus=1)
    run_cycle(SchedulerCache())
    node = Allocation.objects.filter(job=job, gpu__isnull=True).values_list("node_id", flat=True).get()
    Node.objects.filter(pk=node).update(state=NodeState.DOWN)  # the on-commit handler never ran
    assert sweep_lost_nodes() == 1
    refreshed = Job.objects.get(pk=job.pk)
    assert (refreshed.state, refreshed.reason) == (JobState.HELD, PendingReason.NODE_LOST)
    assert sweep_lost_nodes() == 0
