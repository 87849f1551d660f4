"""Operators' writes on GPU-hour budgets, and the release of jobs a budget held.

A job a hold-on-overrun budget could not admit waits HELD with reason ``BudgetExhausted``. It
goes back to the queue — reserving its ask, like any admission — as soon as every budget that
applies to it has room: when an operator creates or raises a budget (``create_budget``,
``update_budget``, ``raise_budget``), and on a periodic pass (``release_due``) that covers a new
window starting, a window ending, and reservations freed by jobs that ended using less than
they asked. Held jobs go first come, first served: in submission order, each one that fits
(first fit), so a large job does not stop smaller ones behind it that fit.

The console and every other caller change a budget only through these functions: a plain save
would write back ``used``/``reserved`` as the form read them (losing concurrent reservations)
and would leave held jobs held.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from foundation import audit
from foundation.choices import AuditAction
from scheduling.choices import BudgetOverrun, JobState, PendingReason
from scheduling.models import Budget, Job, Queue
from scheduling.services import budgets
from scheduling.services.transitions import transition_jobs


def create_budget(
    *,
    project: Any,
    queue: Queue | None,
    starts_at: datetime,
    ends_at: datetime,
    gpu_hours: int,
    on_overrun: str = BudgetOverrun.REFUSE,
    actor: AbstractBaseUser | None,
) -> Budget:
    """A new budget; held jobs of its project that fit now are released. Audited."""
    with transaction.atomic():
        budget = Budget.objects.create(
            project=project,
            queue=queue,
            starts_at=starts_at,
            ends_at=ends_at,
            gpu_hours=gpu_hours,
            on_overrun=BudgetOverrun(on_overrun),
        )
        audit.record(
            AuditAction.BUDGET_CREATE,
            actor=actor,
            target=f"budget:{budget.pk}",
            details={"budget": str(budget), "gpuHours": gpu_hours, "onOverrun": on_overrun},
        )
        release_fitting([budget.project_id], actor=actor, message=f"released: budget {budget} opened")
    return budget


def raise_budget(budget: Budget, gpu_hours: int, *, actor: AbstractBaseUser | None) -> list[int]:
    """Set ``budget``'s limit to ``gpu_hours`` and release the held jobs that now fit, in
    submission order; returns their ids. Lowering is allowed too (it only stops admissions:
    nothing already admitted is taken back). Audited."""
    return update_budget(budget, actor=actor, gpu_hours=gpu_hours)


def update_budget(
    budget: Budget,
    *,
    actor: AbstractBaseUser | None,
    gpu_hours: int | None = None,
    ends_at: datetime | None = None,
    on_overrun: str | None = None,
) -> list[int]:
    """Change what an operator may change on a budget — its limit, the end of its window, what
    admission does on overrun — writing those columns only (never ``used``/``reserved``, which
    admissions and job ends keep moving), then release the held jobs that now fit; returns
    their ids. Audited with the old and new values."""
    changes: dict[str, Any] = {}
    if gpu_hours is not None:
        changes["gpu_hours"] = gpu_hours
    if ends_at is not None:
        changes["ends_at"] = ends_at
    if on_overrun is not None:
        changes["on_overrun"] = BudgetOverrun(on_overrun)
    with transaction.atomic():
        current = (
            Budget.objects.select_for_update(of=("self",))
            .select_related("project", "queue")
            .get(pk=budget.pk)
        )
        before = {name: getattr(current, name) for name in changes}
        Budget.objects.filter(pk=budget.pk).update(**changes)
        for name, value in changes.items():
            setattr(budget, name, value)
        audit.record(
            AuditAction.BUDGET_CHANGE,
            actor=actor,
            target=f"budget:{budget.pk}",
            details={"budget": str(current)} | _changed(before, changes),
        )
        limit = changes.get("gpu_hours", current.gpu_hours)
        return release_fitting(
            [current.project_id], actor=actor, message=f"released: budget {current} set to {limit} GPU-hours"
        )


def release_fitting(project_ids: list[int], *, actor: AbstractBaseUser | None, message: str) -> list[int]:
    """Release the jobs of ``project_ids`` held for their budget that fit now, in submission
    order, each reserving its ask; the others stay held with the sentence brought up to date.
    Returns the ids released. One audit entry for the lot."""
    with transaction.atomic():
        held = list(
            Job.objects.select_for_update(of=("self",))
            .filter(project_id__in=project_ids, state=JobState.HELD, reason=PendingReason.BUDGET_EXHAUSTED)
            .select_related("queue__project")
            .order_by("pk")
        )
        if not held:
            return []
        still = budgets.admit(held, on_short=BudgetOverrun.HOLD)
        staying = {pk for ids in still.values() for pk in ids}
        for sentence, ids in still.items():
            Job.objects.filter(pk__in=ids, state=JobState.HELD).update(reason_message=sentence[:512])
        released = sorted(
            transition_jobs(
                [job.pk for job in held if job.pk not in staying],
                JobState.PENDING,
                only_from=JobState.HELD,
                actor=actor,
                reason=PendingReason.NONE,
                message=message,
            )
        )
        if released:
            target = f"job:{released[0]}" if len(released) == 1 else f"jobs:{released[0]}-{released[-1]}"
            audit.record(AuditAction.JOB_RELEASE, actor=actor, target=target, details=audit.capped(released))
        return released


def release_due() -> int:
    """The periodic pass: release the budget-held jobs that fit now, in every project that has
    some (a new window began, an old one ended, or ended jobs gave back part of what they
    reserved). Returns how many were released."""
    projects = sorted(
        set(
            Job.objects.filter(state=JobState.HELD, reason=PendingReason.BUDGET_EXHAUSTED).values_list(
                "project_id", flat=True
            )
        )
    )
    message = "released: its budget has room now"
    return sum(len(release_fitting([project_id], actor=None, message=message)) for project_id in projects)


def _changed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {
        name: {"from": str(before[name]), "to": str(after[name])}
        for name in after
        if before[name] != after[name]
    }
