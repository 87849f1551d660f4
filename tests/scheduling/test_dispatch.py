"""The kind-agnostic dispatcher: the outbox drain, the remote-state mapper, syncs and wake-ups,
log storage and node-loss failover (scheduling/dispatch/, scheduling/services/)."""

from __future__ import annotations

import time

import pytest

from clusters.adapters.base import AdapterError, LogChunk, Orphan, Phase, RemoteState, Sent
from clusters.adapters.simulated import SimulatedAdapter
from clusters.choices import ClusterKind, NodeState
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
from tests.factories import make_cluster, make_job

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


@pytest.mark.parametrize("stored", [10**400, "soon", -5], ids=["beyond-a-float", "not-a-number", "negative"])
def test_a_stored_simulated_duration_never_stops_the_others_ending(alice, queue, fleet, stored):
    """A duration stored before the spec bounded it (10**400 s overflows a float, on every
    pass) is clamped: the pass goes on, and the cluster's other jobs still end."""
    odd = make_job(alice, queue, gpus=1, spec={"sim": {"durationSeconds": stored, "exitCode": 0}})
    quick = make_job(alice, queue, gpus=1, spec={"sim": {"durationSeconds": 0, "exitCode": 0}})
    run_cycle(SchedulerCache())
    assert drain_outbox() == 2
    sync_simulated()
    assert Job.objects.get(pk=quick.pk).state == JobState.SUCCEEDED
    expected = JobState.SUCCEEDED if stored == -5 else JobState.RUNNING  # the default: minutes away
    assert Job.objects.get(pk=odd.pk).state == expected


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
        (Phase.PREEMPTED, JobState.RUNNING, True, JobState.PENDING),  # the cluster preempted it: requeued
        (Phase.SUCCEEDED, JobState.PREEMPTED, True, JobState.PENDING),  # drained: requeued
        (Phase.CANCELLED, JobState.PREEMPTED, True, JobState.PENDING),
        (Phase.RUNNING, JobState.PREEMPTED, True, None),
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


# --- the drain loop under faults ------------------------------------------------------------------


def test_a_kind_without_an_adapter_does_not_hold_up_the_others(alice, queue, fleet):
    first, second = make_job(alice, queue, gpus=8), make_job(alice, queue, gpus=8)
    run_cycle(SchedulerCache())
    other = make_cluster("k8s", kind=ClusterKind.KUBERNETES)
    DispatchOutbox.objects.filter(attempt__job=first).update(cluster=other)
    assert drain_outbox() == 1
    assert Job.objects.get(pk=second.pk).state == JobState.RUNNING
    assert DispatchOutbox.objects.get(attempt__job=first).state == DispatchOutbox.State.PENDING


def test_one_drain_at_a_time_delivers_to_a_cluster(alice, queue, fleet):
    """Another worker's drain holds the cluster's delivery lock (its own database session)."""
    import psycopg
    from django.db import connection

    from scheduling.dispatch.outbox import LOCK_CLASS

    job = make_job(alice, queue, gpus=1)
    run_cycle(SchedulerCache())
    cluster = JobAttempt.objects.get(job=job).cluster
    db = connection.settings_dict
    other = psycopg.connect(
        host=db["HOST"],
        port=db["PORT"],
        user=db["USER"],
        password=db["PASSWORD"],
        dbname=db["NAME"],
        autocommit=True,
    )
    try:
        assert other.execute("SELECT pg_try_advisory_lock(%s, %s)", [LOCK_CLASS, cluster.pk]).fetchone()[0]
        assert drain_outbox() == 0
        assert DispatchOutbox.objects.get().state == DispatchOutbox.State.PENDING
    finally:
        other.close()  # the other worker's session ends: its lock goes with it
    assert drain_outbox() == 1


def test_a_broken_cluster_does_not_stop_delivery_to_the_others(alice, queue, fleet, monkeypatch):
    jobs = [make_job(alice, queue, gpus=8) for _ in range(3)]  # a0, a1 on sim-a; b0 on sim-b
    run_cycle(SchedulerCache())
    works = SimulatedAdapter.dispatch

    def broken_on_sim_a(self, cluster, batch):
        if cluster.name == "sim-a":
            raise RuntimeError("the cluster's API answered nonsense")
        return works(self, cluster, batch)

    monkeypatch.setattr(SimulatedAdapter, "dispatch", broken_on_sim_a)
    assert drain_outbox() == 1
    states = {Job.objects.get(pk=j.pk).state for j in jobs}
    assert states == {JobState.RUNNING, JobState.SCHEDULED}
    assert DispatchOutbox.objects.filter(state=DispatchOutbox.State.PENDING).count() == 2  # tried again later


def test_deliveries_are_recorded_as_they_come(alice, queue, fleet, monkeypatch):
    jobs = [make_job(alice, queue, gpus=8) for _ in range(2)]
    for job in jobs:
        job.placement = {"clusters": ["sim-a"]}
        job.save()
    run_cycle(SchedulerCache())

    def first_then_down(self, cluster, batch):
        yield Sent(batch[0].attempt_id, remote_id="r-1")
        raise AdapterError("connection reset")

    monkeypatch.setattr(SimulatedAdapter, "dispatch", first_then_down)
    assert drain_outbox() == 1
    rows = {str(r.attempt_id): r for r in DispatchOutbox.objects.all()}
    sent = [r for r in rows.values() if r.state == DispatchOutbox.State.SENT]
    tried = [r for r in rows.values() if r.state == DispatchOutbox.State.PENDING]
    assert len(sent) == 1 and JobAttempt.objects.get(pk=sent[0].attempt_id).remote_id == "r-1"
    assert len(tried) == 1 and (tried[0].tries, tried[0].last_error) == (1, "connection reset")


# --- orphans: work the cluster runs that Orrery no longer wants ------------------------------------


def test_orphans_are_cancelled_but_never_a_delivery_in_flight(alice, queue, fleet, monkeypatch):
    from scheduling.dispatch.sync import _withdraw

    ended, running, in_flight = (make_job(alice, queue, gpus=1) for _ in range(3))
    for job in (ended, running, in_flight):
        job.placement = {"clusters": ["sim-a"]}
        job.save()
    run_cycle(SchedulerCache())
    cluster = Cluster.objects.get(name="sim-a")
    JobAttempt.objects.filter(job=running).update(remote_id="r-run")
    from scheduling.services.jobs import cancel_job

    cancel_job(Job.objects.get(pk=ended.pk), actor=None)
    cancelled: list[str] = []
    monkeypatch.setattr(SimulatedAdapter, "cancel", lambda self, c, ids: cancelled.extend(ids) or len(ids))
    orphans = [
        Orphan(attempt_of_any(ended), "r-ended"),  # Orrery cancelled it: stop it there
        Orphan(attempt_of(running), "r-dup"),  # a second job under a running attempt's name
        Orphan(attempt_of(running), "r-run"),  # (the recorded one is not an orphan, but never cancelled)
        Orphan(attempt_of(in_flight), "r-new"),  # delivered while the sync was reading: leave it
        Orphan("not-a-uuid", "r-foreign"),  # not Orrery's
    ]
    assert _withdraw(cluster, orphans) == 2
    assert sorted(cancelled) == ["r-dup", "r-ended"]
    cancelled.clear()
    other = Cluster.objects.get(name="sim-b")  # another Orrery cluster on the same backend
    assert _withdraw(other, orphans) == 0 and cancelled == []  # never touches sim-a's jobs


def attempt_of_any(job) -> str:
    return str(JobAttempt.objects.filter(job=job).latest("number").pk)


# --- gangs: the head decides success ----------------------------------------------------------------


def test_in_a_gang_only_the_heads_success_ends_the_job(alice, queue, fleet):
    from scheduling.dispatch.agent import apply_reports

    gang = make_job(alice, queue, gpus=8, nodes=2)
    run_cycle(SchedulerCache())
    drain_outbox()  # simulated: running at once
    attempt = attempt_of(gang)
    head, member = sorted(
        Allocation.objects.filter(job=gang, gpu__isnull=True).values_list("node_id", flat=True)
    )
    done = {"attempt": attempt, "state": "succeeded", "exit_code": 0}
    assert apply_reports(member, [done], []) == {"applied": 0, "ignored": 1, "refused_logs": []}
    assert Job.objects.get(pk=gang.pk).state == JobState.RUNNING
    assert apply_reports(head, [done], []) == {"applied": 1, "ignored": 0, "refused_logs": []}
    assert Job.objects.get(pk=gang.pk).state == JobState.SUCCEEDED


def test_in_a_gang_any_failure_ends_the_job(alice, queue, fleet):
    from scheduling.dispatch.agent import apply_reports

    gang = make_job(alice, queue, gpus=8, nodes=2)
    run_cycle(SchedulerCache())
    drain_outbox()
    member = max(Allocation.objects.filter(job=gang, gpu__isnull=True).values_list("node_id", flat=True))
    failed = {"attempt": attempt_of(gang), "state": "failed", "exit_code": 2}
    assert apply_reports(member, [failed], []) == {"applied": 1, "ignored": 0, "refused_logs": []}
    assert (Job.objects.get(pk=gang.pk).state, Job.objects.get(pk=gang.pk).exit_code) == (JobState.FAILED, 2)


def test_a_report_from_a_node_the_attempt_does_not_hold_is_fenced_out(alice, queue, fleet):
    from scheduling.dispatch.agent import apply_reports

    job = make_job(alice, queue, gpus=1)
    run_cycle(SchedulerCache())
    drain_outbox()
    held = Allocation.objects.filter(job=job, gpu__isnull=True).values_list("node_id", flat=True).get()
    elsewhere = Node.objects.exclude(pk=held).values_list("pk", flat=True).first()
    report = {"attempt": attempt_of(job), "state": "failed", "exit_code": 1}
    assert apply_reports(elsewhere, [report], []) == {"applied": 0, "ignored": 1, "refused_logs": []}
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING


# --- what events say: names, never ids or "None" ----------------------------------------------------


def test_an_agents_report_names_the_node_not_its_id(alice, queue, fleet):
    from scheduling.dispatch.agent import apply_reports

    job = make_job(alice, queue, gpus=1)
    run_cycle(SchedulerCache())  # placed, not yet delivered
    node = Allocation.objects.filter(job=job, gpu__isnull=True).select_related("node").get().node
    report = {"attempt": attempt_of(job), "state": "running"}
    assert apply_reports(node.pk, [report], [])["applied"] == 1
    said = JobEvent.objects.filter(job=job, to_state=JobState.RUNNING).get().message
    assert said == f"running on {node.name}"


def test_a_requeue_without_a_word_from_the_cluster_says_no_empty_brackets(alice, queue, fleet):
    job = make_job(alice, queue, gpus=1)
    run_cycle(SchedulerCache())
    assert apply_remote_states([RemoteState(attempt_of(job), Phase.PREEMPTED)]) == 1
    said = JobEvent.objects.filter(job=job, to_state=JobState.PENDING).latest("id").message
    assert said == "preempted by its cluster; requeued"
