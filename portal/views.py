"""Server-rendered pages of the portal."""

from __future__ import annotations

from django.db.models import Count
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from clusters.selectors import cluster_summaries
from portal.access import visible_jobs
from scheduling.choices import JobState


def fleet_summary(request: HttpRequest) -> HttpResponse:
    """``/``: the fleet at a glance — clusters, nodes, GPUs by model, and (signed in) your jobs."""
    summaries = cluster_summaries()
    totals: dict[str, int] = {}
    for s in summaries:
        for model, n in s.gpus_by_model.items():
            totals[model] = totals.get(model, 0) + n
    jobs_by_state: dict[str, int] = {}
    if request.user.is_authenticated:
        counts = visible_jobs(request.user).order_by().values("state").annotate(n=Count("id"))
        jobs_by_state = {row["state"]: row["n"] for row in counts}
    context = {
        "summaries": summaries,
        "gpu_totals": sorted(totals.items()),
        "job_states": [(s.value, jobs_by_state.get(s.value, 0)) for s in JobState],
        "nodes_total": sum(s.nodes_total for s in summaries),
        "nodes_ready": sum(s.nodes_ready for s in summaries),
    }
    return render(request, "portal/fleet_summary.html", context)
