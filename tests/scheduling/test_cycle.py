"""Scheduling cycles against the database: placements, reasons, locking, crashes, the cache."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, connections

from scheduling.choices import EventKind, JobState, PendingReason
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import commit as commit_phase
from scheduling.engine.cycle import run_cycle
from scheduling.engine.cycle.lock import LOCK_KEY
from scheduling.models import Allocation, DispatchOutbox, Job, JobAttempt, JobEvent, QueueQuota
from scheduling.services.jobs import cancel_job
from tests.factories import gpu_model, make_job, make_queue

pytestmark = pytest.mark.django_db


def submit(owner, queue, **fields):
    """A pending job as submission leaves it: the row and its 'submitted' event (the event log
    is how a running scheduler learns of new jobs)."""
    job = make_job(owner, queue, **fields)
    JobEvent.objects.create(job=job, kind=EventKind.SUBMITTED, to_state=JobState.PENDING)
    return job


def test_a_cycle_places_a_job_on_exact_gpus_in_one_transaction(alice, queue, fleet):
    job = make_job(alice, queue, gpus=4, cpu_millicores_per_node=1000, memory_bytes_per_node=2**30)
    report = run_cycle(SchedulerCache())
    assert report.ran and report.placed == 1 and report.epoch >= 1
    job.refresh_from_db()
    assert (job.state, job.attempt_count, job.reason) == (JobState.SCHEDULED, 1, "")
    attempt = JobAttempt.objects.get(job=job)
    assert attempt.active and attempt.epoch == report.epoch and attempt.number == 1
    rows = list(Allocation.objects.filter(attempt=attempt, active=True))
    gpus = sorted(r.gpu.index for r in rows if r.gpu_id)
    assert len(gpus) == 4 and len({r.node_id for r in rows}) == 1
    node_row = next(r for r in rows if r.gpu_id is None)
    assert (node_row.cpu_millicores, node_row.memory_bytes) == (1000, 2**30)
    assert all(
        r.gpu.node_id == node_row.node_id and r.gpu.model_id == job.gpu_model_id for r in rows if r.gpu_id
    )
    event = JobEvent.objects.get(job=job, to_state=JobState.SCHEDULED)
    assert event.from_state == JobState.PENDING and "placed on sim-" in event.message
    outbox = DispatchOutbox.objects.get(attempt=attempt)
    assert (outbox.state, outbox.kind, outbox.epoch) == ("pending", "start", report.epoch)


def test_binpacking_fills_one_node_before_the_next(alice, queue, fleet):
    for _ in range(4):
        make_job(alice, queue, gpus=2)
    run_cycle(SchedulerCache())
    nodes = set(Allocation.objects.filter(active=True, gpu__isnull=False).values_list("node_id", flat=True))
    assert len(nodes) == 1


def test_a_gang_lands_whole_in_one_cluster_or_not_at_all(alice, queue, fleet):
    gang = make_job(alice, queue, gpus=8, nodes=2)
    too_big = make_job(alice, queue, gpus=8, nodes=3)
    run_cycle(SchedulerCache())
    gang.refresh_from_db()
    too_big.refresh_from_db()
    assert gang.state == JobState.SCHEDULED
    clusters = set(Allocation.objects.filter(job=gang).values_list("node__cluster__name", flat=True))
    assert clusters == {"sim-a"} and Allocation.objects.filter(job=gang, gpu__isnull=False).count() == 16
    assert too_big.state == JobState.PENDING and not Allocation.objects.filter(job=too_big).exists()
    assert "largest has 2 ready" in too_big.reason_message


def test_pending_jobs_are_told_why_in_a_sentence(alice, queue, fleet):
    make_job(alice, queue, gpus=8)
    make_job(alice, queue, gpus=8)  # sim-a is full
    run_cycle(SchedulerCache())
    waiting = submit(alice, queue, gpus=8, placement={"clusters": ["sim-b"]})
    a100 = submit(alice, queue, gpus=1, model="a100")
    cache = SchedulerCache()
    run_cycle(cache)
    run_cycle(cache)
    waiting.refresh_from_db()
    a100.refresh_from_db()
    assert waiting.state == JobState.SCHEDULED  # sim-b still had a whole node
    assert (a100.reason, a100.reason_message) == (
        PendingReason.RESOURCES,
        "0/3 nodes fit: 3 have no a100-80g",
    )
    blocked = submit(alice, queue, gpus=8)
    run_cycle(cache)
    blocked.refresh_from_db()
    assert blocked.reason == PendingReason.RESOURCES
    assert blocked.reason_message == "0/3 nodes fit: 3 lack 8 free h100-80g"


def test_quota_holds_and_says_so(alice, queue, fleet):
    QueueQuota.objects.create(queue=queue, gpu_model=gpu_model("h100"), gpus=8)
    first, second = make_job(alice, queue, gpus=8), make_job(alice, queue, gpus=2)
    run_cycle(SchedulerCache())
    first.refresh_from_db()
    second.refresh_from_db()
    assert first.state == JobState.SCHEDULED
    assert (second.state, second.reason) == (JobState.PENDING, PendingReason.QUOTA_EXCEEDED)
    assert second.reason_message == "queue vision/default at 8/8 h100-80g; this job needs 2"


def test_higher_priority_goes_first(alice, queue, vision, fleet):
    urgent_queue = make_queue(vision, "urgent", priority=100)
    low = make_job(alice, queue, gpus=8, priority=0)
    high = make_job(alice, queue, gpus=8, priority=50)
    urgent = make_job(alice, urgent_queue, gpus=8, priority=0)
    run_cycle(SchedulerCache(), limit=2)
    states = {j.pk: Job.objects.get(pk=j.pk).state for j in (low, high, urgent)}
    assert states == {urgent.pk: JobState.SCHEDULED, high.pk: JobState.SCHEDULED, low.pk: JobState.PENDING}


def test_the_cache_follows_releases_without_a_rebuild(alice, queue, fleet):
    cache = SchedulerCache()
    jobs = [make_job(alice, queue, gpus=8) for _ in range(3)]
    run_cycle(cache)
    snap = cache.snap
    waiting = submit(alice, queue, gpus=8)
    run_cycle(cache)
    assert Job.objects.get(pk=waiting.pk).state == JobState.PENDING
    cancel_job(Job.objects.get(pk=jobs[0].pk), actor=alice)
    run_cycle(cache)
    assert cache.snap is snap, "kept current from events, not rebuilt"
    assert Job.objects.get(pk=waiting.pk).state == JobState.SCHEDULED


def test_a_crash_before_commit_leaves_no_trace(alice, queue, fleet, monkeypatch):
    job = make_job(alice, queue, gpus=2)
    cache = SchedulerCache()

    def crash(*args, **kwargs):
        raise RuntimeError("power cut")

    monkeypatch.setattr(commit_phase, "bulk_insert", crash)
    with pytest.raises(RuntimeError):
        run_cycle(cache)
    job.refresh_from_db()
    assert job.state == JobState.PENDING and job.attempt_count == 0
    assert not JobAttempt.objects.exists() and not Allocation.objects.exists()
    assert cache.snap is None, "assumed decisions are forgotten with the transaction"
    monkeypatch.undo()
    assert run_cycle(cache).placed == 1


def test_a_job_cancelled_during_the_cycle_loses_its_placement(alice, queue, fleet, monkeypatch):
    job = make_job(alice, queue, gpus=2)
    real_claim = commit_phase._claim

    def cancel_first(jobs, models):
        Job.objects.filter(pk=job.pk).update(state=JobState.CANCELLED)
        return real_claim(jobs, models)

    monkeypatch.setattr(commit_phase, "_claim", cancel_first)
    report = run_cycle(SchedulerCache())
    assert (report.placed, report.lost_races) == (0, 1)
    assert not JobAttempt.objects.exists() and not Allocation.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_second_concurrent_cycle_writes_nothing(alice, queue, fleet):
    if connection.vendor != "postgresql":
        pytest.skip("the advisory lock is PostgreSQL's")
    job = make_job(alice, queue, gpus=1)
    holding, release = threading.Event(), threading.Event()

    def other_cycle():
        other = connections.create_connection("default")
        with other.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [LOCK_KEY])
            holding.set()
            release.wait(10)
            cursor.execute("ROLLBACK")
        other.close()

    thread = threading.Thread(target=other_cycle)
    thread.start()
    holding.wait(10)
    try:
        report = run_cycle(SchedulerCache())
    finally:
        release.set()
        thread.join()
    assert not report.ran and report.placed == 0
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING
    assert not JobAttempt.objects.exists()
    assert run_cycle(SchedulerCache()).placed == 1  # the lock died with the other transaction


def test_a_large_class_is_told_why_in_slices(alice, queue, fleet, settings):
    settings.ORRERY_SCHEDULER_EXPLAIN_BUDGET = 2
    jobs = [make_job(alice, queue, gpus=1, model="a100") for _ in range(5)]
    cache = SchedulerCache()
    told = []
    for _ in range(3):
        run_cycle(cache)
        told.append(Job.objects.filter(pk__in=[j.pk for j in jobs], reason=PendingReason.RESOURCES).count())
    assert told == [2, 4, 5]
    assert set(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("reason_message", flat=True)) == {
        "0/3 nodes fit: 3 have no a100-80g"
    }


def test_a_gpu_reported_unhealthy_is_not_handed_out(alice, queue, fleet):
    from clusters.ingest.buffer import get_buffer
    from clusters.services.aggregation import flush_heartbeats

    cache = SchedulerCache()
    run_cycle(cache)  # the cache is built
    a0 = fleet[0]
    gpus = [
        [i, "", "", 0, 0, 0.0, 0.0, 0.0, "unhealthy" if i < 6 else "healthy", 79 if i < 6 else None]
        for i in range(8)
    ]
    get_buffer().put(
        [
            {
                "n": a0.pk,
                "c": a0.cluster_id,
                "b": "b",
                "q": 1,
                "t": __import__("time").time(),
                "s": "",
                "cpu": 0.1,
                "mem": 1,
                "pw": 1.0,
                "av": "x",
                "g": gpus,
                "r": [],
            }
        ]
    )
    flush_heartbeats()
    assert a0.events.filter(reason__contains="GPU 0 reported unhealthy (XID 79)").exists()
    job = submit(alice, queue, gpus=3, placement={"clusters": ["sim-a"]})
    run_cycle(cache)
    held = set(
        Allocation.objects.filter(job=job, gpu__isnull=False).values_list("gpu__node_id", "gpu__index")
    )
    assert held and all(node != a0.pk or index >= 6 for node, index in held)
    assert cache.snap.gpu_total[cache.snap.row_of[a0.pk]] == 2


def _report_health(node, unhealthy: set[int], seq: int) -> None:
    import time as clock

    from clusters.ingest.buffer import get_buffer
    from clusters.services.aggregation import flush_heartbeats

    gpus = [
        [
            i,
            "",
            "",
            0,
            0,
            0.0,
            0.0,
            0.0,
            "unhealthy" if i in unhealthy else "healthy",
            79 if i in unhealthy else None,
        ]
        for i in range(8)
    ]
    get_buffer().put(
        [
            {
                "n": node.pk,
                "c": node.cluster_id,
                "b": "b",
                "q": seq,
                "t": clock.time(),
                "s": "",
                "cpu": 0.1,
                "mem": 1,
                "pw": 1.0,
                "av": "x",
                "g": gpus,
                "r": [],
            }
        ]
    )
    flush_heartbeats()


def test_a_held_gpu_that_breaks_is_not_given_back_when_its_job_ends(alice, queue, fleet):
    cache = SchedulerCache()
    a0 = fleet[0]
    job = submit(alice, queue, gpus=8, placement={"clusters": ["sim-a"]})
    run_cycle(cache)
    node = Allocation.objects.filter(job=job, gpu__isnull=True).values_list("node_id", flat=True).get()
    a0 = next(n for n in fleet if n.pk == node)
    _report_health(a0, {3}, 1)
    cancel_job(Job.objects.get(pk=job.pk), actor=alice)
    run_cycle(cache)
    row = cache.snap.row_of[a0.pk]
    assert int(cache.snap.gpu_free[row]) == 7 and not int(cache.snap.free_bits[row]) >> 3 & 1
    _report_health(a0, set(), 2)  # healthy again
    run_cycle(cache)
    assert int(cache.snap.gpu_free[row]) == 8


def test_two_processes_caches_stay_right_when_a_job_moves(alice, queue, fleet):
    from scheduling.services.jobs import requeue_job

    a, b = SchedulerCache(), SchedulerCache()
    job = submit(alice, queue, gpus=8)
    run_cycle(a)
    first = set(Allocation.objects.filter(job=job, active=True).values_list("gpu_id", flat=True))
    requeue_job(Job.objects.get(pk=job.pk), actor=alice)
    Job.objects.filter(pk=job.pk).update(priority=-1)  # (keeps the job; B places it again)
    run_cycle(b)
    second = set(Allocation.objects.filter(job=job, active=True).values_list("gpu_id", flat=True))
    assert (second and second != first) or second == first  # wherever B put it
    others = [submit(alice, queue, gpus=8) for _ in range(2)]
    run_cycle(a)  # A must see where the job is now: no double booking, no failed cycle
    placed = [o for o in others if Job.objects.get(pk=o.pk).state == JobState.SCHEDULED]
    assert len(placed) == 2
    held = list(Allocation.objects.filter(active=True, gpu__isnull=False).values_list("gpu_id", flat=True))
    assert len(held) == len(set(held)) == 24


def test_a_cluster_turned_on_brings_nodes_that_joined_without_an_event(alice, queue):
    """Nodes bulk-created on a cluster while it was off (no NodeEvent of their own) are found when
    it is turned on: the cache reads the cluster's nodes from the database, not from its snapshot.
    Without that the cycle succeeds on an empty fleet and the job waits for the periodic resync."""
    from clusters.choices import ClusterState
    from clusters.models import Cluster
    from tests.factories import make_cluster, make_node

    cache = SchedulerCache()
    sim = make_cluster("late", state=ClusterState.DISABLED)
    run_cycle(cache)  # a snapshot of a fleet with no nodes
    job = submit(alice, queue, gpus=4)
    make_node(sim, gpus=8, name="late0")
    run_cycle(cache)
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING  # the cluster is off
    Cluster.objects.filter(pk=sim.pk).update(state=ClusterState.READY)
    run_cycle(cache)
    assert Job.objects.get(pk=job.pk).state == JobState.SCHEDULED


def test_a_class_mask_kept_between_cycles_sees_a_node_drained_in_between(alice, queue, fleet):
    """Node masks (the filters that depend only on what a node is) are kept between cycles; a node
    that stops being ready in between must drop out of them, or the next job of the same class
    lands on it (best fit picks the node the first job already half fills)."""
    from clusters.services.nodes import drain_node

    cache = SchedulerCache()
    first = submit(alice, queue, gpus=4)
    run_cycle(cache)
    held = Allocation.objects.filter(job=first, active=True).values_list("gpu__node", flat=True)
    node = next(n for n in fleet if n.pk == held[0])
    snap = cache.snap
    drain_node(node, actor=None)
    second = submit(alice, queue, gpus=4)
    run_cycle(cache)
    assert cache.snap is snap, "kept current from events, not rebuilt"
    where = set(Allocation.objects.filter(job=second, active=True).values_list("gpu__node", flat=True))
    assert Job.objects.get(pk=second.pk).state == JobState.SCHEDULED and node.pk not in where


def test_a_cycle_that_changed_nothing_is_kept_whole_until_something_changes(alice, queue, fleet):
    """A cycle in which every class kept its verdict and nothing was placed is returned as it is
    while nothing changes; new pending work, and GPUs freed, must each end that, or the job that
    now fits waits for ever."""
    for _ in fleet:
        make_job(alice, queue, gpus=7)  # one GPU left on each node
    cache = SchedulerCache()
    run_cycle(cache)
    waiting = [submit(alice, queue, gpus=8) for _ in range(2)]
    for _ in range(3):
        report = run_cycle(cache)
        assert report.placed == 0
    kept = cache.idle_cycle
    assert kept is not None
    run_cycle(cache)
    assert cache.idle_cycle is kept, "decided again though nothing changed"

    small = submit(alice, queue, gpus=1)
    assert run_cycle(cache).placed == 1
    assert Job.objects.get(pk=small.pk).state == JobState.SCHEDULED
    for _ in range(3):
        run_cycle(cache)
    assert cache.idle_cycle is not None

    running = Job.objects.filter(state=JobState.SCHEDULED, gpus_per_node=7).first()
    cancel_job(running, actor=None)
    assert run_cycle(cache).placed == 1
    assert sorted(Job.objects.get(pk=j.pk).state for j in waiting) == [JobState.PENDING, JobState.SCHEDULED]
