"""Celery under faults, with real workers, beat, PostgreSQL and Redis: a flood in one role, a Redis
restart (on a private redis-server), stale periodic work, and database connections cut."""

from __future__ import annotations

import re
import time
from datetime import datetime
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from portal.celery import app
from scheduling.choices import EventKind, JobState
from scheduling.models import Job, JobEvent
from tests.factories import make_cluster, make_job, make_node, make_project, make_queue, make_user
from tests.processes import (
    PrivateRedis,
    Service,
    celery_beat_argv,
    celery_worker_argv,
    control_plane_env,
    forget_queues,
    queued_tasks,
    wait,
)

pytestmark = pytest.mark.django_db(transaction=True)
FLUSH = "clusters.tasks.flush_heartbeats_task"
CYCLE = "scheduling.tasks.scheduling_cycle_task"
STAMP = re.compile(r"^\[([-\d]+ [:\d]+,\d+): INFO/\w+\] Task (\S+)\[[^\]]+\] succeeded", re.M)


def submit() -> Job:
    """A pending one-GPU job as submission leaves it (the row and its 'submitted' event)."""
    user = make_user()
    job = make_job(user, make_queue(make_project(members=(user,))), gpus=1)
    JobEvent.objects.create(job=job, kind=EventKind.SUBMITTED, to_state=JobState.PENDING)
    return job


def placed(job: Job) -> bool:
    return Job.objects.get(pk=job.pk).state != JobState.PENDING


def succeeded(log: Path, task: str) -> list[float]:
    """When the worker logging to ``log`` (at INFO) finished each run of ``task``."""
    return [
        datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for stamp, name in STAMP.findall(log.read_text())
        if name == task
    ]


@pytest.mark.django_db
def test_every_task_has_a_role():
    """A task without a route would land on the default queue, which a role's workers may not serve."""
    app.loader.import_default_modules()
    apps = ("clusters", "scheduling", "portal", "foundation")
    ours = {name for name in app.tasks if name.split(".")[0] in apps}
    assert ours and ours <= set(settings.CELERY_TASK_ROUTES), ours - set(settings.CELERY_TASK_ROUTES)
    roles = {route["queue"].rsplit(".", 1)[1] for route in settings.CELERY_TASK_ROUTES.values()}
    assert roles <= set(settings.ORRERY_CELERY_ROLES)


@pytest.fixture
def fleet():
    return make_node(make_cluster(), gpus=8)


def test_a_flood_of_ingest_work_never_starves_scheduling(tmp_path, fleet):
    env = control_plane_env(tmp_path)
    ingest_argv = celery_worker_argv(env, tmp_path, roles=("ingest",), beat=False)
    ingest = Service(ingest_argv, env, tmp_path / "ingest.log")
    log = tmp_path / "scheduling.log"
    scheduler = Service(celery_worker_argv(env, tmp_path, roles=("scheduling",), loglevel="INFO"), env, log)
    try:
        scheduler.start()
        wait(lambda: succeeded(log, CYCLE), "the scheduling worker's first cycle", timeout=90)
        with app.producer_or_acquire() as producer:
            for _ in range(20_000):
                app.send_task(FLUSH, queue=f"{env['ORRERY_CELERY_QUEUE']}.ingest", producer=producer)
        ingest.start()
        wait(lambda: len(queued_tasks(env, ("ingest",))) < 19_900, "the ingest worker to be busy", timeout=90)
        job = submit()
        wait(lambda: placed(job), "the job to be placed during the flood", timeout=30)
        # Placed while thousands of ingest passes still wait: scheduling never queued behind them.
        assert len(queued_tasks(env, ("ingest",))) > 1_000
    finally:
        ingest.stop()
        scheduler.stop()
        forget_queues(env)


def test_workers_and_beat_outlive_a_redis_restart_and_resume_within_seconds(tmp_path, fleet):
    redis = PrivateRedis(tmp_path).start()
    env = control_plane_env(tmp_path, REDIS_URL=redis.url)
    log = tmp_path / "worker.log"
    worker = Service(celery_worker_argv(env, tmp_path, loglevel="INFO"), env, log)
    try:
        worker.start()
        wait(lambda: succeeded(log, CYCLE), "the first scheduling cycle", timeout=60)
        redis.stop()
        # Down long enough for Celery's own back-off (2, 4, 6, 8 … s between tries) to reach
        # 8 s steps: its next try comes up to 8 s after Redis is back.
        time.sleep(21)
        job = submit()  # waits through the outage
        redis.start()
        back = time.time()
        after = wait(lambda: [t for t in succeeded(log, CYCLE) if t > back], "a cycle after Redis", 60)
        recovery_s = min(after) - back
        print(f"Redis back to first task consumed: {recovery_s:.2f} s")
        assert worker.process.poll() is None, log.read_text()[-3000:]
        assert recovery_s <= 6, recovery_s  # one reconnect try a second, then beat's next tick
        wait(lambda: placed(job), "the job submitted during the outage to be placed", timeout=30)
    finally:
        worker.stop()
        redis.stop()


def test_periodic_work_queued_while_no_worker_runs_expires_instead_of_running(tmp_path):
    env = control_plane_env(tmp_path)
    beat = Service(celery_beat_argv(env, tmp_path), env, tmp_path / "beat.log")
    log = tmp_path / "worker.log"
    worker = Service(celery_worker_argv(env, tmp_path, beat=False, loglevel="INFO"), env, log)
    try:
        beat.start()
        wait(lambda: queued_tasks(env).count(CYCLE) >= 6, "a backlog of scheduling cycles", timeout=90)
        beat.stop()
        stale = queued_tasks(env)
        worker.start()
        wait(lambda: not queued_tasks(env), "the worker to empty its queues", timeout=60)
        text = log.read_text()
        # Every 1 s and 2 s pass had expired by the time the worker started: none of them ran.
        assert not succeeded(log, CYCLE) and not succeeded(log, FLUSH), text[-3000:]
        assert text.count(f"Discarding revoked task: {CYCLE}") == stale.count(CYCLE)
    finally:
        beat.stop()
        worker.stop()
        forget_queues(env)


@pytest.mark.skipif(not settings.DATABASES["default"]["ENGINE"].endswith("postgresql"), reason="PostgreSQL")
def test_a_worker_recovers_when_its_database_connections_are_terminated(tmp_path, fleet):
    env = control_plane_env(tmp_path)
    log = tmp_path / "worker.log"
    worker = Service(celery_worker_argv(env, tmp_path, loglevel="INFO"), env, log)
    try:
        worker.start()
        first = submit()
        wait(lambda: placed(first), "the first job to be placed", timeout=60)
        with connection.cursor() as cursor:  # what a database failover or restart does to a worker
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            assert cursor.fetchone()[0] >= 1
        cut = time.time()
        second = submit()
        wait(lambda: placed(second), "a job to be placed after the connections were cut", timeout=30)
        later = wait(lambda: [t for t in succeeded(log, CYCLE) if t > cut], "the cycle's log line", 10)
        errors = log.read_text().count(" raised ")
        print(f"first cycle after the connections were cut: {min(later) - cut:.2f} s; tasks failed: {errors}")
        assert worker.process.poll() is None
    finally:
        worker.stop()
