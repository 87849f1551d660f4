"""The user portal's pages (server-rendered; live parts update over websockets, see
``portal/consumers.py``, and read the REST API with the session)."""

from __future__ import annotations

from datetime import datetime, timedelta
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.db.models import F, Q, QuerySet
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.utils.dateformat import format as format_date
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from clusters.choices import ClusterKind
from clusters.selectors import (
    all_clusters,
    cluster_by_name,
    gpus_with_nodes,
    minute_totals,
    node_state_counts,
)
from foundation.units import clock_text
from portal.access import access_job, can_act_on_job, usable_queues, visible_jobs, visible_projects
from portal.api.errors import InputError
from portal.api.filters import filter_jobs
from portal.api.serializers import reason_sentence
from portal.selectors import array_summaries, one_row_per_array
from scheduling.accounting_selectors import attempt_energy, job_energy
from scheduling.choices import ACTIVE_STATES, TERMINAL_STATES, WAITING_STATES, JobState, PendingReason
from scheduling.models import Job, JobAttempt
from scheduling.selectors import (
    active_cluster_names,
    cluster_jobs,
    fleet_capacity,
    gpus_by_model,
    job_events,
    job_placement,
    node_heatmap,
    queue_gpu_rows,
    recent_jobs,
)
from scheduling.services.jobs import ACTION_SOURCES, OPERATOR_HOLDS, cancel_job
from scheduling.services.transitions import InvalidTransition, TransitionConflict

PAGE = 50
# States in which a job may be writing output (a preempted one may, in its grace period).
OUTPUT_STATES = frozenset({JobState.RUNNING, JobState.COMPLETING, JobState.PREEMPTED})
SORTS = {
    "id": "id",
    "-id": "-id",
    "name": "name",
    "-name": "-name",
    "state": "state",
    "-state": "-state",
    "submitted": "submitted_at",
    "-submitted": "-submitted_at",
    "gpus": "gpus_per_node",
    "-gpus": "-gpus_per_node",
    # Expected start: the soonest first, jobs without an estimate after them.
    "start": F("estimated_start_at").asc(nulls_last=True),
    "-start": F("estimated_start_at").desc(nulls_last=True),
}


@login_required
def dashboard(request: HttpRequest) -> HttpResponse:
    mine = one_row_per_array(visible_jobs(request.user).filter(owner=request.user))
    now = timezone.now()
    running, pending = list(recent_jobs(mine, ACTIVE_STATES)), list(recent_jobs(mine, WAITING_STATES))
    job_rows(running + pending, now)
    queues = list(usable_queues(request.user).order_by("project__name", "name"))
    gpus, _ = queue_gpu_rows(q.pk for q in queues)
    usage = [{"queue": q} | row for q in queues for row in gpus[q.pk]]
    context = {"running": running, "pending": pending, "usage": usage, "free": gpus_by_model()}
    return render(request, "portal/dashboard.html", context)


@login_required
def submit(request: HttpRequest) -> HttpResponse:
    queues = usable_queues(request.user).order_by("project__name", "name")
    return render(
        request,
        "portal/submit.html",
        {"queues": queues, "free": gpus_by_model(), "clusters": all_clusters()},
    )


def _filtered_jobs(request: HttpRequest) -> tuple[QuerySet[Job], dict[str, str], bool]:
    """The API's job filters (``state`` takes names or short codes), plus a search box (a name,
    a user, a job id or an array member's ``74_3``), "mine", one array's members (``array``)
    and a sort. An array is one row unless its members are asked for (``array``, or a search
    for an id): the last value says whether arrays are. A filter the API would refuse is said
    on the page, and left out."""
    keys = ("state", "project", "queue", "q", "sort", "mine", "array")
    params = {k: request.GET.get(k, "").strip() for k in keys}
    jobs = visible_jobs(request.user).select_related("owner", "project", "queue", "gpu_model")
    try:
        jobs = filter_jobs(jobs, {k: params[k] for k in ("state", "project", "queue")})
    except InputError as exc:
        messages.error(request, "; ".join(f"{path}: {why}" for path, why in exc.errors))
    if params["mine"]:
        jobs = jobs.filter(owner=request.user)
    array, ref = _job_id(params["array"]), _job_ref(params["q"])
    if array is not None:
        jobs = jobs.filter(array_id=array)
    if q := params["q"]:
        match = Q(name__icontains=q) | Q(owner__username__iexact=q)
        if ref is not None:
            job_id, index = ref
            if index is None:
                match |= Q(pk=job_id) | Q(array_id=job_id)
            else:
                match |= Q(array_id=job_id, array_index=index)
        jobs = jobs.filter(match)
    as_arrays = array is None and ref is None
    if as_arrays:
        jobs = one_row_per_array(jobs)
    return jobs.order_by(SORTS.get(params["sort"], "-id"), "-id"), params, as_arrays


@login_required
def jobs(request: HttpRequest) -> HttpResponse:
    found, params, as_arrays = _filtered_jobs(request)
    page = Paginator(found, PAGE).get_page(request.GET.get("page"))
    rows = job_rows(list(page.object_list), timezone.now(), as_arrays=as_arrays)
    context = {
        "page": page,
        "rows": rows,
        "params": params,
        "states": JobState.values,
        "projects": visible_projects(request.user).order_by("name").values_list("name", flat=True),
        "query": urlencode({k: v for k, v in params.items() if v and k != "sort"}),
    }
    return render(request, "portal/jobs.html", context)


def job_rows(rows: list[Job], now: datetime, *, as_arrays: bool = True) -> list[Job]:
    """``rows`` with what a list shows of each: the cluster it runs on, the time it has used
    (``running`` when that still grows), its GPUs, why it waits and when it would start. With
    ``as_arrays``, an array's member stands for its array (``array``: an ``ArraySummary``)."""
    clusters = active_cluster_names(job.pk for job in rows)
    arrays = array_summaries({j.array_id for j in rows if j.array_id is not None}) if as_arrays else {}
    for job in rows:
        job.array = arrays.get(job.array_id)
        job.cluster_name = clusters.get(job.pk, "")
        job.running = job.started_at is not None and job.state in ACTIVE_STATES
        end = job.finished_at or now
        job.time_used = clock_text((end - job.started_at).total_seconds()) if job.started_at else ""
        job.gpus_total = job.gpus_per_node * job.nodes
        job.gpu_label = gpu_label(job)
        job.shown_reason = shown_reason(job)
        job.estimate = start_estimate(job, now)
    return rows


def shown_reason(job: Job) -> str:
    """The reason a list shows for a job: why it waits (or was preempted), "" when it has none
    worth a word (``None``: the scheduler has not looked at it yet)."""
    explained = job.state in WAITING_STATES | {JobState.PREEMPTED}
    return job.reason if explained and job.reason != PendingReason.NONE else ""


@login_required
@require_POST
def bulk_cancel(request: HttpRequest) -> HttpResponse:
    ids = [i for i in map(_job_id, request.POST.getlist("job")) if i is not None][:1000]
    done = refused = 0
    for job in visible_jobs(request.user).filter(pk__in=ids):
        if not can_act_on_job(request.user, job):
            refused += 1
            continue
        try:
            cancel_job(job, actor=request.user)
            done += 1
        except (InvalidTransition, TransitionConflict):
            refused += 1
    messages.info(
        request, f"Cancelled {done} job(s)" + (f"; {refused} could not be cancelled." if refused else ".")
    )
    return redirect(_same_site(request, request.POST.get("next")) or "jobs")


def _same_site(request: HttpRequest, url: str | None) -> str | None:
    """``url`` when it stays on this site (a path, or this host over this scheme), else None:
    a ``next`` pointing elsewhere would make the portal an open redirect."""
    allowed = url_has_allowed_host_and_scheme(
        url, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    )
    return url if allowed else None


@login_required
def job_detail(request: HttpRequest, pk: int) -> HttpResponse:
    job = access_job(request.user, pk)  # another project's job is a 404
    placement = job_placement(job)
    allowed = can_act_on_job(request.user, job)
    context = {
        "job": job,
        "attempt": placement.attempt if placement else None,
        "placement": placement.nodes if placement else {},
        "gpus": gpus_with_nodes(placement.gpu_ids if placement else []),
        "events": job_events(job),
        "why": reason_sentence(job),
        "estimate": start_estimate(job, timezone.now()),
        "gpu_label": gpu_label(job),
        "actions": [
            a
            for a, states in ACTION_SOURCES.items()
            if allowed
            and job.state in states
            and not (a == "release" and job.reason in OPERATOR_HOLDS and not request.user.is_staff)
        ],
        "action_sources": {a: sorted(states) for a, states in ACTION_SOURCES.items()},
        "output_notes": output_notes(job, placement.attempt if placement else None),
        "output_phases": OUTPUT_PHASES,
        # read from the attempts job_placement prefetched: no query of its own
        "energy": job_energy(job) if placement else None,
        "energy_by_attempt": _energy_by_attempt(job) if placement else [],
    }
    context["output_note"] = context["output_notes"][OUTPUT_PHASES[job.state]]
    return render(request, "portal/job.html", context)


def _energy_by_attempt(job: Job) -> list[tuple[int, dict[str, float]]]:
    """``[(attempt number, its energy)]`` when the job ran more than once (a requeue, a
    preemption); empty otherwise, as the job's total says it all."""
    attempts = list(job.attempts.all())
    return [(a.number, attempt_energy(a)) for a in attempts] if len(attempts) > 1 else []


# Where a job is in its life, for what its output box says while there is no output.
OUTPUT_PHASES = {
    state: "ended" if state in TERMINAL_STATES else "running" if state in OUTPUT_STATES else "waiting"
    for state in JobState.values
}


def output_notes(job: Job, attempt: JobAttempt | None) -> dict[str, str]:
    """What a job's output box says while it shows no output: per phase (``waiting``,
    ``running``, ``ended``), for this job — on a simulated cluster nothing runs, so no output is
    ever kept; a job that ended before it started has none."""
    if attempt is not None and attempt.cluster.kind == ClusterKind.SIMULATED:
        kept = f"No output is kept for simulated jobs: {attempt.cluster.name} is a simulated cluster."
        return {"waiting": "No output yet: the job has not started.", "running": kept, "ended": kept}
    ended = (
        "The job ended without writing any output."
        if job.started_at or attempt
        else "The job ended before it started: there is no output."
    )
    return {"waiting": "No output yet: the job has not started.", "running": "No output yet.", "ended": ended}


@login_required
def clusters(request: HttpRequest) -> HttpResponse:
    capacity = fleet_capacity()
    jobs = cluster_jobs()
    cards = [
        {
            "cluster": c,
            "nodes": capacity.nodes.get(c.pk, {"total": 0, "ready": 0}),
            "gpus": capacity.gpus.get(c.pk, []),
            "running": jobs.running.get(c.pk, 0),
            "pending": jobs.pinned.get(c.name, 0),
        }
        for c in all_clusters()
    ]
    return render(request, "portal/clusters.html", {"cards": cards, "pending": jobs.waiting})


@login_required
def cluster_detail(request: HttpRequest, name: str) -> HttpResponse:
    cluster = cluster_by_name(name)
    if cluster is None:
        raise Http404("No such cluster.")
    capacity = fleet_capacity([cluster.pk])
    context = {
        "cluster": cluster,
        "nodes_summary": capacity.nodes.get(cluster.pk, {"total": 0, "ready": 0}),
        "gpus": capacity.gpus.get(cluster.pk, []),
        "states": node_state_counts(cluster),
    }
    return render(request, "portal/cluster.html", context)


@login_required
def fleet(request: HttpRequest) -> HttpResponse:
    return render(request, "portal/fleet.html", {"clusters": all_clusters()})


@login_required
def fleet_data(request: HttpRequest) -> JsonResponse:
    """Every node in compact columns for the heatmap: id, name, cluster,
    state, GPUs, GPUs held, mean GPU utilisation. ``?cluster=NAME`` narrows it. For 10,000 nodes:
    409 KiB, about 80 ms on PostgreSQL."""
    heatmap = node_heatmap(request.GET.get("cluster"))
    return JsonResponse(
        {
            "id": heatmap.ids,
            "name": heatmap.names,
            "cluster": heatmap.clusters,
            "state": heatmap.states,
            "gpus": heatmap.gpus,
            "held": heatmap.held,
            "util": [None if u is None else round(u) for u in heatmap.util],
        }
    )


@login_required
def fleet_series(request: HttpRequest) -> JsonResponse:
    """One-minute roll-ups of the last ``hours`` (default 6): allocation, utilisation, power."""
    raw = request.GET.get("hours", "6")
    hours = min(max(int(raw), 1), 24) if raw.isascii() and raw.isdigit() and len(raw) < 4 else 6
    since = timezone.now() - timedelta(hours=hours)
    minutes = minute_totals(since, request.GET.get("cluster"))
    rows = [minutes[t] for t in sorted(minutes)]
    return JsonResponse(
        {
            "t": sorted(minutes),
            "allocated": [
                round(100 * m.gpus_allocated / m.gpus_total, 1) if m.gpus_total else 0 for m in rows
            ],
            "utilisation": [round(m.utilization_sum / m.samples, 1) if m.samples else 0 for m in rows],
            "power_kw": [
                round(m.power_w_sum / m.samples * m.gpus_total / 1000, 1) if m.samples else 0 for m in rows
            ],
        }
    )


@login_required
def queues(request: HttpRequest) -> HttpResponse:
    rows = list(usable_queues(request.user).order_by("project__name", "name"))
    gpus, counts = queue_gpu_rows(q.pk for q in rows)
    table = []
    for q in rows:
        for g in gpus[q.pk]:
            nominal = g["quota"]
            g["borrowed"] = max(g["used"] - nominal, 0) if nominal is not None else 0
            g["share"] = round(100 * g["used"] / nominal) if nominal else None
        jobs = counts.get(q.pk) or {}
        table.append(
            {
                "queue": q,
                "gpus": gpus[q.pk],
                "pending": jobs.get("PENDING", 0),
                "held": jobs.get("HELD", 0),
                "running": sum(jobs.get(s, 0) for s in ACTIVE_STATES),
            }
        )
    return render(request, "portal/queues.html", {"table": table})


def start_estimate(job: Job, now: datetime) -> str:
    """ "Would start ≈ 14:20 UTC on sim-b: node-3 — reserved" for a waiting job the scheduler has
    an estimate for (the date too when it is not today), else ""."""
    if job.state not in WAITING_STATES or job.estimated_start_at is None:
        return ""
    at = timezone.localtime(job.estimated_start_at)
    when = format_date(at, "H:i T" if at.date() == timezone.localtime(now).date() else "M j, H:i T")
    where = f" on {job.estimated_where}" if job.estimated_where else ""
    kind = "reserved" if job.reserved else "an estimate, not a reservation"
    return f"Would start ≈ {when}{where} — {kind}"


def gpu_label(job: Job) -> str:
    """The GPU model of a job: the one it named or was placed on, else the models an any-model
    request allows ("any of h100-80g, a100-80g", "any model")."""
    if job.gpu_model is not None:
        return job.gpu_model.slug
    if not job.gpus_per_node:
        return ""
    models = (job.placement or {}).get("gpuModels") or []
    return f"any of {', '.join(map(str, models))}" if models else "any model"


def _job_id(text: str) -> int | None:
    """A job id typed or posted by a user, or None (ASCII digits only, within a bigint)."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def _job_ref(text: str) -> tuple[int, int | None] | None:
    """A job as users write it: ``74`` → (74, None), array member ``74_3`` → (74, 3); None for
    anything else."""
    job, _, index = text.strip().partition("_")
    if _job_id(job) is None or (index and _job_id(index) is None):
        return None
    return _job_id(job), _job_id(index) if index else None
