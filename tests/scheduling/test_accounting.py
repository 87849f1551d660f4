"""Accounting when jobs end: GPU-seconds over every attempt, the cluster of the last one, and the
roll-ups (per user and day, per user and month, per project and day), added to safely by
concurrent transactions."""

from __future__ import annotations

import importlib
import random
import threading
from collections import Counter
from datetime import UTC, date, datetime, timedelta

import pytest
from django.apps import apps
from django.db import connection, connections, transaction

from scheduling.choices import AttemptState, JobState
from scheduling.models import Job, JobAttempt, UsageDay, UsageMonth, UsageProjectDay
from scheduling.services.accounting import add_usage, record_ends
from scheduling.services.allocations import NodePlacement, bind_job
from scheduling.services.transitions import transition_job, transition_jobs
from tests.factories import make_cluster, make_job, make_project, make_queue, make_user

T0 = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)


def attempt(job: Job, number: int, cluster, started: float | None, ended: float) -> JobAttempt:
    """An ended attempt; ``started`` and ``ended`` are minutes after T0 (None: never started)."""
    return JobAttempt.objects.create(
        job=job,
        number=number,
        cluster=cluster,
        state=AttemptState.SUCCEEDED,
        active=False,
        started_at=None if started is None else T0 + timedelta(minutes=started),
        finished_at=T0 + timedelta(minutes=ended),
    )


def end(job: Job, state: str = JobState.SUCCEEDED, at: datetime | None = None) -> None:
    Job.objects.filter(pk=job.pk).update(state=state, finished_at=at or T0 + timedelta(hours=3))


@pytest.fixture
def clusters(db):
    return make_cluster("sim-a"), make_cluster("sim-b")


@pytest.mark.parametrize(
    ("nodes", "gpus", "runs", "gpu_seconds", "ran_on"),
    [
        (1, 1, [("sim-a", 0, 60)], 3600, "sim-a"),
        (2, 4, [("sim-a", 0, 60)], 2 * 4 * 3600, "sim-a"),
        (1, 2, [("sim-a", 0, 30), ("sim-b", 60, 120)], 2 * 90 * 60, "sim-b"),
        (1, 8, [("sim-a", None, 10)], 0, "sim-a"),
        (1, 2, [("sim-a", 0, 30), ("sim-b", None, 40)], 2 * 30 * 60, "sim-b"),
        (1, 0, [("sim-a", 0, 60)], 0, "sim-a"),
        (1, 4, [], 0, ""),
    ],
    ids=[
        "one-gpu-hour",
        "gang",
        "requeued-twice",
        "never-started",
        "last-never-started",
        "cpu-only",
        "no-attempt",
    ],
)
def test_a_job_is_charged_for_every_attempt_that_ran(
    alice, queue, clusters, nodes, gpus, runs, gpu_seconds, ran_on
):
    by_name = {c.name: c for c in clusters}
    job = make_job(alice, queue, nodes=nodes, gpus=gpus)
    for number, (cluster, started, ended) in enumerate(runs, 1):
        attempt(job, number, by_name[cluster], started, ended)
    end(job)
    record_ends([job.pk], T0 + timedelta(hours=3))
    job.refresh_from_db()
    assert (job.gpu_seconds, job.ran_on) == (gpu_seconds, ran_on)
    day = UsageDay.objects.get()
    assert (day.day, day.jobs, day.gpu_seconds, day.cluster) == (T0.date(), 1, gpu_seconds, ran_on)
    assert day.elapsed_seconds == sum(e - s for _, s, e in runs if s is not None) * 60


def test_jobs_of_one_key_add_up_and_other_keys_get_their_own_row(alice, queue, clusters):
    a, b = clusters
    jobs = [make_job(alice, queue, gpus=1) for _ in range(4)]
    for job, cluster in zip(jobs, (a, a, b, a), strict=True):
        attempt(job, 1, cluster, 0, 60)
    for job in jobs[:3]:
        end(job)
    end(jobs[3], JobState.FAILED, at=T0 + timedelta(days=1))
    record_ends([j.pk for j in jobs[:2]], T0)
    record_ends([j.pk for j in jobs[2:]], T0)
    rows = sorted(UsageDay.objects.values_list("day", "cluster", "state", "jobs", "gpu_seconds"))
    assert rows == [
        (T0.date(), "sim-a", "SUCCEEDED", 2, 7200),
        (T0.date(), "sim-b", "SUCCEEDED", 1, 3600),
        (T0.date() + timedelta(days=1), "sim-a", "FAILED", 1, 3600),
    ]


def test_a_job_not_in_a_final_state_is_not_charged(alice, queue, clusters):
    job = make_job(alice, queue, state=JobState.RUNNING)
    attempt(job, 1, clusters[0], 0, 60)
    record_ends([job.pk], T0)
    assert not UsageDay.objects.exists()
    assert Job.objects.get(pk=job.pk).gpu_seconds == 0


def test_ending_through_the_state_machine_records_usage(alice, queue, node):
    running = make_job(alice, queue, gpus=2)
    bind_job(running, [NodePlacement(node, [0, 1])])
    transition_job(running.pk, JobState.RUNNING)
    JobAttempt.objects.filter(job=running).update(started_at=T0 - timedelta(hours=1))
    transition_job(running.pk, JobState.SUCCEEDED, exit_code=0)
    waiting = [make_job(alice, queue) for _ in range(3)]
    transition_jobs([j.pk for j in waiting], JobState.CANCELLED, only_from=JobState.PENDING)

    running.refresh_from_db()
    assert running.ran_on == "sim-a" and running.gpu_seconds >= 2 * 3600
    usage = {r.state: r for r in UsageDay.objects.all()}
    assert usage["SUCCEEDED"].jobs == 1 and usage["SUCCEEDED"].gpu_model == running.gpu_model.slug
    assert (usage["CANCELLED"].jobs, usage["CANCELLED"].gpu_seconds, usage["CANCELLED"].cluster) == (3, 0, "")


def test_thousands_of_ends_take_a_few_statements(alice, queue, clusters, django_assert_max_num_queries):
    jobs = Job.objects.bulk_create(
        Job(owner=alice, project_id=queue.project_id, queue=queue, name=f"j{i}", state=JobState.CANCELLED)
        for i in range(1200)
    )
    JobAttempt.objects.bulk_create(
        JobAttempt(job=j, number=1, cluster=clusters[i % 2], active=False, started_at=T0, finished_at=T0)
        for i, j in enumerate(jobs)
    )
    with django_assert_max_num_queries(8):
        record_ends([j.pk for j in jobs], T0)
    assert sum(UsageDay.objects.values_list("jobs", flat=True)) == 1200
    assert Job.objects.filter(ran_on="sim-b").count() == 600


@pytest.mark.skipif(connection.vendor != "postgresql", reason="two connections at once need PostgreSQL")
@pytest.mark.django_db(transaction=True)
def test_two_transactions_ending_jobs_of_one_key_both_count():
    """The first transaction holds the key's row (uncommitted insert); the second waits on it,
    then adds to it instead of failing on the unique key or overwriting."""
    alice = make_user("alice")
    queue = make_queue(make_project("vision", members=(alice,)))
    cluster = make_cluster("sim-a")
    jobs = [make_job(alice, queue, gpus=1) for _ in range(2)]
    for job in jobs:
        attempt(job, 1, cluster, 0, 60)
        end(job)
    first_wrote, errors = threading.Event(), []

    def first() -> None:
        try:
            with transaction.atomic():
                record_ends([jobs[0].pk], T0)
                first_wrote.set()
                threading.Event().wait(0.3)  # keep the row locked while the second one tries
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            first_wrote.set()
            connections.close_all()

    thread = threading.Thread(target=first)
    thread.start()
    first_wrote.wait(5)
    with transaction.atomic():
        record_ends([jobs[1].pk], T0)
    thread.join(5)
    assert errors == []
    row = UsageDay.objects.get()
    assert (row.jobs, row.gpu_seconds) == (2, 7200)
    row = UsageProjectDay.objects.get()
    assert (row.jobs, row.gpu_seconds) == (2, 7200)


MEASURES = ("jobs", "gpu_seconds", "elapsed_seconds", "energy_wh", "energy_cost", "co2_g")
# What the roll-ups held before energy, all the migration that made the new roll-ups copies.
MEASURES_BEFORE_ENERGY = MEASURES[:3]


def summed(model, key: tuple[str, ...], measures: tuple[str, ...] = MEASURES) -> Counter:
    """``{(key…, measure): total}`` of ``model``'s rows; zeros dropped, so that tables compare."""
    out: Counter = Counter()
    for row in model.objects.values(*key, *measures):
        for m in measures:
            out[(*(row[k] for k in key), m)] += row[m]
    return +out


def project_days_of_users(measures: tuple[str, ...] = MEASURES) -> Counter:
    return summed(UsageDay, ("day", "project_id", "queue_id", "gpu_model", "cluster", "state"), measures)


def months_of_days(measures: tuple[str, ...] = MEASURES) -> Counter:
    out: Counter = Counter()
    key = ("project_id", "queue_id", "owner_id", "gpu_model", "cluster", "state")
    for row in UsageDay.objects.values("day", *key, *measures):
        for m in measures:
            out[(row["day"].replace(day=1), *(row[k] for k in key), m)] += row[m]
    return +out


def random_usage(rng: random.Random, users, queues, n: int) -> list[tuple]:
    """``n`` roll-up rows with distinct keys over two months, three users and two projects."""
    rows = {}
    for _ in range(n):
        queue = rng.choice(queues)
        key = (date(2026, 10, 25) + timedelta(days=rng.randrange(14)), queue.project_id, queue.pk,
               rng.choice(users).pk, rng.choice(["h100", "a100", ""]), rng.choice(["sim-a", "sim-b"]),
               rng.choice([JobState.SUCCEEDED, JobState.FAILED]))  # fmt: skip
        # energy as whole numbers, so that sums compare exactly
        energy = (float(rng.randrange(50_000)), float(rng.randrange(20)), float(rng.randrange(20_000)))
        rows[key] = (rng.randrange(1, 5), rng.randrange(10_000), rng.randrange(5_000), *energy)
    return [(*k, *m) for k, m in rows.items()]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_project_days_and_months_are_the_user_days_summed(db, seed):
    """Batches adding to keys already there and to new ones, in any order: every roll-up stays
    the sum of the daily rows per user."""
    rng = random.Random(seed)
    users = [make_user() for _ in range(3)]
    queues = [make_queue(make_project(), name) for name in ("default", "long")]
    for _ in range(4):
        add_usage(random_usage(rng, users, queues, 60))
    assert UsageProjectDay.objects.count() < UsageDay.objects.count()
    assert summed(UsageProjectDay, ("day", "project_id", "queue_id", "gpu_model", "cluster", "state")) == (
        project_days_of_users()
    )
    assert summed(UsageMonth, ("month", "project_id", "queue_id", "owner_id", "gpu_model", "cluster",
                               "state")) == months_of_days()  # fmt: skip


def test_ending_jobs_of_several_users_adds_them_up_per_project(queue, clusters):
    users = [make_user() for _ in range(3)]
    for i, owner in enumerate(users * 2):
        job = make_job(owner, queue, gpus=i + 1)
        attempt(job, 1, clusters[0], 0, 60)
        end(job)
    record_ends(list(Job.objects.values_list("pk", flat=True)), T0)
    row = UsageProjectDay.objects.get()
    assert (row.jobs, row.gpu_seconds, row.elapsed_seconds) == (6, 21 * 3600, 6 * 3600)
    assert UsageDay.objects.count() == 3


def test_the_migration_fills_the_new_roll_ups_from_the_daily_rows(db):
    rng = random.Random(4)
    users = [make_user() for _ in range(3)]
    queues = [make_queue(make_project(), "default") for _ in range(2)]
    add_usage(random_usage(rng, users, queues, 80))
    UsageMonth.objects.all().delete()
    UsageProjectDay.objects.all().delete()
    importlib.import_module("scheduling.migrations.0009_accounting").roll_ups_from_days(apps, None)
    before = MEASURES_BEFORE_ENERGY
    assert summed(UsageProjectDay, ("day", "project_id", "queue_id", "gpu_model", "cluster", "state"),
                  before) == project_days_of_users(before)  # fmt: skip
    assert summed(UsageMonth, ("month", "project_id", "queue_id", "owner_id", "gpu_model", "cluster",
                               "state"), before) == months_of_days(before)  # fmt: skip


@pytest.mark.skipif(connection.vendor != "postgresql", reason="two connections at once need PostgreSQL")
@pytest.mark.django_db(transaction=True)
def test_concurrent_ends_of_different_users_add_up_in_their_project_day():
    """Two transactions, each ending jobs of two users of one project (their own rows per user,
    shared rows per project and day), listed in opposite orders: the second waits on the rows
    the first holds (both lock keys in sorted order, so neither holds what the other waits for)
    and both count."""
    users = [make_user() for _ in range(4)]
    queue = make_queue(make_project("vision", members=tuple(users)))
    cluster = make_cluster("sim-a")
    jobs = []
    for i, owner in enumerate(users):
        for state in (JobState.SUCCEEDED, JobState.FAILED):
            job = make_job(owner, queue, gpus=1 + i)
            attempt(job, 1, cluster, 0, 60)
            end(job, state)
            jobs.append(job.pk)
    first_ids, second_ids = jobs[:4], jobs[4:][::-1]
    first_wrote, errors = threading.Event(), []

    def first() -> None:
        try:
            with transaction.atomic():
                record_ends(first_ids, T0)
                first_wrote.set()
                threading.Event().wait(0.3)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            first_wrote.set()
            connections.close_all()

    thread = threading.Thread(target=first)
    thread.start()
    first_wrote.wait(5)
    with transaction.atomic():
        record_ends(second_ids, T0)
    thread.join(5)
    assert errors == []
    per_state = {r.state: (r.jobs, r.gpu_seconds) for r in UsageProjectDay.objects.all()}
    assert per_state == {JobState.SUCCEEDED: (4, 10 * 3600), JobState.FAILED: (4, 10 * 3600)}
    assert summed(UsageProjectDay, ("day", "project_id", "queue_id", "gpu_model", "cluster", "state")) == (
        project_days_of_users()
    )
