"""The energy meter: what each attempt's GPUs drew while it held them, with its cost and CO₂.

Every ``ORRERY_ENERGY_METER_S`` (60 s; Celery beat, or the embedded timer) ``meter_energy``
takes one *reading* of every active attempt: the power its GPUs report now, times the time since
its previous reading, added to ``JobAttempt.energy_wh``; the reading's time is stamped in
``energy_at``. The rules:

* **What an allocation draws.** Its GPU's latest power (``GpuDevice.power_w``) times its share
  of that GPU: a whole GPU 1; a MIG instance ``slices / 7`` (A100 and H100 have seven compute
  slices); a fraction of a shared GPU ``gpu_memory_mb / memory_mb`` (at most 1). Only GPUs
  count: CPUs, memory and the rest of the node draw power too, but nodes do not report it per
  job.
* **Stale telemetry counts nothing.** A GPU whose latest reading (``telemetry_at``) is older
  than ``ORRERY_TELEMETRY_STALE_S`` (three telemetry syncs) adds no power: the meter does not
  guess what a silent GPU drew.
* **A gap is not filled.** One reading covers at most ``GAP_PERIODS`` meter periods: after an
  outage of the meter (no worker, no beat), the interval it missed beyond that is lost rather
  than filled with a guess. An attempt's first reading covers the time since it was created
  (when its GPUs were bound), within the same bound.
* **Cost and CO₂** are the reading's kWh times its cluster's ``energy_price_per_kwh`` and
  ``carbon_g_per_kwh`` *at the time of the reading*; a cluster without a price (or intensity)
  adds none.

Each reading is one ``UPDATE`` that adds the energy and stamps ``energy_at`` together, so a
crash counts an interval once or not at all, and a second reading right after the first adds
(almost) nothing: it covers the time since the first. On PostgreSQL it is one set-based
statement for every attempt (``UPDATE … FROM`` the power per attempt, grouped), whose interval
is computed from the row being updated: a reading that waited for another writer's lock reads
the ``energy_at`` that writer left. SQLite (the embedded default) reads in Python and writes
each attempt with a compare-and-set on ``energy_at``.

When an attempt ends (``meter_ends``, in the transaction that ends it, from
``scheduling.services.followups``), its last reading covers the time up to its end, through
the allocations released with it, before accounting reads its energy: nothing of the last
period is lost.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from foundation.sql import is_postgresql, pg_array
from scheduling.models import Allocation, JobAttempt

MIG_SLICES = 7  # compute slices of a whole A100 or H100, what a MIG instance's share is out of
GAP_PERIODS = 3  # one reading covers at most this many meter periods


def meter_energy(now: datetime | None = None) -> int:
    """One reading of every active attempt (see the module docstring); returns how many were
    read. Idempotent in the sense that matters: a reading right after another adds only the
    time between them."""
    now = now or timezone.now()
    return _read(now, ending=None)


def meter_ends(job_ids: list[int], now: datetime) -> int:
    """The last reading of the attempts of ``job_ids`` that ended at ``now``, up to their end,
    from the GPUs they held until then; returns how many were read. Run in the transaction that
    ended them (their ``finished_at`` and their allocations' ``released_at`` are ``now``)."""
    if not job_ids:
        return 0
    return _read(now, ending=job_ids)


def share(mig_slices: int | None, gpu_memory_mb: int, memory_mb: int) -> float:
    """The part of a GPU's power an allocation is charged: a MIG instance's slices of seven, a
    shared fraction's memory of the GPU's (at most the whole), or the whole GPU. A fraction of a
    GPU whose memory is unknown is charged nothing rather than the whole."""
    if mig_slices is not None:
        return mig_slices / MIG_SLICES
    if gpu_memory_mb > 0:
        return min(gpu_memory_mb / memory_mb, 1.0) if memory_mb > 0 else 0.0
    return 1.0


def _read(now: datetime, ending: list[int] | None) -> int:
    """A reading of the active attempts (``ending`` None), or the last reading of the attempts
    of the jobs ``ending`` that ended at ``now``."""
    gap = GAP_PERIODS * float(settings.ORRERY_ENERGY_METER_S)
    fresh_since = now - timedelta(seconds=settings.ORRERY_TELEMETRY_STALE_S)
    if is_postgresql():
        return _read_postgres(now, ending, gap, fresh_since)
    with transaction.atomic():
        return _read_portable(now, ending, gap, fresh_since)


# The attempts a reading covers, and the allocations of each that it counts: every active one,
# or those that ended at ``now`` with what was released at ``now``.
_ACTIVE = ("t.active", "a.active")
_ENDING = (
    "t.job_id = ANY(%(jobs)s::bigint[]) AND NOT t.active AND t.finished_at = %(now)s",
    "a.released_at = %(now)s",
)


def _read_postgres(now: datetime, ending: list[int] | None, gap: float, fresh_since: datetime) -> int:
    attempts, allocations = _ACTIVE if ending is None else _ENDING
    # The interval is reckoned from the row being updated, not from the subquery's snapshot.
    since = "coalesce(t.energy_at, t.created_at)"
    hours = f"greatest(least(extract(epoch FROM %(now)s - {since}), {gap}), 0) / 3600.0"
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            UPDATE scheduling_jobattempt t SET
                energy_wh = t.energy_wh + p.watts * {hours},
                energy_cost = t.energy_cost + p.watts * {hours} / 1000.0 * p.price,
                co2_g = t.co2_g + p.watts * {hours} / 1000.0 * p.carbon,
                energy_at = %(now)s
            FROM (
                SELECT t.id,
                       coalesce(sum(d.power_w * CASE
                           WHEN a.mig_instance_id IS NOT NULL THEN m.slices / {float(MIG_SLICES)}
                           WHEN a.gpu_memory_mb > 0
                               THEN coalesce(least(a.gpu_memory_mb::float8 / nullif(d.memory_mb, 0), 1), 0)
                           ELSE 1 END), 0) AS watts,
                       coalesce(c.energy_price_per_kwh, 0)::float8 AS price,
                       coalesce(c.carbon_g_per_kwh, 0)::float8 AS carbon
                FROM scheduling_jobattempt t
                JOIN clusters_cluster c ON c.id = t.cluster_id
                LEFT JOIN scheduling_allocation a
                    ON a.attempt_id = t.id AND a.gpu_id IS NOT NULL AND {allocations}
                LEFT JOIN clusters_gpudevice d ON d.id = a.gpu_id AND d.telemetry_at >= %(fresh_since)s
                LEFT JOIN clusters_miginstance m ON m.id = a.mig_instance_id
                WHERE {attempts}
                GROUP BY t.id, c.energy_price_per_kwh, c.carbon_g_per_kwh
            ) p
            WHERE t.id = p.id AND {attempts} AND (t.energy_at IS NULL OR t.energy_at < %(now)s)
            """,
            {"now": now, "fresh_since": fresh_since, "jobs": pg_array(ending or ())},
        )
        return cursor.rowcount


def _read_portable(now: datetime, ending: list[int] | None, gap: float, fresh_since: datetime) -> int:
    """The same reading in Python: one read of the attempts, one of their allocations, then a
    compare-and-set per attempt (small fleets only)."""
    if ending is None:
        attempts = JobAttempt.objects.filter(active=True)
        held = Q(active=True)
    else:
        attempts = JobAttempt.objects.filter(job_id__in=ending, active=False, finished_at=now)
        held = Q(released_at=now)
    rows = list(
        attempts.filter(Q(energy_at__isnull=True) | Q(energy_at__lt=now)).values_list(
            "pk", "energy_at", "created_at", "cluster__energy_price_per_kwh", "cluster__carbon_g_per_kwh"
        )
    )
    watts: dict[Any, float] = defaultdict(float)
    gpus = Allocation.objects.filter(held, attempt_id__in=[r[0] for r in rows], gpu__isnull=False)
    columns = ("gpu_memory_mb", "mig_instance__slices", "gpu__memory_mb", "gpu__power_w", "gpu__telemetry_at")
    for attempt_id, memory, slices, gpu_memory, power, seen_at in gpus.values_list("attempt_id", *columns):
        if power is not None and seen_at is not None and seen_at >= fresh_since:
            watts[attempt_id] += power * share(slices, memory, gpu_memory)
    read = 0
    for pk, energy_at, created_at, price, carbon in rows:
        seconds = min(max((now - (energy_at or created_at)).total_seconds(), 0.0), gap)
        wh = watts[pk] * seconds / 3600
        kwh = wh / 1000
        read += JobAttempt.objects.filter(pk=pk, energy_at=energy_at).update(
            energy_wh=F("energy_wh") + wh,
            energy_cost=F("energy_cost") + kwh * float(price or 0),
            co2_g=F("co2_g") + kwh * float(carbon or 0),
            energy_at=now,
        )
    return read
