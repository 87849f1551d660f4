"""``GET /api/v1/budgets``: the GPU-hour budgets of the caller's projects and where each stands.

Members, managers and operators read them (operators every project's); nobody sees another
project's budgets, and one that names a project it cannot see gets an empty list, as for a
project that does not exist."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.access import visible_projects
from portal.api.errors import InputError
from portal.api.schema import ERROR_SCHEMA
from portal.api.throttles import ReadThrottle
from scheduling.budget_selectors import budgets_of, held_counts, standing
from scheduling.models import Budget

MAX_BUDGETS = 500


class BudgetListView(APIView):
    """Budgets whose window has not ended (``all=true``: every one), newest window first within
    each project, with the limit, used, reserved and left in GPU-hours."""

    throttle_classes = [ReadThrottle]

    @extend_schema(
        parameters=[
            OpenApiParameter("project", str, description="only this project's budgets"),
            OpenApiParameter("all", bool, description="include budgets whose window has ended"),
        ],
        responses={200: OpenApiTypes.OBJECT, 400: OpenApiResponse(ERROR_SCHEMA)},
    )
    def get(self, request: Request) -> Response:
        projects = visible_projects(request.user)
        if (name := request.query_params.get("project")) is not None:
            projects = projects.filter(name=name[:63])
        flag = request.query_params.get("all", "false").lower()
        if flag not in ("true", "false", "1", "0"):
            raise InputError([("query.all", "must be true or false")])
        budgets = list(budgets_of(projects.values("pk"), ended=flag in ("true", "1"))[:MAX_BUDGETS])
        held = held_counts(budgets)
        return Response({"results": [budget_row(b, held.get(b.pk, 0)) for b in budgets]})


def budget_row(budget: Budget, held: int) -> dict[str, Any]:
    """One budget as the API shows it; amounts in GPU-hours."""
    now = standing(budget)
    return {
        "id": budget.pk,
        "project": budget.project.name,
        "queue": budget.queue.name if budget.queue_id else None,
        "startsAt": budget.starts_at.isoformat(),
        "endsAt": budget.ends_at.isoformat(),
        "period": now["period"],
        "gpuHours": budget.gpu_hours,
        "usedGpuHours": now["used"],
        "reservedGpuHours": now["reserved"],
        "leftGpuHours": now["left"],
        "percentUsed": now["percent"],
        "onOverrun": budget.on_overrun,
        "heldJobs": held,
    }
