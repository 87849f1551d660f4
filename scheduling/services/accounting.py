"""Accounting: what finished jobs used, charged once, in the transaction that ends them.

The rule, Slurm's: an attempt is charged from the moment it was seen running (``started_at``)
to its end, times the GPUs it held (a gang holds ``nodes × gpus_per_node``); an attempt that
never started is charged nothing. A job's ``gpu_seconds`` is the sum over all its attempts, so a
requeued or preempted job pays for every run, not only the last; ``ran_on`` is the cluster of its
last attempt. Its energy, energy cost and CO₂ are the sums of what the meter read for each of its
attempts (``scheduling.services.energy``, whose last reading of an attempt runs just before this,
in the same transaction).

The daily roll-up (``UsageDay``) adds each job to the day it finished (UTC): a job that ran
across midnight is counted whole on its last day. Reports over whole days are exact either way;
only a per-day chart shows a long job's hours on the day it ended. Its key is
``(day, project, queue, owner, gpu model, cluster, end state)``.

The same rows are summed by month into ``UsageMonth`` (the key with the month's first day), so
that reports over whole months read a thirtieth of the rows, and over their users into
``UsageProjectDay`` (the key without the owner), which reports over days that neither group nor
filter by user read instead of the rows of every user.

``record_ends`` is set-based (a few statements for any number of jobs) because
``transition_jobs`` may end thousands of jobs at once, and its roll-up is an upsert that adds
(``INSERT … ON CONFLICT DO UPDATE SET x = x + excluded.x``), so two transactions ending jobs of
the same key both count. It is not idempotent: it must run once per job, which holds because a
terminal state has no way out.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

from django.db import connection, models

from scheduling.choices import TERMINAL_STATES
from scheduling.models import Job, JobAttempt, UsageDay, UsageMonth, UsageProjectDay

BATCH = 500  # rows per statement: well under every backend's limit on parameters


@dataclass(frozen=True)
class Charge:
    """What one ended job used: GPU-seconds, run seconds, energy (Wh), its cost and CO₂ (g) over
    all its attempts, and where its last attempt ran."""

    job_id: int
    gpu_seconds: int
    run_seconds: int
    ran_on: str
    energy_wh: float = 0.0
    energy_cost: float = 0.0
    co2_g: float = 0.0


def record_ends(job_ids: list[int], now: datetime) -> None:
    """Charge the jobs of ``job_ids`` that are now in a terminal state: set their
    ``gpu_seconds`` and ``ran_on`` and add them to the daily roll-up. Run once per job, in the
    transaction that ended it (see the module docstring)."""
    if not job_ids:
        return
    jobs = list(
        Job.objects.filter(pk__in=job_ids, state__in=TERMINAL_STATES).values_list(
            "pk", "project_id", "queue_id", "owner_id", "state", "nodes", "gpus_per_node",
            "gpu_model__slug", "finished_at",
        )
    )  # fmt: skip
    if not jobs:
        return
    gpus = {row[0]: row[5] * row[6] for row in jobs}
    charges = charge(gpus, now)
    _write_charges([c for c in charges.values() if c.gpu_seconds or c.ran_on])
    totals: dict[tuple[Any, ...], list[float]] = defaultdict(lambda: [0, 0, 0, 0.0, 0.0, 0.0])
    for pk, project, queue, owner, state, _, _, model, finished_at in jobs:
        c = charges[pk]
        day = (finished_at or now).astimezone(UTC).date()
        measures = totals[(day, project, queue, owner, model or "", c.ran_on, state)]
        for i, value in enumerate((1, c.gpu_seconds, c.run_seconds, c.energy_wh, c.energy_cost, c.co2_g)):
            measures[i] += value
    add_usage([(*key, *measures) for key, measures in totals.items()])


def charge(gpus: dict[int, int], now: datetime) -> dict[int, Charge]:
    """The charge of each job of ``gpus`` (job id → GPUs it holds when running), from its
    attempts, read in one query. An attempt not yet finished is counted up to ``now``."""
    run: dict[int, float] = dict.fromkeys(gpus, 0.0)
    last: dict[int, str] = dict.fromkeys(gpus, "")
    used: dict[int, list[float]] = {pk: [0.0, 0.0, 0.0] for pk in gpus}
    attempts = (
        JobAttempt.objects.filter(job_id__in=list(gpus))
        .order_by("job_id", "number")
        .values_list(
            "job_id", "cluster__name", "started_at", "finished_at", "energy_wh", "energy_cost", "co2_g"
        )
    )
    for job_id, cluster, started_at, finished_at, *energy in attempts:
        last[job_id] = cluster
        if started_at is not None:
            run[job_id] += max(((finished_at or now) - started_at).total_seconds(), 0.0)
        for i, value in enumerate(energy):
            used[job_id][i] += value
    return {
        pk: Charge(pk, round(run[pk] * gpus[pk]), round(run[pk]), last[pk], *used[pk])
        for pk in gpus  # a job that never ran keeps the defaults: 0 and ""
    }


def _write_charges(charges: list[Charge]) -> None:
    """One ``UPDATE … FROM`` a list of values per batch (Django's ``bulk_update`` writes a
    ``CASE`` per row, which grows with the square of the batch)."""
    q = connection.ops.quote_name
    table = q(Job._meta.db_table)
    with connection.cursor() as cursor:
        for start in range(0, len(charges), BATCH):
            batch = charges[start : start + BATCH]
            cursor.execute(
                f"WITH v(id, gpu_seconds, ran_on) AS (VALUES {', '.join(['(%s, %s, %s)'] * len(batch))}) "
                f"UPDATE {table} SET {q('gpu_seconds')} = v.gpu_seconds, {q('ran_on')} = v.ran_on "
                f"FROM v WHERE {table}.{q('id')} = v.id",
                [value for c in batch for value in (c.job_id, c.gpu_seconds, c.ran_on)],
            )


_KEY = ("project_id", "queue_id", "owner_id", "gpu_model", "cluster", "state")
_PROJECT_KEY = ("project_id", "queue_id", "gpu_model", "cluster", "state")
_MEASURES = ("jobs", "gpu_seconds", "elapsed_seconds", "energy_wh", "energy_cost", "co2_g")
UsageRow = tuple[date, int, int, int, str, str, str, int, int, int, float, float, float]


def add_usage(rows: list[UsageRow]) -> None:
    """Add ``rows`` (the key, day first, then the measures of ``_MEASURES``: jobs, GPU-seconds,
    run seconds, energy in Wh, its cost and CO₂ in grams) to ``UsageDay``, summed by month to
    ``UsageMonth`` and summed over users to ``UsageProjectDay``: a new key is inserted, an
    existing one has the measures added. Each key must appear once in ``rows``.

    Django's ``bulk_create`` can only overwrite on conflict, hence the SQL; PostgreSQL and SQLite
    (3.24 and later) both speak it. Rows go in sorted by key, each table in the same order, so
    that two transactions adding to overlapping keys lock them in the same order and cannot
    deadlock."""
    months: dict[tuple[Any, ...], list[float]] = defaultdict(lambda: [0, 0, 0, 0.0, 0.0, 0.0])
    project_days: dict[tuple[Any, ...], list[float]] = defaultdict(lambda: [0, 0, 0, 0.0, 0.0, 0.0])
    for day, project, queue, owner, model, cluster, state, *measures in rows:
        for totals, key in (
            (months, (day.replace(day=1), project, queue, owner, model, cluster, state)),
            (project_days, (day, project, queue, model, cluster, state)),
        ):
            sums = totals[key]
            for i, value in enumerate(measures):
                sums[i] += value
    _upsert(UsageDay, ("day", *_KEY), sorted(rows))
    _upsert(UsageMonth, ("month", *_KEY), sorted((*key, *m) for key, m in months.items()))
    _upsert(UsageProjectDay, ("day", *_PROJECT_KEY), sorted((*key, *m) for key, m in project_days.items()))


def _upsert(model: type[models.Model], key_columns: tuple[str, ...], rows: list[Any]) -> None:
    q = connection.ops.quote_name
    table = q(model._meta.db_table)
    key = ", ".join(q(c) for c in key_columns)
    updates = ", ".join(f"{q(m)} = {table}.{q(m)} + excluded.{q(m)}" for m in _MEASURES)
    one = "(" + ", ".join(["%s"] * (len(key_columns) + len(_MEASURES))) + ")"
    with connection.cursor() as cursor:
        for start in range(0, len(rows), BATCH):
            batch = rows[start : start + BATCH]
            cursor.execute(
                f"INSERT INTO {table} ({key}, {', '.join(q(m) for m in _MEASURES)}) "
                f"VALUES {', '.join([one] * len(batch))} ON CONFLICT ({key}) DO UPDATE SET {updates}",
                [value for row in batch for value in row],
            )
