"""Reads of accounting: the history of finished jobs (``sacct``) and usage totals
(``sreport``).

The history reads ``Job`` through the partial indexes on ``finished_at``
(``job_finished_idx``, ``job_owner_finished_idx``, ``job_project_finished_idx``), newest first,
paged by keyset on ``(finished_at, id)`` so a deep page costs what the first one does. Usage
reads the daily roll-up ``UsageDay`` (``scheduling.services.accounting``), never the jobs.
Both take the rows the caller may see as a queryset (or a ``Q``): who sees what is the portal's
rule, not this module's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

from django.db.models import F, Q, QuerySet, Sum
from django.db.models.functions import TruncMonth, TruncWeek

from scheduling.models import Job, UsageDay

# The columns of a history row, in sacct's spirit; every value is plain JSON.
HISTORY_COLUMNS = (
    "id", "name", "user", "project", "queue", "state", "submitted", "started", "ended", "elapsed",
    "nodes", "gpus", "gpuModel", "gpuHours", "exitCode", "cluster", "attempts",
)  # fmt: skip


@dataclass(frozen=True)
class HistoryQuery:
    """Filters of the history: each tuple is "any of these" (empty: no filter); ``since`` and
    ``until`` bound ``finished_at`` (``since`` inclusive, ``until`` exclusive); ``after`` is the
    keyset position ``(finished_at, id)`` of the last row of the previous page."""

    since: datetime | None = None
    until: datetime | None = None
    users: tuple[str, ...] = ()
    projects: tuple[str, ...] = ()
    queues: tuple[str, ...] = ()
    states: tuple[str, ...] = ()
    clusters: tuple[str, ...] = ()
    gpu_models: tuple[str, ...] = ()
    name: str = ""
    after: tuple[datetime, int] | None = None
    limit: int = 100


_FIELDS = (
    "id", "array_id", "array_index", "name", "owner__username", "project__name", "queue__name", "state",
    "submitted_at", "started_at", "finished_at", "nodes", "gpus_per_node", "gpu_model__slug",
    "gpu_seconds", "exit_code", "ran_on", "attempt_count",
)  # fmt: skip


def job_history(jobs: QuerySet[Job], query: HistoryQuery) -> list[dict[str, Any]]:
    """Up to ``query.limit + 1`` finished jobs of ``jobs`` matching ``query``, newest first, as
    raw rows (``history_row`` turns one into the API's columns). One more row than asked for
    tells the caller there is a next page."""
    rows = jobs.filter(finished_at__isnull=False)
    for values, lookup in (
        (query.users, "owner__username__in"),
        (query.projects, "project__name__in"),
        (query.queues, "queue__name__in"),
        (query.states, "state__in"),
        (query.clusters, "ran_on__in"),
        (query.gpu_models, "gpu_model__slug__in"),
    ):
        if values:
            rows = rows.filter(**{lookup: list(values)})
    if query.name:
        rows = rows.filter(name__startswith=query.name)
    if query.since is not None:
        rows = rows.filter(finished_at__gte=query.since)
    if query.until is not None:
        rows = rows.filter(finished_at__lt=query.until)
    if query.after is not None:
        at, pk = query.after
        # ``finished_at <= at`` alone is what an index range scan uses; the OR breaks ties.
        rows = rows.filter(finished_at__lte=at).filter(Q(finished_at__lt=at) | Q(id__lt=pk))
    return list(rows.order_by("-finished_at", "-id").values(*_FIELDS)[: query.limit + 1])


def history_row(raw: dict[str, Any]) -> dict[str, Any]:
    """One history row in the API's columns (``HISTORY_COLUMNS``); times in ISO 8601, elapsed
    in seconds from the last start to the end (sacct's Elapsed), GPU-hours over all attempts."""
    started, ended = raw["started_at"], raw["finished_at"]
    ref = f"{raw['array_id']}_{raw['array_index']}" if raw["array_id"] is not None else str(raw["id"])
    return {
        "id": ref,
        "name": raw["name"],
        "user": raw["owner__username"],
        "project": raw["project__name"],
        "queue": raw["queue__name"],
        "state": raw["state"],
        "submitted": _iso(raw["submitted_at"]),
        "started": _iso(started),
        "ended": _iso(ended),
        "elapsed": round((ended - started).total_seconds()) if started and ended else 0,
        "nodes": raw["nodes"],
        "gpus": raw["nodes"] * raw["gpus_per_node"],
        "gpuModel": raw["gpu_model__slug"] or "",
        "gpuHours": round(raw["gpu_seconds"] / 3600, 3),
        "exitCode": raw["exit_code"],
        "cluster": raw["ran_on"],
        "attempts": raw["attempt_count"],
    }


def _iso(when: datetime | None) -> str | None:
    return when.isoformat().replace("+00:00", "Z") if when else None


# --- usage ------------------------------------------------------------------------------------

# Group keys of a usage report → the UsageDay expression each reads. Grouping by queue also
# groups by project: a queue's name is only unique within its project.
USAGE_KEYS: dict[str, Any] = {
    "project": F("project__name"),
    "user": F("owner__username"),
    "queue": F("queue__name"),
    "gpuModel": F("gpu_model"),
    "cluster": F("cluster"),
    "state": F("state"),
    "day": F("day"),
    "week": TruncWeek("day"),
    "month": TruncMonth("day"),
}
USAGE_FILTERS: dict[str, str] = {
    "project": "project__name__in",
    "user": "owner__username__in",
    "queue": "queue__name__in",
    "gpuModel": "gpu_model__in",
    "cluster": "cluster__in",
    "state": "state__in",
}


@dataclass(frozen=True)
class UsageQuery:
    """A usage report: the days ``since ≤ day < until`` (a job counts on the day it finished),
    grouped by ``by`` (keys of ``USAGE_KEYS``), filtered by ``filters`` (key of
    ``USAGE_FILTERS`` → any of these values)."""

    since: date
    until: date
    by: tuple[str, ...] = ("project",)
    filters: tuple[tuple[str, tuple[str, ...]], ...] = ()


def usage_report(scope: Q, query: UsageQuery, *, limit: int | None = None) -> list[dict[str, Any]]:
    """Jobs, GPU-seconds and run seconds of the ``UsageDay`` rows in ``scope``, one row per
    group of ``query.by``, sorted by those keys: each has its keys (dates as ISO strings),
    ``jobs``, ``gpuSeconds``, ``gpuHours`` and ``elapsedSeconds``; at most ``limit`` groups.
    One grouped query."""
    rows = UsageDay.objects.filter(scope, day__gte=query.since, day__lt=query.until)
    for key, values in query.filters:
        rows = rows.filter(**{USAGE_FILTERS[key]: list(values)})
    keys = list(query.by)
    if "queue" in keys and "project" not in keys:
        keys.insert(keys.index("queue"), "project")
    grouped = (
        rows.annotate(**{f"k_{k}": USAGE_KEYS[k] for k in keys})
        .values(*(f"k_{k}" for k in keys))
        .annotate(jobs_=Sum("jobs"), gpu_s=Sum("gpu_seconds"), run_s=Sum("elapsed_seconds"))
        .order_by(*(f"k_{k}" for k in keys))
    )
    if limit is not None:
        grouped = grouped[:limit]
    return [
        {
            **{k: _plain(row[f"k_{k}"]) for k in keys},
            "jobs": row["jobs_"],
            "gpuSeconds": row["gpu_s"],
            "gpuHours": round(row["gpu_s"] / 3600, 3),
            "elapsedSeconds": row["run_s"],
        }
        for row in grouped
    ]


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.date().isoformat()
    if isinstance(value, date):
        return value.isoformat()
    return value
