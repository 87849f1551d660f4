"""GPU-hour budgets: the ledger of what each budget has reserved for waiting and running jobs
and what ended jobs used.

A job asks ``nodes × gpus_per_node × time_limit_s`` GPU-seconds. The budgets that apply to it
are its project's (``queue`` null) and its queue's whose window ``[starts_at, ends_at)`` holds
the moment it is admitted; a GPU job without a time limit is refused where any applies, as its
ask could not be counted.

Admission (``reserve``, in ``submit_jobs``' transaction) takes the ask from every budget that
applies with one compare-and-set per budget::

    UPDATE budget SET reserved = reserved + :x
     WHERE id = :id AND used + reserved + :x <= gpu_hours * 3600

so two concurrent submissions can never overspend: the second waits on the first's row lock
and its condition is evaluated again on the committed row. Only when a budget has too little
left does admission lock the budgets and go through the jobs one by one in submission order
(first fit): a refuse-on-overrun budget refuses the whole submission (``BudgetExhausted``), a
hold-on-overrun budget has the jobs that do not fit accepted HELD (reason ``BudgetExhausted``),
reserving nothing.

When a job ends (``settle``, in the transaction that ends it, after ``accounting.record_ends``
has set ``Job.gpu_seconds``) each of its open charges gives its reservation back and charges
what the job used. A requeued or preempted job has not ended: it keeps its reservation.

This module writes budget rows and charges only; it never moves a job (``followups`` calls it
from inside ``transitions``). Releasing held jobs is ``budget_holds``'.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import BigIntegerField, F, OuterRef, Q, QuerySet, Subquery
from django.db.models.functions import Cast
from django.utils import timezone

from foundation.facts import kept
from scheduling.choices import BudgetOverrun
from scheduling.models import Budget, BudgetCharge, Job
from scheduling.spec import SpecError


class BudgetExhausted(Exception):
    """A budget has too little left for what was asked; nothing was created or changed."""


class _Short(Exception):
    """One budget of an all-or-none reservation was short: roll the others back."""


def requested_gpu_seconds(job: Any) -> int:
    """What a job (or a request) asks of a budget: GPUs × time limit, for every node."""
    return job.nodes * job.gpus_per_node * (job.time_limit_s or 0)


def in_force(now: datetime) -> QuerySet[Budget]:
    """Budgets whose window holds ``now``."""
    return Budget.objects.filter(starts_at__lte=now, ends_at__gt=now)


def applying_to(project_id: int, queue_id: int, now: datetime) -> QuerySet[Budget]:
    """The budgets in force for a job of ``project_id`` in ``queue_id``: the project's own and
    the queue's."""
    return in_force(now).filter(project_id=project_id).filter(Q(queue__isnull=True) | Q(queue_id=queue_id))


def may_have_budgets(project_ids: set[int]) -> bool:
    """False only when none of the projects has a budget at all, in any window — known from the
    process's facts of the request's generation (``foundation.facts``); True otherwise."""
    memo = kept()
    if memo is None:
        return True
    if "budgeted-projects" not in memo:
        memo["budgeted-projects"] = frozenset(Budget.objects.values_list("project_id", flat=True).distinct())
    return not memo["budgeted-projects"].isdisjoint(project_ids)


def time_limit_refusal(queue: Any, gpus: int, time_limit_s: int | None) -> str:
    """Why a job of ``gpus`` GPUs per node without a time limit may not go to ``queue`` (a budget
    applies there: its ask could not be counted); "" when it may."""
    if not gpus or time_limit_s is not None or not may_have_budgets({queue.project_id}):
        return ""
    applying = applying_to(queue.project_id, queue.pk, timezone.now())
    found = applying.order_by(F("queue_id").asc(nulls_first=True)).first()  # the project's first
    if found is None:
        return ""
    where = f"queue {queue}" if found.queue_id else f"project {queue.project.name}"
    return f"{where} has a GPU-hour budget; give a time limit"


def hours(seconds: float) -> str:
    """GPU-seconds as GPU-hours for a sentence: ``12.5``, ``1000``, ``0.25``."""
    return f"{seconds / 3600:.2f}".rstrip("0").rstrip(".")


def left_gpu_seconds(budget: Budget) -> int:
    """What is left to reserve (never below zero)."""
    return max(budget.gpu_hours * 3600 - budget.used_gpu_seconds - budget.reserved_gpu_seconds, 0)


def shortfall(budget: Budget, left: int, ask: int, jobs: int = 1) -> str:
    """The sentence for a budget with too little left: "vision has 12.5 of 1000 GPU-hours left
    this period; this job asks 64"."""
    who = f"{budget.project.name}/{budget.queue.name}" if budget.queue_id else budget.project.name
    asks = "this job asks" if jobs == 1 else f"these {jobs} jobs ask"
    return (
        f"{who} has {hours(left)} of {budget.gpu_hours} GPU-hours left this period "
        f"(until {budget.ends_at:%Y-%m-%d %H:%M} UTC); {asks} {hours(ask)}"
    )


def reserve(jobs: Sequence[Job]) -> dict[str, list[int]]:
    """Reserve the requested GPU-hours of just-submitted jobs on the budgets that apply; raises
    ``BudgetExhausted`` to refuse them all, or ``SpecError`` for a GPU job without a time limit;
    returns ``{message: job ids}`` of the jobs to hold instead (they reserve nothing). Must run
    in the transaction that created the jobs."""
    return admit(jobs, on_short=None)


def admit(jobs: Sequence[Job], *, on_short: str | None) -> dict[str, list[int]]:
    """Reserve the asks of ``jobs`` (first fit, in submission order) and record a charge for
    each job on each budget it reserved on. A job short on a budget is refused or held as
    ``on_short`` says (a ``BudgetOverrun`` value), or as the budget's own ``on_overrun`` when it
    is None; a refusal raises ``BudgetExhausted`` and reserves nothing. Returns the held jobs
    ``{message: ids}``."""
    now = timezone.now()
    gpu_jobs = sorted((job for job in jobs if job.gpus_per_node), key=lambda job: job.pk)
    budgeted = gpu_jobs and may_have_budgets({job.project_id for job in gpu_jobs})
    found = _budgets_for(gpu_jobs, now) if budgeted else {}
    if not found:
        return {}
    applies = {job.pk: [pk for pk, b in found.items() if _applies(b, job)] for job in gpu_jobs}
    unlimited = [job for job in gpu_jobs if applies[job.pk] and job.time_limit_s is None]
    if unlimited:
        job = unlimited[0]
        raise SpecError([("spec.timeLimit", time_limit_refusal(job.queue, job.gpus_per_node, None))])
    asks = {job.pk: requested_gpu_seconds(job) for job in gpu_jobs}
    totals: dict[int, int] = defaultdict(int)
    for job in gpu_jobs:
        for budget_id in applies[job.pk]:
            totals[budget_id] += asks[job.pk]
    if not totals:
        return {}
    if _take_all(totals):  # the common case: everything fits, one UPDATE per budget
        _charge(gpu_jobs, applies, asks)
        return {}

    # Some budget is short. Lock the budgets (in id order, as every writer does, so two
    # admissions cannot deadlock) and decide job by job, in submission order.
    locked = {b.pk: b for b in Budget.objects.select_for_update().filter(pk__in=totals).order_by("pk")}
    for budget in locked.values():
        budget.project, budget.queue = found[budget.pk].project, found[budget.pk].queue
    left = {pk: left_gpu_seconds(b) for pk, b in locked.items()}
    before = dict(left)
    taken: dict[int, int] = defaultdict(int)
    admitted: list[Job] = []
    held: dict[str, list[int]] = defaultdict(list)
    for job in gpu_jobs:
        ask = asks[job.pk]
        short = [locked[pk] for pk in applies[job.pk] if ask > left[pk]]
        if not short:
            for pk in applies[job.pk]:
                left[pk] -= ask
                taken[pk] += ask
            admitted.append(job)
            continue
        refusing = [b for b in short if (on_short or b.on_overrun) == BudgetOverrun.REFUSE]
        if refusing:
            budget = refusing[0]
            count = sum(1 for j in gpu_jobs if budget.pk in applies[j.pk])
            raise BudgetExhausted(shortfall(budget, before[budget.pk], totals[budget.pk], count))
        held[shortfall(short[0], left[short[0].pk], ask)].append(job.pk)
    if taken and not _take_all(taken):
        raise RuntimeError("a locked budget changed under its lock")  # cannot happen: a bug
    _charge(admitted, applies, asks)
    return dict(held)


def reserve_released(job_id: int) -> None:
    """Reserve the ask of a job held for its budget that someone releases by hand; raises
    ``BudgetExhausted`` while a budget that applies is still short, whatever its ``on_overrun``:
    a release never bypasses the budget."""
    admit([Job.objects.select_related("queue__project").get(pk=job_id)], on_short=BudgetOverrun.REFUSE)


def settle(job_ids: list[int]) -> None:
    """Replace the reservations of the jobs that just ended with what they used
    (``Job.gpu_seconds``, set by ``accounting.record_ends`` just before): each open charge is
    closed and its budget gets its reservation back and the use charged. Set-based: one
    statement for the charges, one per budget touched. A job that never ran (cancelled while
    waiting) used nothing, so its whole reservation is freed."""
    rows = list(
        BudgetCharge.objects.filter(job_id__in=job_ids, settled=False).values_list(
            "pk", "budget_id", "reserved_gpu_seconds", "job__gpu_seconds"
        )
    )
    if not rows:
        return
    used = Job.objects.filter(pk=OuterRef("job_id")).values("gpu_seconds")[:1]
    BudgetCharge.objects.filter(pk__in=[r[0] for r in rows], settled=False).update(
        settled=True, charged_gpu_seconds=Subquery(used)
    )
    back: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for _, budget_id, reserved, gpu_seconds in rows:
        back[budget_id][0] += reserved
        back[budget_id][1] += gpu_seconds
    for budget_id in sorted(back):  # id order, as admission locks them
        reserved, gpu_seconds = back[budget_id]
        Budget.objects.filter(pk=budget_id).update(
            reserved_gpu_seconds=F("reserved_gpu_seconds") - reserved,
            used_gpu_seconds=F("used_gpu_seconds") + gpu_seconds,
        )


def _budgets_for(jobs: Iterable[Job], now: datetime) -> dict[int, Budget]:
    projects = {job.project_id for job in jobs}
    rows = in_force(now).filter(project_id__in=projects).select_related("project", "queue").order_by("pk")
    return {b.pk: b for b in rows}


def _applies(budget: Budget, job: Job) -> bool:
    return budget.project_id == job.project_id and budget.queue_id in (None, job.queue_id)


def _take_all(amounts: dict[int, int]) -> bool:
    """Take ``amounts`` (budget id → GPU-seconds) from their budgets, all or none: one
    compare-and-set per budget, in id order, inside a savepoint that is rolled back when one is
    short."""
    try:
        with transaction.atomic():
            for budget_id in sorted(amounts):
                if not _take(budget_id, amounts[budget_id]):
                    raise _Short
    except _Short:
        return False
    return True


def _take(budget_id: int, amount: int) -> bool:
    """``UPDATE … SET reserved = reserved + :x WHERE id = :id AND used + reserved + :x <= limit``;
    whether it reserved."""
    limit = Cast("gpu_hours", BigIntegerField()) * 3600  # a large limit overflows a 32-bit product
    fits = Q(used_gpu_seconds__lte=limit - F("reserved_gpu_seconds") - amount)
    added = F("reserved_gpu_seconds") + amount
    return Budget.objects.filter(fits, pk=budget_id).update(reserved_gpu_seconds=added) == 1


def _charge(jobs: Iterable[Job], applies: dict[int, list[int]], asks: dict[int, int]) -> None:
    BudgetCharge.objects.bulk_create(
        BudgetCharge(budget_id=budget_id, job_id=job.pk, reserved_gpu_seconds=asks[job.pk])
        for job in jobs
        for budget_id in applies[job.pk]
    )
