"""Query-string filters of the job list, validated like any other input (``query.<name>``)."""

from __future__ import annotations

from django.db.models import Q, QuerySet
from django.utils.dateparse import parse_datetime

from portal.api.errors import InputError
from scheduling.choices import SHORT_CODES, JobState
from scheduling.models import Job

JOB_FILTERS = ("state", "project", "queue", "cluster", "user", "name", "submittedAfter", "submittedBefore")
_BY_CODE: dict[str, list[str]] = {}
for _state, _code in SHORT_CODES.items():
    _BY_CODE.setdefault(_code, []).append(_state)


def filter_jobs(jobs: QuerySet[Job], params: dict[str, str]) -> QuerySet[Job]:
    """Apply the job-list filters; unknown values are a 400 naming ``query.<filter>``."""
    errors: list[tuple[str, str]] = []
    if raw := params.get("state"):
        states: set[str] = set()
        for item in raw.split(","):
            word = item.strip().upper()
            if word in JobState.values:
                states.add(word)
            elif word in _BY_CODE:
                states.update(_BY_CODE[word])
            else:
                errors.append(
                    ("query.state", f"unknown state '{item[:40]}'; use e.g. PENDING,RUNNING or PD,R")
                )
        jobs = jobs.filter(state__in=states)
    for key, lookup in (("project", "project__name"), ("queue", "queue__name"), ("user", "owner__username")):
        if raw := params.get(key):
            jobs = jobs.filter(**{f"{lookup}__in": [v.strip() for v in raw.split(",")]})
    if raw := params.get("cluster"):
        jobs = jobs.filter(attempts__cluster__name__in=[v.strip() for v in raw.split(",")]).distinct()
    if raw := params.get("name"):
        jobs = jobs.filter(Q(name=raw) | Q(name__startswith=raw))
    for key, lookup in (("submittedAfter", "submitted_at__gte"), ("submittedBefore", "submitted_at__lt")):
        if raw := params.get(key):
            try:
                when = parse_datetime(raw)
            except ValueError:
                when = None
            if when is None or when.tzinfo is None:
                errors.append((f"query.{key}", "use an ISO 8601 time with a zone, e.g. 2026-11-30T12:00:00Z"))
            else:
                jobs = jobs.filter(**{lookup: when})
    if errors:
        raise InputError(errors, "Invalid filter.")
    return jobs
