"""The operations console's own pages: the landing page of fleet health and the scheduler's
status. The rest of the console is the Django admin of each app."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.core.cache import cache
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path

from clusters.selectors import cluster_state_counts, node_state_counts
from scheduling.choices import ACTIVE_STATES, WAITING_STATES
from scheduling.engine.cycle import RECENT_CYCLES_KEY
from scheduling.engine.policies import active_profile
from scheduling.selectors import gpus_by_model, job_state_counts, scheduler_state, waiting_reasons


class OrreryAdminSite(admin.AdminSite):
    site_header = "Orrery operations"
    site_title = "Orrery"
    index_title = "Fleet, jobs and projects"

    def get_urls(self) -> list[URLPattern]:
        return [
            path("scheduler/", self.admin_view(self.scheduler_view), name="scheduler"),
            *super().get_urls(),
        ]

    def index(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        return super().index(request, {"health": fleet_health(), **(extra_context or {})})

    def scheduler_view(self, request: HttpRequest) -> HttpResponse:
        state = scheduler_state()
        profile = active_profile()
        context = self.each_context(request) | {
            "title": "Scheduler",
            "state": state,
            "cycles": list(reversed(cache.get(RECENT_CYCLES_KEY) or [])),
            "pending": waiting_reasons(),
            "profile": profile,
        }
        return TemplateResponse(request, "admin/scheduler.html", context)


def fleet_health() -> dict[str, Any]:
    models = gpus_by_model()
    gpus = {key: sum(m[key] for m in models) for key in ("total", "free", "allocated")}
    gpus["unhealthy"] = sum(m["total"] - m["healthy"] for m in models)
    state = scheduler_state()
    return {
        "clusters": cluster_state_counts(),
        "nodes": node_state_counts(),
        "gpus": gpus,
        "jobs": job_state_counts(WAITING_STATES | ACTIVE_STATES),
        "last_cycle": state.last_cycle_at if state else None,
    }
