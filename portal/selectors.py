"""Reads of tenancy (memberships, API tokens, projects) and of job lists as the portal shows
them (an array as one row)."""

from __future__ import annotations

from dataclasses import dataclass

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Count, Max, Min, Q, QuerySet

from portal.models import ApiToken, Membership, Project
from scheduling.choices import JobState
from scheduling.models import Job


def memberships(user: AbstractBaseUser) -> QuerySet[Membership]:
    """``user``'s memberships with their projects, by project name."""
    return Membership.objects.filter(user=user).select_related("project").order_by("project__name")


def api_tokens(user: AbstractBaseUser) -> QuerySet[ApiToken]:
    """``user``'s API tokens, revoked and expired ones included, newest first."""
    return ApiToken.objects.filter(user=user).order_by("-created_at")


def with_member_counts(projects: QuerySet[Project]) -> QuerySet[Project]:
    """``projects`` annotated with ``member_count``, in the same query."""
    return projects.annotate(member_count=Count("memberships", distinct=True))


def one_row_per_array(jobs: QuerySet[Job]) -> QuerySet[Job]:
    """``jobs`` with each array standing for itself once: of an array's members among ``jobs``,
    only the first (the lowest id) is kept. Plain jobs are all kept."""
    firsts = (
        jobs.order_by()  # an ordering would join the GROUP BY
        .filter(array_id__isnull=False)
        .values("array_id")
        .annotate(first=Min("id"))
        .values("first")
    )
    return jobs.filter(Q(array_id__isnull=True) | Q(pk__in=firsts))


@dataclass(frozen=True)
class ArraySummary:
    """An array as one row: ``74_[0-99]``, its members' count and how many are in each state
    (in the order of ``JobState``)."""

    array_id: int
    ref: str
    members: int
    states: list[tuple[str, int]]


def array_summaries(array_ids: set[int]) -> dict[int, ArraySummary]:
    """``{array id: ArraySummary}`` for ``array_ids``, over all their members (one query)."""
    if not array_ids:
        return {}
    counts: dict[int, dict[str, int]] = {}
    bounds: dict[int, tuple[int, int]] = {}
    rows = (
        Job.objects.filter(array_id__in=array_ids)
        .values("array_id", "state")
        .annotate(n=Count("id"), lo=Min("array_index"), hi=Max("array_index"))
        .order_by()
    )
    for row in rows:
        counts.setdefault(row["array_id"], {})[row["state"]] = row["n"]
        lo, hi = bounds.get(row["array_id"], (row["lo"], row["hi"]))
        bounds[row["array_id"]] = (min(lo, row["lo"]), max(hi, row["hi"]))
    summaries = {}
    for array_id, by_state in counts.items():
        lo, hi = bounds[array_id]
        span = str(lo) if lo == hi else f"{lo}-{hi}"
        summaries[array_id] = ArraySummary(
            array_id,
            f"{array_id}_[{span}]",
            sum(by_state.values()),
            [(s, by_state[s]) for s in JobState.values if s in by_state],
        )
    return summaries
