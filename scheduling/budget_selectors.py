"""Reads of GPU-hour budgets: where each stands, and its burn-down from the daily roll-up."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.db.models import Count, F, QuerySet, Sum
from django.utils import timezone

from scheduling.choices import JobState, PendingReason
from scheduling.models import Budget, Job, UsageDay


def budgets_of(project_ids: Iterable[int] | QuerySet[Any], *, ended: bool = False) -> QuerySet[Budget]:
    """The budgets of ``project_ids`` — those whose window has not ended, or all with ``ended`` —
    with their project and queue, by project, the project's own before its queues', newest
    window first; each annotated with
    ``held_jobs``, the project's jobs its budgets hold (for a queue's budget, the queue's)."""
    rows = Budget.objects.filter(project_id__in=project_ids).select_related("project", "queue")
    if not ended:
        rows = rows.filter(ends_at__gt=timezone.now())
    return rows.order_by("project__name", F("queue__name").asc(nulls_first=True), "-starts_at")


def held_counts(budgets: Iterable[Budget]) -> dict[int, int]:
    """Per budget, the jobs held for a budget (reason ``BudgetExhausted``) of its project — for
    a queue's budget, of its queue. One grouped query."""
    budgets = list(budgets)
    held = Job.objects.filter(
        state=JobState.HELD,
        reason=PendingReason.BUDGET_EXHAUSTED,
        project_id__in={b.project_id for b in budgets},
    )
    counts = held.values_list("project_id", "queue_id").annotate(n=Count("pk")).order_by()
    per_queue: dict[int | None, int] = {}
    per_project: dict[int, int] = {}
    for project_id, queue_id, n in counts:
        per_queue[queue_id] = n
        per_project[project_id] = per_project.get(project_id, 0) + n
    return {
        b.pk: per_queue.get(b.queue_id, 0) if b.queue_id else per_project.get(b.project_id, 0)
        for b in budgets
    }


@dataclass(frozen=True)
class BurnDown:
    """One point per day of a budget's window up to today (UTC): the day (midnight, Unix
    seconds), the GPU-hours used that day, what was left at its end, and what the ideal line
    (an even spend across the window) would have left."""

    t: list[int]
    daily: list[float]
    left: list[float]
    ideal: list[float]

    def as_dict(self) -> dict[str, Any]:
        return {"t": self.t, "daily": self.daily, "left": self.left, "ideal": self.ideal}


def burn_down(budget: Budget, now: datetime | None = None) -> BurnDown:
    """The budget's burn-down from ``UsageDay`` (one grouped query over at most one row per day
    and key, never the jobs): what the project — or, for a queue's budget, the queue — used each
    day of the window. The roll-up counts a job on the day it ended, so a day's figure is what
    jobs that ended that day used."""
    now = now or timezone.now()
    first = budget.starts_at.astimezone(UTC).date()
    last = (min(budget.ends_at, now) - timedelta(microseconds=1)).astimezone(UTC).date()
    rows = UsageDay.objects.filter(project_id=budget.project_id, day__gte=first, day__lte=last)
    if budget.queue_id:
        rows = rows.filter(queue_id=budget.queue_id)
    per_day = dict(rows.values_list("day").annotate(s=Sum("gpu_seconds")).order_by())
    window = (budget.ends_at - budget.starts_at).total_seconds()
    limit = float(budget.gpu_hours)
    t, daily, left, ideal = [], [], [], []
    spent = 0.0
    day = first
    while day <= last:
        spent += (per_day.get(day) or 0) / 3600
        end_of_day = min(_midnight(day + timedelta(days=1)), budget.ends_at)
        elapsed = max((end_of_day - budget.starts_at).total_seconds(), 0.0)
        t.append(int(_midnight(day).timestamp()))
        daily.append(round((per_day.get(day) or 0) / 3600, 2))
        left.append(round(limit - spent, 2))
        ideal.append(round(limit * max(1 - elapsed / window, 0.0), 2))
        day += timedelta(days=1)
    return BurnDown(t, daily, left, ideal)


def _midnight(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


def standing(budget: Budget, now: datetime | None = None) -> dict[str, Any]:
    """Where a budget stands, in GPU-hours: its limit, used, reserved, left (never below 0), the
    share used or reserved, and whether its window holds ``now``."""
    now = now or timezone.now()
    limit = budget.gpu_hours * 3600
    left = max(limit - budget.used_gpu_seconds - budget.reserved_gpu_seconds, 0)
    spent = budget.used_gpu_seconds + budget.reserved_gpu_seconds
    return {
        "limit": budget.gpu_hours,
        "used": round(budget.used_gpu_seconds / 3600, 2),
        "reserved": round(budget.reserved_gpu_seconds / 3600, 2),
        "left": round(left / 3600, 2),
        "percent": round(100 * spent / limit, 1) if limit else (100.0 if spent else 0.0),
        "period": "current"
        if budget.starts_at <= now < budget.ends_at
        else ("upcoming" if now < budget.starts_at else "ended"),
    }
