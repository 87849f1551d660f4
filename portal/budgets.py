"""The portal's budgets page: for each GPU-hour budget of the user's projects, where it stands
(limit, used, reserved, left) and its burn-down across the window. Read-only for everyone:
members and managers see their projects' budgets, operators every project's; operators set
and raise budgets in the console."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from portal.access import visible_projects
from scheduling.budget_selectors import budgets_of, burn_down, held_counts, standing


@login_required
def budget_list(request: HttpRequest) -> HttpResponse:
    """``?all=1`` includes budgets whose window has ended."""
    ended = request.GET.get("all") == "1"
    budgets = list(budgets_of(visible_projects(request.user).values("pk"), ended=ended)[:200])
    held = held_counts(budgets)
    now = timezone.now()
    rows = [
        {
            "budget": b,
            "standing": standing(b, now),
            "held": held.get(b.pk, 0),
            "series_id": f"burndown-{b.pk}",
            "series": burn_down(b, now).as_dict() if b.starts_at <= now else None,
        }
        for b in budgets
    ]
    return render(request, "portal/budget_list.html", {"rows": rows, "ended": ended})
