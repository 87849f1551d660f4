"""Reads of accounting: the history of finished jobs (``sacct``), usage totals (``sreport``),
and a job's energy.

The history reads ``Job`` through the partial indexes on ``finished_at``
(``job_finished_idx``, ``job_owner_finished_idx``, ``job_project_finished_idx``), newest first,
paged by keyset on ``(finished_at, id)`` so a deep page costs what the first one does. Usage
reads the roll-ups (``scheduling.services.accounting``), never the jobs: whole months from
``UsageMonth``, days from ``UsageDay``, or from ``UsageProjectDay`` when the report needs no
user (neither its groups, its filters nor the caller's scope name one).
Both take the rows the caller may see as a queryset (or a ``Q``): who sees what is the portal's
rule, not this module's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Any

from django.db.models import F, Q, QuerySet, Sum
from django.db.models.functions import TruncMonth, TruncWeek

from clusters.models import GpuModel
from scheduling.models import Job, JobAttempt, UsageDay, UsageMonth, UsageProjectDay

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
    return list(history_queryset(jobs, query))


def history_queryset(jobs: QuerySet[Job], query: HistoryQuery) -> QuerySet[Any]:
    """The one query ``job_history`` runs."""
    rows = jobs.filter(finished_at__isnull=False)
    # Names become ids first (tiny lookups), so that the planner sees the values and picks the
    # owner's or the project's index on finished_at instead of filtering the newest jobs of all.
    for key, names, lookup in (
        ("user", query.users, "owner_id__in"),
        ("project", query.projects, "project_id__in"),
        ("queue", query.queues, "queue_id__in"),
        ("gpuModel", query.gpu_models, "gpu_model_id__in"),
    ):
        if names:
            rows = rows.filter(**{lookup: ids_of(key, names)})
    if query.states:
        rows = rows.filter(state__in=query.states)
    if query.clusters:
        rows = rows.filter(ran_on__in=query.clusters)
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
    return rows.order_by("-finished_at", "-id").values(*_FIELDS)[: query.limit + 1]


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


def job_energy(job: Job) -> dict[str, float]:
    """The energy of ``job`` over all its attempts: ``{"kwh", "cost", "co2Kg"}`` (see
    ``attempt_energy``). Reads the attempts prefetched with its placement
    (``scheduling.selectors.jobs_with_placement``, or ``job_placement`` called before); one
    query otherwise."""
    # The prefetched attempts read as they are: through ``job.attempts`` each job made a manager
    # (a class instance per call), a twentieth of a 500-job batch's answer.
    prefetched = getattr(job, "_prefetched_objects_cache", {}).get("attempts")
    return attempt_energy(*(job.attempts.all() if prefetched is None else prefetched))


def attempt_energy(*attempts: JobAttempt) -> dict[str, float]:
    """What ``attempts`` drew, as the meter read it (``scheduling.services.energy``): energy in
    kWh, its cost in the clusters' currency and CO₂ in kg, summed."""
    return {
        "kwh": round(sum(a.energy_wh for a in attempts) / 1000, 4),
        "cost": round(sum(a.energy_cost for a in attempts), 4),
        "co2Kg": round(sum(a.co2_g for a in attempts) / 1000, 4),
    }


def _iso(when: datetime | None) -> str | None:
    return when.isoformat().replace("+00:00", "Z") if when else None


# --- usage ------------------------------------------------------------------------------------

# Group keys of a usage report. Projects, users and queues are grouped by id (integers hash
# faster than joined names) and named afterwards. Grouping by queue also groups by project: a
# queue's name is only unique within its project.
USAGE_KEYS = ("project", "user", "queue", "gpuModel", "cluster", "state", "day", "week", "month")
_COLUMNS = {"project": "project_id", "user": "owner_id", "queue": "queue_id", "gpuModel": "gpu_model"}
USAGE_FILTERS: dict[str, str] = {
    "project": "project_id__in",
    "user": "owner_id__in",
    "queue": "queue_id__in",
    "gpuModel": "gpu_model__in",
    "cluster": "cluster__in",
    "state": "state__in",
}


def _expression(key: str, period: str) -> Any:
    """What a group key reads in a daily roll-up (``period`` "day") or ``UsageMonth`` ("month")."""
    if key == "week":
        return TruncWeek(period)
    if key == "month":
        return F("month") if period == "month" else TruncMonth("day")
    return F(_COLUMNS.get(key, key))


_NAMED = {"project": ("project", "name"), "user": ("owner", "username"), "queue": ("queue", "name")}


def _table(key: str) -> Any:
    """The model a named key points to (``portal.Project`` is reached through the foreign key,
    as ``scheduling`` does not import ``portal``)."""
    return UsageDay._meta.get_field(_NAMED[key][0]).related_model


def ids_of(key: str, names: tuple[str, ...]) -> list[int]:
    """The ids of the projects, users, queues or GPU models (``key`` as in ``USAGE_KEYS``)
    named ``names``; unknown names have none."""
    if key == "gpuModel":
        return list(GpuModel.objects.filter(slug__in=names).values_list("pk", flat=True))
    return list(_table(key).objects.filter(**{f"{_NAMED[key][1]}__in": names}).values_list("pk", flat=True))


def names_of(key: str, ids: set[int]) -> dict[int, str]:
    """Id → name of the projects, users or queues of ``ids``."""
    return dict(_table(key).objects.filter(pk__in=ids).values_list("pk", _NAMED[key][1]))


@dataclass(frozen=True)
class UsageQuery:
    """A usage report: the days ``since ≤ day < until`` (a job counts on the day it finished),
    grouped by ``by`` (keys of ``USAGE_KEYS``), filtered by ``filters`` (key of
    ``USAGE_FILTERS`` → any of these values)."""

    since: date
    until: date
    by: tuple[str, ...] = ("project",)
    filters: tuple[tuple[str, tuple[str, ...]], ...] = ()


# What a report sums over the roll-up rows of a group: the annotation's name, the column.
_SUMS = {
    "jobs_": "jobs",
    "gpu_s": "gpu_seconds",
    "run_s": "elapsed_seconds",
    "wh": "energy_wh",
    "cost": "energy_cost",
    "co2": "co2_g",
}


def usage_report(scope: Q, query: UsageQuery, *, limit: int | None = None) -> list[dict[str, Any]]:
    """Jobs, GPU-seconds, run seconds and energy of the roll-up rows in ``scope``, one row per
    group of ``query.by``, sorted by those keys: each has its keys (dates as ISO strings) and
    the measures of ``usage_measures``; at most ``limit`` groups. One grouped query per part of
    the period (``usage_querysets``), merged here."""
    keys = usage_keys(query)
    merged: dict[tuple[Any, ...], list[float]] = {}
    for part in usage_querysets(scope, query):
        for row in part[:limit] if limit is not None else part:
            measures = merged.setdefault(tuple(_plain(row[f"k_{k}"]) for k in keys), [0] * len(_SUMS))
            for i, name in enumerate(_SUMS):
                measures[i] += row[name] or 0
    names = {k: names_of(k, {group[i] for group in merged}) for i, k in enumerate(keys) if k in _NAMED}
    rows = [
        {
            **{k: names[k].get(group[i], "") if k in names else group[i] for i, k in enumerate(keys)},
            **usage_measures(*sums),
        }
        for group, sums in merged.items()
    ]
    rows.sort(key=lambda row: tuple(row[k] for k in keys))
    return rows[:limit] if limit is not None else rows


def usage_measures(
    jobs: int, gpu_seconds: int, elapsed_seconds: int, energy_wh: float, energy_cost: float, co2_g: float
) -> dict[str, Any]:
    """A report's measures in the API's names and units: ``jobs``, ``gpuSeconds``, ``gpuHours``,
    ``elapsedSeconds``, ``energyKwh``, ``energyCost`` (in the clusters' currency) and ``co2Kg``."""
    return {
        "jobs": jobs,
        "gpuSeconds": gpu_seconds,
        "gpuHours": round(gpu_seconds / 3600, 3),
        "elapsedSeconds": elapsed_seconds,
        "energyKwh": round(energy_wh / 1000, 3),
        "energyCost": round(energy_cost, 4),
        "co2Kg": round(co2_g / 1000, 3),
    }


def usage_keys(query: UsageQuery) -> list[str]:
    """The keys a report groups by: ``query.by``, with the project before a queue."""
    keys = list(query.by)
    if "queue" in keys and "project" not in keys:
        keys.insert(keys.index("queue"), "project")
    return keys


def usage_querysets(scope: Q, query: UsageQuery) -> list[QuerySet[Any]]:
    """The grouped queries of a report: whole months from ``UsageMonth`` and the days around
    them from the daily rows — or only days, when the report is grouped by day or week. The
    daily rows are ``UsageProjectDay``'s (a twentieth of ``UsageDay``'s where a project has
    twenty users) unless the report or ``scope`` needs the user."""
    keys = usage_keys(query)
    per_user = "user" in keys or any(key == "user" for key, _ in query.filters) or _names_owner(scope)
    out = []
    for model, period, since, until in _parts(query):
        if model is UsageDay and not per_user:
            model = UsageProjectDay
        rows = model.objects.filter(scope, **{f"{period}__gte": since, f"{period}__lt": until})
        for key, values in query.filters:
            wanted = ids_of(key, values) if key in _NAMED else list(values)
            rows = rows.filter(**{USAGE_FILTERS[key]: wanted})
        out.append(
            rows.annotate(**{f"k_{k}": _expression(k, period) for k in keys})
            .values(*(f"k_{k}" for k in keys))
            .annotate(**{name: Sum(column) for name, column in _SUMS.items()})
            .order_by()
        )
    return out


def _parts(query: UsageQuery) -> list[tuple[Any, str, date, date]]:
    """(model, period field, since, until) covering ``[query.since, query.until)``."""
    if not {"day", "week"} & set(query.by):
        first = query.since if query.since.day == 1 else _next_month(query.since)
        last = query.until.replace(day=1)
        if first < last:
            parts: list[tuple[Any, str, date, date]] = [(UsageMonth, "month", first, last)]
            if query.since < first:
                parts.append((UsageDay, "day", query.since, first))
            if last < query.until:
                parts.append((UsageDay, "day", last, query.until))
            return parts
    return [(UsageDay, "day", query.since, query.until)]


def _names_owner(scope: Q) -> bool:
    """Whether a condition of ``scope`` may read the owner (``UsageProjectDay`` has none): a
    lookup on it, or any condition that is not a plain lookup."""
    for child in scope.children:
        if isinstance(child, Q):
            if _names_owner(child):
                return True
        elif not isinstance(child, tuple) or child[0].split("__")[0] in ("owner", "owner_id"):
            return True
    return False


def _next_month(day: date) -> date:
    return (day.replace(day=1) + timedelta(days=32)).replace(day=1)


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.date().isoformat()
    if isinstance(value, date):
        return value.isoformat()
    return value
