"""Accounting endpoints: ``GET /api/v1/accounting/jobs`` (the history of finished jobs, like
``sacct``) and ``GET /api/v1/accounting/usage`` (GPU-hours, jobs and energy grouped over a
period, like ``sreport``), each as JSON or, with ``format=csv`` (or ``Accept: text/csv``), CSV.

Who sees what (portal.access): the history lists the finished jobs you could open in the jobs
list, your own unless ``user`` says otherwise; usage gives members their projects' totals and
their own per-user figures, managers their projects' figures per user, operators everything.
Every bad parameter is a 400 naming ``query.<name>``.
"""

from __future__ import annotations

import base64
import binascii
import csv
import io
import json
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from django.http import Http404, QueryDict
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from foundation.performance import collector_paused
from portal.access import accounting_jobs, usage_scope
from portal.api.errors import InputError
from portal.api.schema import ERROR_SCHEMA
from portal.api.throttles import ReadThrottle
from scheduling.accounting_selectors import (
    HISTORY_COLUMNS,
    USAGE_FILTERS,
    USAGE_KEYS,
    HistoryQuery,
    UsageQuery,
    history_row,
    job_history,
    usage_report,
)
from scheduling.choices import SHORT_CODES, TERMINAL_STATES

DEFAULT_DAYS = 30  # both endpoints look back this far when ``since`` is not given
MAX_USAGE_DAYS = 366
MAX_USAGE_GROUPS = 10_000
MAX_LIMIT = 1000
MEASURES = ("jobs", "gpuHours", "gpuSeconds", "elapsedSeconds", "energyKwh", "energyCost", "co2Kg")
# Totals of a report: its rows summed, rounded as the rows are.
_TOTAL_DIGITS = {"jobs": 0, "gpuSeconds": 0, "elapsedSeconds": 0, "energyKwh": 3, "energyCost": 4, "co2Kg": 3}
ERRORS = {code: OpenApiResponse(ERROR_SCHEMA) for code in (400, 401, 403, 429)}
_TERMINAL_CODES = {SHORT_CODES[s]: s for s in TERMINAL_STATES}


class CsvRenderer(BaseRenderer):
    """Rows (``{"columns": [...], "results": [{...}]}``) as CSV with a header line. Values that
    a spreadsheet would run as a formula are quoted with a leading ``'``."""

    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(
        self, data: Any, accepted_media_type: str | None = None, renderer_context: Any = None
    ) -> bytes:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        columns = data["columns"]
        writer.writerow(columns)
        for row in data["results"]:
            writer.writerow([_cell(row.get(c)) for c in columns])
        return out.getvalue().encode()


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value  # CSV injection: user-chosen names reach spreadsheets
    return value


class AccountingView(APIView):
    """JSON or CSV; an error is always JSON, whatever format was asked for.

    A request runs with the cyclic garbage collector paused: a report of a thousand groups or a
    page of a thousand jobs builds tens of thousands of short-lived, acyclic objects (rows,
    keys, dicts), and while they lived each burst of allocations promoted them towards the
    oldest generation, so every few such requests paid a full collection of the whole heap
    (160–320 ms, most of the slowest requests' time, measured with ``gc.callbacks``).
    Reference counting still frees them when the request ends."""

    throttle_classes = [ReadThrottle]
    renderer_classes = [JSONRenderer, CsvRenderer]

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        with collector_paused():
            return super().dispatch(request, *args, **kwargs)

    def perform_content_negotiation(self, request: Request, force: bool = False) -> Any:
        try:
            return super().perform_content_negotiation(request, force)
        except Http404:  # DRF's answer to an unknown ?format=
            raise InputError([("query.format", "use json or csv")], "Invalid filter.") from None

    def finalize_response(self, request: Request, response: Any, *args: Any, **kwargs: Any) -> Any:
        response = super().finalize_response(request, response, *args, **kwargs)
        if response.status_code >= 400 and isinstance(
            getattr(response, "accepted_renderer", None), CsvRenderer
        ):
            response.accepted_renderer, response.accepted_media_type = JSONRenderer(), "application/json"
        return response


def _csv(request: Request) -> bool:
    return isinstance(request.accepted_renderer, CsvRenderer)


# --- history ----------------------------------------------------------------------------------

HISTORY_PARAMS = [
    OpenApiParameter("user", str, description="comma list of usernames; default: yourself; 'all': everyone"),
    OpenApiParameter("project", str, description="comma list"),
    OpenApiParameter("queue", str, description="comma list"),
    OpenApiParameter("state", str, description="comma list of end states (SUCCEEDED or CD, FAILED or F, …)"),
    OpenApiParameter(
        "since", str, description="ended at or after (ISO 8601 time or date); default: 30 days ago"
    ),
    OpenApiParameter("until", str, description="ended before (ISO 8601 time or date)"),
    OpenApiParameter("cluster", str, description="comma list: where the last attempt ran"),
    OpenApiParameter("gpuModel", str, description="comma list of GPU model slugs"),
    OpenApiParameter("name", str, description="job names starting with this"),
    OpenApiParameter("limit", int, description=f"rows per page, 1–{MAX_LIMIT} (default 100)"),
    OpenApiParameter("cursor", str, description="the position a previous page's 'next' carries"),
    OpenApiParameter("format", str, enum=["json", "csv"]),
]
HISTORY_ROWS = inline_serializer(
    "HistoryRow",
    {
        **{c: serializers.CharField(allow_null=True) for c in HISTORY_COLUMNS},
        **{c: serializers.IntegerField(allow_null=True) for c in ("elapsed", "nodes", "gpus", "exitCode")},
        "attempts": serializers.IntegerField(),
        "gpuHours": serializers.FloatField(),
    },
    many=True,
)


class HistoryView(AccountingView):
    """Finished jobs, newest first, paged by keyset (``next`` carries the cursor)."""

    @extend_schema(
        parameters=HISTORY_PARAMS,
        responses={
            200: inline_serializer(
                "HistoryPage",
                {"next": serializers.CharField(allow_null=True), "results": HISTORY_ROWS},
            ),
            **ERRORS,
        },
    )
    def get(self, request: Request) -> Response:
        query = parse_history(request.query_params, request.user.get_username())
        raw = job_history(accounting_jobs(request.user), query)
        more = len(raw) > query.limit
        raw = raw[: query.limit]
        data: dict[str, Any] = {"next": None, "results": [history_row(r) for r in raw]}
        if more:
            last = raw[-1]
            params = request.query_params.copy()
            params["cursor"] = encode_cursor(last["finished_at"], last["id"])
            data["next"] = request.build_absolute_uri(f"{request.path}?{params.urlencode()}")
        response = Response(data | {"columns": list(HISTORY_COLUMNS)} if _csv(request) else data)
        if more and _csv(request):
            response["Link"] = f'<{data["next"]}>; rel="next"'
        return response


def parse_history(params: QueryDict, username: str) -> HistoryQuery:
    """The history's query from its parameters; ``InputError`` naming each bad one."""
    errors: list[tuple[str, str]] = []
    since = _when(params, "since", errors)
    until = _when(params, "until", errors)
    if since is None and "since" not in params:
        since = timezone.now() - timedelta(days=DEFAULT_DAYS)
    if since and until and until <= since:
        errors.append(("query.until", "must be after since"))
    states: list[str] = []
    for word in _list(params, "state"):
        state = _TERMINAL_CODES.get(word.upper(), word.upper())
        if state in TERMINAL_STATES:
            states.append(state)
        else:
            errors.append(
                (
                    "query.state",
                    f"'{word[:40]}' is not an end state: use SUCCEEDED, FAILED, TIMEOUT, CANCELLED",
                )
            )
    users = _list(params, "user") or [username]
    limit = _int(params, "limit", 100, 1, MAX_LIMIT, errors)
    after = decode_cursor(params["cursor"], errors) if params.get("cursor") else None
    if errors:
        raise InputError(errors, "Invalid filter.")
    return HistoryQuery(
        since=since,
        until=until,
        users=() if users == ["all"] else tuple(users),
        projects=tuple(_list(params, "project")),
        queues=tuple(_list(params, "queue")),
        states=tuple(states),
        clusters=tuple(_list(params, "cluster")),
        gpu_models=tuple(_list(params, "gpuModel")),
        name=params.get("name", "")[:128],
        after=after,
        limit=limit,
    )


def encode_cursor(finished_at: datetime, pk: int) -> str:
    raw = json.dumps([finished_at.isoformat(), pk]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, errors: list[tuple[str, str]]) -> tuple[datetime, int] | None:
    """The keyset position of a cursor; a forged or damaged one is a 400."""
    try:
        at, pk = json.loads(base64.urlsafe_b64decode(cursor[:200] + "=" * (-len(cursor) % 4)))
        when = datetime.fromisoformat(at)
        if when.tzinfo is None or not isinstance(pk, int) or isinstance(pk, bool) or not 0 < pk < 2**63:
            raise ValueError(cursor)
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError, RecursionError):
        errors.append(("query.cursor", "not a cursor this endpoint gave out"))
        return None
    return when, pk


# --- usage ------------------------------------------------------------------------------------

USAGE_PARAMS = [
    OpenApiParameter("by", str, description=f"comma list of {', '.join(USAGE_KEYS)} (default: project)"),
    OpenApiParameter("since", str, description="first day (ISO 8601 date or time); default: 30 days ago"),
    OpenApiParameter(
        "until", str, description=f"end, exclusive (default: now); at most {MAX_USAGE_DAYS} days"
    ),
    *[OpenApiParameter(key, str, description="comma list") for key in USAGE_FILTERS],
    OpenApiParameter("format", str, enum=["json", "csv"]),
]


class UsageView(AccountingView):
    """GPU-hours, GPU-seconds, run seconds, job counts, energy (kWh), its cost and CO₂ (kg)
    over a period, grouped, from the daily roll-up. A job counts on the day it finished (UTC)."""

    @extend_schema(
        parameters=USAGE_PARAMS,
        responses={
            200: inline_serializer(
                "UsageReport",
                {
                    "since": serializers.DateField(),
                    "until": serializers.DateField(),
                    "by": serializers.ListField(child=serializers.CharField()),
                    "results": serializers.ListField(child=serializers.DictField()),
                    "total": serializers.DictField(),
                },
            ),
            **ERRORS,
        },
    )
    def get(self, request: Request) -> Response:
        query = parse_usage(request.query_params)
        rows = usage(request.user, query)
        total = usage_total(rows)
        keys = [k for k in rows[0] if k not in MEASURES] if rows else list(query.by)
        data = {
            "since": query.since.isoformat(),
            "until": query.until.isoformat(),
            "by": keys,
            "results": rows,
            "total": total,
        }
        return Response(data | {"columns": [*keys, *MEASURES]} if _csv(request) else data)


def usage_total(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The measures of ``rows`` summed (GPU-hours from the exact GPU-seconds)."""
    total: dict[str, Any] = {m: round(sum(r[m] for r in rows), d) for m, d in _TOTAL_DIGITS.items()}
    total["gpuHours"] = round(total["gpuSeconds"] / 3600, 3)
    return total


def usage(user: Any, query: UsageQuery) -> list[dict[str, Any]]:
    """The report for ``user``: per-user figures only where they may see them (see the module
    docstring); 400 when it has more groups than one answer carries."""
    per_user = "user" in query.by or any(key == "user" for key, _ in query.filters)
    rows = usage_report(usage_scope(user, per_user=per_user), query, limit=MAX_USAGE_GROUPS + 1)
    if len(rows) > MAX_USAGE_GROUPS:
        raise InputError(
            [("query.by", f"more than {MAX_USAGE_GROUPS} groups: group by less, or shorten the period")],
            "Too many groups.",
        )
    return rows


def parse_usage(params: QueryDict) -> UsageQuery:
    """A usage report's query from its parameters; ``InputError`` naming each bad one."""
    errors: list[tuple[str, str]] = []
    canonical = {k.lower().replace("-", "").replace("_", ""): k for k in USAGE_KEYS}
    by: list[str] = []
    for word in _list(params, "by") or ["project"]:
        key = canonical.get(word.lower().replace("-", "").replace("_", ""))
        if key is None:
            errors.append(("query.by", f"unknown group '{word[:40]}': use {', '.join(USAGE_KEYS)}"))
        elif key not in by:
            by.append(key)
    since_at = _when(params, "since", errors)
    until_at = _when(params, "until", errors)
    today = timezone.now().astimezone(UTC).date()
    until = _day_after(until_at) if until_at else today + timedelta(days=1)
    since = since_at.astimezone(UTC).date() if since_at else until - timedelta(days=DEFAULT_DAYS)
    if since_at and until_at and until <= since:
        errors.append(("query.until", "must be after since"))
    elif (until - since).days > MAX_USAGE_DAYS:
        errors.append(("query.since", f"a report covers at most {MAX_USAGE_DAYS} days"))
    filters = tuple((key, tuple(_list(params, key))) for key in USAGE_FILTERS if _list(params, key))
    if errors:
        raise InputError(errors, "Invalid filter.")
    return UsageQuery(since=since, until=until, by=tuple(by), filters=filters)


def _day_after(until: datetime) -> date:
    """The first day not covered when the period ends at ``until`` (exclusive): a period ending
    at midnight stops before that day, one ending later in a day covers the day."""
    at = until.astimezone(UTC)
    return at.date() if at.time() == time(0) else at.date() + timedelta(days=1)


# --- parameters -------------------------------------------------------------------------------


def _list(params: QueryDict, key: str) -> list[str]:
    return [v.strip() for v in params.get(key, "").split(",") if v.strip()][:100]


def _when(params: QueryDict, key: str, errors: list[tuple[str, str]]) -> datetime | None:
    """An ISO 8601 time (a zone, or UTC when it has none) or a date (its midnight, UTC)."""
    raw = params.get(key, "").strip()
    if not raw:
        return None
    try:
        when = parse_datetime(raw) if len(raw) > 10 else None
        day = None if when else parse_date(raw)
        if day is not None:
            when = datetime.combine(day, time(0), tzinfo=UTC)
        if when is not None and when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        if when is not None:
            when.astimezone(UTC) + timedelta(days=2)  # far enough from the ends of time
            when.astimezone(UTC) - timedelta(days=MAX_USAGE_DAYS + 1)
    except (ValueError, OverflowError):
        when = None
    if when is None:
        errors.append((f"query.{key}", "use a date (2026-11-30) or an ISO 8601 time (2026-11-30T12:00:00Z)"))
    return when


def _int(
    params: QueryDict, key: str, default: int, low: int, high: int, errors: list[tuple[str, str]]
) -> int:
    raw = params.get(key, "").strip()
    if not raw:
        return default
    if raw.isascii() and raw.isdigit() and len(raw) < 8 and low <= int(raw) <= high:
        return int(raw)
    errors.append((f"query.{key}", f"a whole number from {low} to {high}"))
    return default
