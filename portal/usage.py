"""The usage page: GPU-hours per day stacked by project (or by user), and per GPU model, over a
period, with the totals — GPU-hours, energy (kWh), its cost and CO₂ (kg) — as tables. It reads
the same roll-up and follows the same visibility rules as ``GET /api/v1/accounting/usage``
(``portal.api.accounting``); the charts are drawn by ``static/portal/usage.js`` from data the
page carries as JSON."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, QueryDict
from django.shortcuts import render

from portal.access import usage_scope
from portal.api.accounting import parse_usage, usage_total
from portal.api.errors import InputError
from scheduling.accounting_selectors import UsageQuery, usage_report

GROUPS = ("project", "user")
MAX_SERIES = 12  # more groups than this are summed as "other" in the chart (the table has all)
MAX_ROWS = 100_000  # day × group rows read for one chart


@login_required
def usage_page(request: HttpRequest) -> HttpResponse:
    params = request.GET.copy()
    group = params.get("group") if params.get("group") in GROUPS else "project"
    errors: list[tuple[str, str]] = []
    try:
        period = parse_usage(_period(params))
    except InputError as exc:
        errors, period = exc.errors, parse_usage(QueryDict())
    scope = usage_scope(request.user, per_user=group == "user")
    totals = usage_report(scope, _query(period, (group,)))
    models = usage_report(scope, _query(period, ("gpuModel",)))
    chart = {
        "days": _days(period),
        "byGroup": _series(usage_report(scope, _query(period, ("day", group)), limit=MAX_ROWS), group),
        "byModel": _series(
            usage_report(scope, _query(period, ("day", "gpuModel")), limit=MAX_ROWS), "gpuModel"
        ),
    }
    return render(
        request,
        "portal/usage.html",
        {
            "period": period,
            "group": group,
            "groups": GROUPS,
            "errors": errors,
            "totals": totals,
            "models": models,
            "total": usage_total(totals),
            "chart": chart,
        },
    )


def _period(params: QueryDict) -> QueryDict:
    period = QueryDict(mutable=True)
    for key in ("since", "until"):
        if params.get(key):
            period[key] = params[key]
    return period


def _query(period: UsageQuery, by: tuple[str, ...]) -> UsageQuery:
    return UsageQuery(since=period.since, until=period.until, by=by)


def _days(period: UsageQuery) -> list[str]:
    return [(period.since + timedelta(days=i)).isoformat() for i in range((period.until - period.since).days)]


def _series(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, float]]:
    """``{group: {day: GPU-hours}}`` for the largest groups, the rest summed as "other"."""
    per_group: dict[str, dict[str, float]] = {}
    for row in rows:
        name = row[key] or "(none)"
        per_group.setdefault(name, {})[row["day"]] = row["gpuHours"]
    ranked = sorted(per_group, key=lambda g: -sum(per_group[g].values()))
    kept = {g: per_group[g] for g in ranked[:MAX_SERIES]}
    rest = ranked[MAX_SERIES:]
    if rest:
        other: dict[str, float] = {}
        for g in rest:
            for day, hours in per_group[g].items():
                other[day] = round(other.get(day, 0) + hours, 3)
        kept["other"] = other
    return kept
