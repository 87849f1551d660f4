"""The scheduler under two workers and stalls: caches that agree, cycles that lose a race at
commit, a lock holder that stalls or vanishes, a connection killed under a cycle."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from django.conf import settings as django_settings
from django.db import connection, connections
from prometheus_client import REGISTRY

from scheduling import tasks
from scheduling.choices import EventKind, JobState
from scheduling.engine import cache as cache_module
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import commit as commit_phase
from scheduling.engine.cycle import decide as decide_phase
from scheduling.engine.cycle import lock as lock_phase
from scheduling.engine.cycle import run_cycle
from scheduling.engine.cycle.lock import LOCK_KEY
from scheduling.models import Allocation, Job, JobAttempt, JobEvent, SchedulerState
from scheduling.services.jobs import cancel_job
from tests.factories import make_cluster, make_job, make_node

pytestmark = pytest.mark.django_db

FAR_IDS = 10**9  # explicit job ids, so a set of them iterates in a known order (below)


@pytest.fixture
def one_node(db):
    """One 8-GPU node: any two whole-node jobs want the same GPUs."""
    return make_node(make_cluster("sim-a"), gpus=8, name="a0")


def submit(owner, queue, **fields):
    job = make_job(owner, queue, **fields)
    JobEvent.objects.create(job=job, kind=EventKind.SUBMITTED, to_state=JobState.PENDING)
    return job


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def free_gpus(cache: SchedulerCache, node) -> tuple[int, int]:
    row = cache.snap.row_of[node.pk]
    return int(cache.snap.gpu_free[row]), int(cache.snap.free_bits[row])


def test_a_sync_that_sees_a_release_and_another_workers_placement_keeps_the_gpu_taken(alice, queue, one_node):
    """Worker A holds X on the node; outside A, X ends and worker B places Y on X's GPUs. A's
    next sync reads both, visiting Y before X."""
    y = submit(alice, queue, gpus=8, priority=5, id=FAR_IDS)
    x = submit(alice, queue, gpus=8, priority=10, id=FAR_IDS + 1)
    z = submit(alice, queue, gpus=8, priority=0)
    a = SchedulerCache()
    assert run_cycle(a).placed == 1 and Job.objects.get(pk=x.pk).state == JobState.SCHEDULED
    cancel_job(Job.objects.get(pk=x.pk), actor=alice)
    assert run_cycle(SchedulerCache()).placed == 1  # worker B
    assert Job.objects.get(pk=y.pk).state == JobState.SCHEDULED
    assert next(iter({x.pk, y.pk})) == y.pk, "the sync visits Y first"

    a.sync()
    assert free_gpus(a, one_node) == (0, 0), "Y holds every GPU of the node"
    aborted = sample("orrery_scheduler_cycles_aborted_total", reason="conflict")
    report = run_cycle(a)
    assert report.ran and report.placed == 0
    assert sample("orrery_scheduler_cycles_aborted_total", reason="conflict") == aborted
    assert Job.objects.get(pk=z.pk).state == JobState.PENDING


@pytest.mark.django_db(transaction=True)
def test_a_cycle_that_loses_a_race_at_commit_rolls_back_and_recovers(
    alice, queue, one_node, monkeypatch, caplog
):
    """Between this cycle's sync and its commit another scheduler commits a placement on the
    same GPUs (its own connection, its own transaction): the COPY meets the one-active-
    allocation-per-GPU index. The task returns, the cycle is counted and logged, the cache is
    rebuilt from the database and the next cycle places nothing on the taken GPUs."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite's write lock keeps another writer out of a cycle")
    job = submit(alice, queue, gpus=8)
    rival = make_job(alice, queue, gpus=8, state=JobState.SCHEDULED)
    real_commit = commit_phase.commit

    def rival_commits_first(decisions, snap, epoch):
        def place() -> None:
            attempt = JobAttempt.objects.create(job=rival, number=1, cluster=one_node.cluster, active=True)
            Allocation.objects.bulk_create(
                Allocation(attempt=attempt, job=rival, node=one_node, gpu=gpu) for gpu in one_node.gpus.all()
            )
            connection.close()

        other = threading.Thread(target=place)
        other.start()
        other.join()
        return real_commit(decisions, snap, epoch)

    cache = SchedulerCache()
    monkeypatch.setattr(cache_module, "_cache", cache)
    monkeypatch.setattr(commit_phase, "commit", rival_commits_first)
    before = sample("orrery_scheduler_cycles_aborted_total", reason="conflict")
    with caplog.at_level(logging.WARNING, logger="scheduling.engine.cycle"):
        assert tasks.scheduling_cycle_task() == 0
    assert sample("orrery_scheduler_cycles_aborted_total", reason="conflict") == before + 1
    assert "rolled back: another scheduler's writes won (alloc_one_active_per_gpu)" in caplog.text
    assert cache.snap is None, "the cache is rebuilt from the database"
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING
    assert not JobAttempt.objects.filter(job=job).exists()

    monkeypatch.setattr(commit_phase, "commit", real_commit)
    report = run_cycle(cache)
    assert report.ran and not report.aborted and report.placed == 0
    assert free_gpus(cache, one_node) == (0, 0)


HOLDER = """
import os, signal, sys
import psycopg

with psycopg.connect(sys.argv[1]) as conn:
    conn.execute("SELECT pg_advisory_xact_lock(%s)", [int(sys.argv[2])])
    print(conn.info.backend_pid, flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # a scheduler paused while it holds the lock
    try:  # resumed: what it decided meanwhile must not commit
        conn.execute("UPDATE scheduling_schedulerstate SET epoch = epoch + 1000000 WHERE id = 1")
        conn.commit()
    except psycopg.OperationalError:
        sys.exit(3)
"""


def _dsn() -> str:
    db = django_settings.DATABASES["default"]
    return (
        f"host={db['HOST']} port={db['PORT']} user={db['USER']} password={db['PASSWORD']} dbname={db['NAME']}"
    )


@pytest.mark.django_db(transaction=True)
def test_a_stalled_lock_holder_is_replaced_within_the_bound(
    alice, queue, one_node, settings, caplog, monkeypatch
):
    """Another process takes the cycle's advisory lock in an open transaction and stops
    (SIGSTOP). Cycles skip it (counted, logged once it has held the lock a while) until its
    transaction is older than the stall bound; then a cycle terminates it, says so, and
    places. Resumed, the old holder cannot commit."""
    if connection.vendor != "postgresql":
        pytest.skip("the advisory lock is PostgreSQL's")
    settings.ORRERY_SCHEDULER_STALL_S = 2
    monkeypatch.setattr(lock_phase, "_last_skip_log", 0.0)  # the "skipped" line is rate-limited per process
    cache = SchedulerCache()
    run_cycle(cache)  # a committed cycle: the last-cycle age starts from here
    job = submit(alice, queue, gpus=8)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, _dsn(), str(LOCK_KEY)], stdout=subprocess.PIPE, text=True
    )
    takeovers, skipped = (
        sample("orrery_scheduler_takeovers_total"),
        sample("orrery_scheduler_cycles_skipped_total"),
    )
    ages = []
    try:
        holder_pid = int(holder.stdout.readline())
        os.waitpid(holder.pid, os.WUNTRACED)  # returns once it has stopped
        stalled_at = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="scheduling.engine.cycle"):
            while (report := run_cycle(cache)).ran is False and time.monotonic() - stalled_at < 20:
                ages.append(sample("orrery_scheduler_last_cycle_age_seconds"))
                time.sleep(0.1)
        replaced_after = time.monotonic() - stalled_at
    finally:
        holder.send_signal(signal.SIGCONT)
        returncode = holder.wait(15)
    assert report.ran and report.placed == 1 and not report.aborted
    assert Job.objects.get(pk=job.pk).state == JobState.SCHEDULED
    assert replaced_after < 2 + 5, "replaced within the bound (2 s), give or take a slow machine"
    assert sample("orrery_scheduler_takeovers_total") == takeovers + 1
    assert sample("orrery_scheduler_cycles_skipped_total") > skipped
    assert ages and max(ages) >= 1.0 and sample("orrery_scheduler_last_cycle_age_seconds") < 1.0
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(f"pid {holder_pid} " in m and "terminated and replaced" in m for m in errors), errors
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"cycles skipped: pid {holder_pid} " in m for m in warnings), warnings
    assert returncode == 3, "the old holder's session is gone: nothing it did commits"
    assert SchedulerState.objects.get().epoch < 1_000_000


@pytest.mark.django_db(transaction=True)
def test_a_cycle_whose_connection_is_terminated_recovers_on_the_next_call(
    alice, queue, one_node, monkeypatch
):
    """A takeover (or an operator) terminates this cycle's backend mid-transaction: the cycle
    returns aborted, its connection is dropped, and the next call places on a fresh one."""
    if connection.vendor != "postgresql":
        pytest.skip("pg_terminate_backend is PostgreSQL's")
    job = submit(alice, queue, gpus=8)
    real_decide = decide_phase.decide

    def terminated_meanwhile(*args, **kwargs):
        other = connections.create_connection("default")
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s, 5000)", [connection.connection.info.backend_pid])
        other.close()
        return real_decide(*args, **kwargs)

    monkeypatch.setattr(decide_phase, "decide", terminated_meanwhile)
    cache = SchedulerCache()
    report = run_cycle(cache)
    assert report.ran and report.aborted == "connection" and report.placed == 0
    assert cache.snap is None
    monkeypatch.setattr(decide_phase, "decide", real_decide)
    assert run_cycle(cache).placed == 1
    assert Job.objects.get(pk=job.pk).state == JobState.SCHEDULED


@pytest.mark.django_db(transaction=True)
def test_a_cycle_that_stalls_in_its_transaction_is_cut_by_the_database(
    alice, queue, one_node, settings, monkeypatch
):
    """The cycle's transaction carries the stall bound: a cycle paused past it (here, in its
    decide phase) is ended by PostgreSQL, not left holding the lock; nothing commits and the
    next cycle places."""
    if connection.vendor != "postgresql":
        pytest.skip("the timeouts are PostgreSQL's")
    settings.ORRERY_SCHEDULER_STALL_S = 1
    job = submit(alice, queue, gpus=8)
    real_decide = decide_phase.decide
    seen = {}

    def paused(*args, **kwargs):
        with connection.cursor() as cursor:
            for name in ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout"):
                cursor.execute(f"SHOW {name}")
                seen[name] = cursor.fetchone()[0]
        time.sleep(2.5)
        return real_decide(*args, **kwargs)

    monkeypatch.setattr(decide_phase, "decide", paused)
    cache = SchedulerCache()
    report = run_cycle(cache)
    assert seen == dict.fromkeys(seen, "1s") and len(seen) == 3
    assert report.ran and report.aborted in {"timeout", "connection"} and report.placed == 0
    assert not JobAttempt.objects.filter(job=job).exists()
    monkeypatch.setattr(decide_phase, "decide", real_decide)
    assert run_cycle(cache).placed == 1
