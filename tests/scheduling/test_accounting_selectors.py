"""Usage reports read whole months from ``UsageMonth`` and the days around them from the daily
rows (``UsageProjectDay`` when no user is involved, ``UsageDay`` otherwise): whatever the
period and the table, the figures are those of the days it covers."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest
from django.db.models import Q

from scheduling.accounting_selectors import UsageQuery, usage_querysets, usage_report
from scheduling.choices import AttemptState, JobState
from scheduling.models import JobAttempt, UsageDay, UsageMonth, UsageProjectDay
from scheduling.services.accounting import record_ends
from tests.factories import make_cluster, make_job, make_user

ENDS = [date(2026, 8, 31), date(2026, 9, 1), date(2026, 9, 15), date(2026, 10, 10), date(2026, 11, 30),
        date(2026, 12, 1)]  # fmt: skip


@pytest.fixture
def ended(alice, queue):
    """One job ending at noon on each day of ENDS, using 1, 2, 4 … GPU-hours."""
    cluster = make_cluster("sim-a")
    for i, day in enumerate(ENDS):
        end = datetime(day.year, day.month, day.day, 12, tzinfo=UTC)
        job = make_job(alice, queue, gpus=2**i, state=JobState.SUCCEEDED, finished_at=end)
        JobAttempt.objects.create(
            job=job, number=1, cluster=cluster, state=AttemptState.SUCCEEDED, active=False,
            started_at=end - timedelta(hours=1), finished_at=end,
        )  # fmt: skip
        record_ends([job.pk], end)


def hours(days: list[date]) -> float:
    return float(sum(2**i for i, d in enumerate(ENDS) if d in days))


@pytest.mark.parametrize(
    ("since", "until", "parts"),
    [
        (date(2026, 9, 1), date(2026, 12, 1), 1),
        (date(2026, 8, 31), date(2026, 12, 2), 3),
        (date(2026, 9, 2), date(2026, 12, 1), 2),
        (date(2026, 9, 2), date(2026, 11, 30), 3),
        (date(2026, 9, 2), date(2026, 9, 30), 1),
        (date(2026, 8, 1), date(2027, 1, 1), 1),
    ],
    ids=["whole-months", "days-either-side", "days-before", "days-both-ends", "inside-one-month", "all"],
)
def test_a_report_over_any_period_counts_the_days_it_covers(ended, since, until, parts):
    query = UsageQuery(since=since, until=until, by=("project",))
    assert len(usage_querysets(Q(), query)) == parts
    covered = [d for d in ENDS if since <= d < until]
    (row,) = usage_report(Q(), query) or [{"gpuHours": 0.0, "jobs": 0}]
    assert (row["gpuHours"], row["jobs"]) == (hours(covered), len(covered))
    by_day = usage_report(Q(), UsageQuery(since=since, until=until, by=("day",)))
    assert [r["day"] for r in by_day] == [d.isoformat() for d in covered]


def test_months_are_the_sums_of_their_days_and_group_as_months(ended):
    assert sorted(UsageMonth.objects.values_list("month", "jobs")) == [
        (date(2026, 8, 1), 1), (date(2026, 9, 1), 2), (date(2026, 10, 1), 1), (date(2026, 11, 1), 1),
        (date(2026, 12, 1), 1),
    ]  # fmt: skip
    query = UsageQuery(since=date(2026, 8, 31), until=date(2026, 12, 2), by=("month",))
    assert [(r["month"], r["jobs"]) for r in usage_report(Q(), query)] == [
        ("2026-08-01", 1), ("2026-09-01", 2), ("2026-10-01", 1), ("2026-11-01", 1), ("2026-12-01", 1),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("by", "filters", "scope", "daily"),
    [
        (("day", "project"), (), Q(), UsageProjectDay),
        (("project",), (("state", ("SUCCEEDED",)),), Q(project_id__gt=0), UsageProjectDay),
        (("week", "gpuModel", "cluster"), (), Q(), UsageProjectDay),
        (("day", "user"), (), Q(), UsageDay),
        (("project",), (("user", ("alice",)),), Q(), UsageDay),
        (("day", "project"), (), Q(project_id__gt=0) | Q(owner_id=0), UsageDay),
        (("day",), (), Q(owner__username="alice"), UsageDay),
    ],
    ids=["fleet-chart", "filtered", "week", "by-user", "user-filter", "scope-names-owner", "owner-join"],
)
def test_reports_without_a_user_read_the_project_days_and_agree(ended, bob, queue, by, filters, scope, daily):
    """The project days hold the same figures as the user days summed: a report gives the same
    answer from either table (here, with a second user's jobs on the same days)."""
    end = datetime(2026, 9, 15, 18, tzinfo=UTC)
    job = make_job(bob, queue, gpus=3, state=JobState.FAILED, finished_at=end)
    JobAttempt.objects.create(
        job=job, number=1, cluster=make_cluster("sim-b"), state=AttemptState.FAILED, active=False,
        started_at=end - timedelta(hours=2), finished_at=end,
    )  # fmt: skip
    record_ends([job.pk], end)
    query = UsageQuery(since=date(2026, 8, 31), until=date(2026, 12, 2), by=by, filters=filters)
    days = [qs for qs in usage_querysets(scope, query) if qs.model is not UsageMonth]
    assert days and {qs.model for qs in days} == {daily}
    report = usage_report(scope, query)
    assert report
    users = make_user("carol")  # a scope naming an owner reads the per-user days: same figures
    assert usage_report(scope & ~Q(owner_id=users.pk), query) == report
