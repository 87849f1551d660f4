"""Pipelined cycles: each cycle's commit on a second connection while the next one decides.
The guarantees of a sequential cycle hold: nothing is visible before the commit, a commit fenced
out by another cycle's is refused whole, and nothing decided on top of a commit that failed is
ever committed."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import OperationalError, connection, connections
from django.db.models import Sum
from prometheus_client import REGISTRY

from scheduling.choices import EventKind, JobState
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import CyclePipeline, run_cycle, run_cycles
from scheduling.engine.cycle import commit as commit_phase
from scheduling.engine.cycle import lock as lock_phase
from scheduling.models import Allocation, Job, JobAttempt, JobEvent, SchedulerState
from tests.factories import make_cluster, make_job, make_node

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def postgresql():
    if connection.vendor != "postgresql":
        pytest.skip("cycles are pipelined on PostgreSQL only (SQLite's stay sequential)")


def submit(owner, queue, **fields):
    job = make_job(owner, queue, **fields)
    JobEvent.objects.create(job=job, kind=EventKind.SUBMITTED, to_state=JobState.PENDING)
    return job


def aborted(reason: str) -> float:
    return REGISTRY.get_sample_value("orrery_scheduler_cycles_aborted_total", {"reason": reason}) or 0.0


def seen_from_outside(job_id: int) -> tuple[str, int]:
    """The job's state and attempts as a third connection sees them."""
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT state FROM scheduling_job WHERE id = %s", [job_id])
            state = cursor.fetchone()[0]
            cursor.execute("SELECT count(*) FROM scheduling_jobattempt WHERE job_id = %s", [job_id])
            return state, cursor.fetchone()[0]
    finally:
        other.close()


def test_the_commit_runs_on_a_second_connection_and_shows_nothing_before_it_commits(
    alice, queue, monkeypatch
):
    make_node(make_cluster("sim-a"), gpus=8, name="a0")
    job = submit(alice, queue, gpus=8)
    real_commit = commit_phase.commit
    seen = {}

    def watched(decisions, snap, epoch):
        out = real_commit(decisions, snap, epoch)  # written, in the commit's transaction
        seen["backend"] = connection.connection.info.backend_pid
        seen["in_transaction"] = connection.in_atomic_block
        seen["outside"] = seen_from_outside(job.pk)
        return out

    monkeypatch.setattr(commit_phase, "commit", watched)
    connection.ensure_connection()
    report = run_cycle(SchedulerCache())
    assert report.ran and report.placed == 1 and not report.aborted and not report.committing
    assert seen["backend"] != connection.connection.info.backend_pid, "a second connection"
    assert seen["in_transaction"]
    assert seen["outside"] == (JobState.PENDING, 0), "nothing visible before the commit"
    assert seen_from_outside(job.pk) == (JobState.SCHEDULED, 1)
    assert JobAttempt.objects.get(job=job).epoch == SchedulerState.objects.get().epoch


def test_a_commit_fenced_out_by_another_schedulers_cycle_is_refused_whole(alice, queue, monkeypatch):
    """Worker A decides X; before its commit lands, worker B (a cycle of its own, its own cache
    and connection) places Y, which takes the CPU X needed. Each decision fits alone, on other
    GPUs, so no index stops the pair: only the epoch does. A's commit is refused, nothing of it
    is written, and A's next cycle, on a rebuilt cache, sees the node full."""
    node = make_node(make_cluster("sim-a"), gpus=2, name="a0")  # 64 cores
    x = submit(alice, queue, gpus=1, cpu_millicores_per_node=40_000)
    real_advance = lock_phase.advance_epoch
    rival: dict = {}

    def rival_commits_first(expected: int) -> bool:
        if threading.current_thread().name == "cycle-commit" and not rival:

            def worker_b() -> None:  # on a thread of its own: its own connection and transactions
                rival["y"] = submit(alice, queue, gpus=1, cpu_millicores_per_node=40_000, priority=10)
                rival["report"] = run_cycle(SchedulerCache(), pipelined=False)
                connection.close()

            other = threading.Thread(target=worker_b)
            other.start()
            other.join()
        return real_advance(expected)

    monkeypatch.setattr(lock_phase, "advance_epoch", rival_commits_first)
    fenced = aborted("fenced")
    cache = SchedulerCache()
    pipeline = CyclePipeline(cache)
    report = pipeline.run()
    assert report.placed == 1 and report.committing, "X decided, its commit in flight"
    assert pipeline.drain() is report
    assert rival["report"].placed == 1
    assert report.aborted == "fenced" and report.placed == 0 and not report.committing
    assert aborted("fenced") == fenced + 1
    assert cache.snap is None, "the cache is rebuilt from the database"
    assert Job.objects.get(pk=x.pk).state == JobState.PENDING
    assert not JobAttempt.objects.filter(job=x).exists()
    assert Job.objects.get(pk=rival["y"].pk).state == JobState.SCHEDULED

    monkeypatch.setattr(lock_phase, "advance_epoch", real_advance)
    again = run_cycle(cache)
    assert again.ran and not again.aborted and again.placed == 0
    cpu = Allocation.objects.filter(node=node, active=True).aggregate(s=Sum("cpu_millicores"))["s"]
    assert cpu == 40_000, "the node's CPU is never handed out twice"


def test_a_failed_commit_leaves_nothing_and_the_cycle_decided_on_top_of_it_is_dropped(
    alice, queue, monkeypatch
):
    """Cycle 1 decides X and its commit writes everything, then fails before COMMIT. Cycle 2 has
    meanwhile decided Y with X assumed. Neither commits: cycle 2's decisions rested on cycle 1's.
    The next cycles, on a rebuilt cache, place each job once."""
    cluster = make_cluster("sim-a")
    for i in range(2):
        make_node(cluster, gpus=8, name=f"a{i}")
    x = submit(alice, queue, gpus=8, priority=10)
    y = submit(alice, queue, gpus=8)
    real_commit = commit_phase.commit

    def fails_at_the_end(decisions, snap, epoch):
        real_commit(decisions, snap, epoch)
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(commit_phase, "commit", fails_at_the_end)
    connection_aborts, superseded = aborted("connection"), aborted("superseded")
    cache = SchedulerCache()
    pipeline = CyclePipeline(cache, limit=1)
    first = pipeline.run()
    assert first.placed == 1 and first.committing
    second = pipeline.run()
    assert first.aborted == "connection" and first.placed == 0
    assert second.aborted == "superseded" and second.placed == 0 and not second.committing
    assert pipeline.drain() is None, "cycle 2 was never handed on"
    assert aborted("connection") == connection_aborts + 1
    assert aborted("superseded") == superseded + 1
    assert cache.snap is None
    assert set(Job.objects.filter(pk__in=[x.pk, y.pk]).values_list("state", flat=True)) == {JobState.PENDING}
    assert not JobAttempt.objects.exists() and not Allocation.objects.exists()

    monkeypatch.setattr(commit_phase, "commit", real_commit)
    reports = run_cycles(cache, limit=1)
    assert sum(r.placed for r in reports) == 2 and not any(r.aborted or r.lost_races for r in reports)
    assert JobAttempt.objects.filter(job=x).count() == 1 and JobAttempt.objects.filter(job=y).count() == 1
    gpus = list(Allocation.objects.filter(active=True, gpu__isnull=False).values_list("gpu_id", flat=True))
    assert len(gpus) == len(set(gpus)) == 16


def test_back_to_back_cycles_land_in_epoch_order_and_a_rebuild_waits_for_the_commit_in_flight(
    alice, queue, settings, monkeypatch
):
    """Every cycle rebuilds its cache from the database (resync at 0 s) while the previous one's
    commit is slow: the rebuild must not read the database before that commit lands, or it would
    see its job pending and its GPUs free, and place them again."""
    settings.ORRERY_SCHEDULER_RESYNC_S = 0
    cluster = make_cluster("sim-a")
    for i in range(3):
        make_node(cluster, gpus=8, name=f"a{i}")
    jobs = [submit(alice, queue, gpus=8, priority=10 - i) for i in range(4)]
    real_commit = commit_phase.commit

    def slow(decisions, snap, epoch):
        time.sleep(0.3)
        return real_commit(decisions, snap, epoch)

    monkeypatch.setattr(commit_phase, "commit", slow)
    reports = run_cycles(SchedulerCache(), limit=1)
    assert [r.placed for r in reports] == [1, 1, 1, 0], "three nodes, four whole-node jobs"
    assert not any(r.aborted or r.lost_races or r.committing for r in reports)
    attempts = list(JobAttempt.objects.order_by("epoch").values_list("job_id", "epoch"))
    assert [job for job, _ in attempts] == [j.pk for j in jobs[:3]], "each placed once, in order"
    epochs = [epoch for _, epoch in attempts]
    assert epochs == sorted(set(epochs)) and epochs[-1] <= SchedulerState.objects.get().epoch
    gpus = list(Allocation.objects.filter(active=True, gpu__isnull=False).values_list("gpu_id", flat=True))
    assert len(gpus) == len(set(gpus)) == 24
