"""Reads of the scheduling app."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection
from django.db.models import (
    Avg,
    Count,
    F,
    Max,
    Min,
    OuterRef,
    Prefetch,
    Q,
    QuerySet,
    Subquery,
    Sum,
    prefetch_related_objects,
)

from clusters.choices import GpuHealth, NodeState
from clusters.models import GpuDevice, GpuModel, Node
from scheduling.choices import ACTIVE_STATES, WAITING_STATES, JobState, PendingReason
from scheduling.models import Allocation, Job, JobAttempt, JobEvent, JobLog, QueueQuota, SchedulerState


def busy_node_ids(node_ids: Iterable[int]) -> set[int]:
    """The nodes among ``node_ids`` that hold at least one active allocation."""
    return set(
        Allocation.objects.filter(node_id__in=list(node_ids), active=True)
        .values_list("node_id", flat=True)
        .distinct()
    )


def last_release_times(node_ids: Iterable[int]) -> dict[int, datetime]:
    """``{node id: when its last allocation was released}`` for the nodes among ``node_ids``
    that ever held work (power saving: how long a node has been idle)."""
    rows = (
        Allocation.objects.filter(node_id__in=list(node_ids), active=False)
        .values_list("node_id")
        .annotate(at=Max("released_at"))
        .order_by()
    )
    return dict(rows)


def waiting_gpu_demand() -> dict[int, int]:
    """``{GPU model id: GPUs wanted by pending jobs that wait for free resources}`` (power
    saving powers nodes of those models up). Jobs that may take any model are not counted."""
    rows = (
        Job.objects.filter(state=JobState.PENDING, reason=PendingReason.RESOURCES, gpu_model__isnull=False)
        .values_list("gpu_model_id")
        .annotate(gpus=Sum(F("nodes") * F("gpus_per_node")))
        .order_by()
    )
    return {model: gpus for model, gpus in rows if gpus}


@dataclass(frozen=True)
class FleetCapacity:
    """Nodes per cluster (``{"total", "ready"}``) and GPUs per cluster and model
    (``[{"model", "total", "healthy", "allocated", "free"}]``); free = healthy GPUs on ready
    nodes that no active allocation holds: what a job could start on now."""

    nodes: dict[int, dict[str, int]]
    gpus: dict[int, list[dict[str, Any]]]


def fleet_capacity(cluster_ids: Iterable[int] | None = None) -> FleetCapacity:
    """Three grouped queries, whatever the size of the fleet."""
    nodes_q, devices_q, allocs_q = (
        Node.objects.all(),
        GpuDevice.objects.all(),
        Allocation.objects.filter(active=True),
    )
    if cluster_ids is not None:
        ids = list(cluster_ids)
        nodes_q = nodes_q.filter(cluster_id__in=ids)
        devices_q = devices_q.filter(node__cluster_id__in=ids)
        allocs_q = allocs_q.filter(node__cluster_id__in=ids)
    nodes: dict[int, dict[str, int]] = {}
    for row in nodes_q.values("cluster_id").annotate(
        total=Count("id"), ready=Count("id", filter=Q(state=NodeState.READY))
    ):
        nodes[row["cluster_id"]] = {"total": row["total"], "ready": row["ready"]}

    usable = Q(health=GpuHealth.HEALTHY, node__state=NodeState.READY)
    per_model: dict[tuple[int, str], dict[str, Any]] = {}
    for row in devices_q.values("node__cluster_id", "model__slug").annotate(
        total=Count("id"),
        healthy=Count("id", filter=Q(health=GpuHealth.HEALTHY)),
        usable=Count("id", filter=usable),
    ):
        per_model[(row["node__cluster_id"], row["model__slug"])] = {
            "model": row["model__slug"],
            "total": row["total"],
            "healthy": row["healthy"],
            "allocated": 0,
            "free": row["usable"],
        }
    held_usable = Q(gpu__health=GpuHealth.HEALTHY, node__state=NodeState.READY)
    for row in (
        allocs_q.filter(gpu__isnull=False)
        .values("node__cluster_id", "gpu__model__slug")
        .annotate(n=Count("id"), on_usable=Count("id", filter=held_usable))
    ):
        entry = per_model.get((row["node__cluster_id"], row["gpu__model__slug"]))
        if entry is not None:
            entry["allocated"] = row["n"]
            entry["free"] -= row["on_usable"]
    gpus: dict[int, list[dict[str, Any]]] = {}
    for (cluster_id, _), entry in sorted(per_model.items()):
        gpus.setdefault(cluster_id, []).append(entry)
    return FleetCapacity(nodes, gpus)


def queue_usage(queue_ids: Iterable[int]) -> tuple[dict[int, dict[str, int]], dict[int, dict[str, int]]]:
    """``(gpus held per queue and model, jobs per queue and state)`` for the given queues."""
    ids = list(queue_ids)
    held: dict[int, dict[str, int]] = {}
    for row in (
        Allocation.objects.filter(active=True, gpu__isnull=False, job__queue_id__in=ids)
        .values("job__queue_id", "gpu__model__slug")
        .annotate(n=Count("id"))
    ):
        held.setdefault(row["job__queue_id"], {})[row["gpu__model__slug"]] = row["n"]
    jobs: dict[int, dict[str, int]] = {}
    for row in (
        Job.objects.filter(queue_id__in=ids, state__in=list(WAITING_STATES | ACTIVE_STATES))
        .values("queue_id", "state")
        .annotate(n=Count("id"))
        .order_by()
    ):
        jobs.setdefault(row["queue_id"], {})[row["state"]] = row["n"]
    return held, jobs


def queue_gpu_rows(
    queue_ids: Iterable[int],
) -> tuple[dict[int, list[dict[str, Any]]], dict[int, dict[str, int]]]:
    """Per queue, one row per GPU model it has a quota for or holds — ``{"model", "quota",
    "borrowingLimit", "used"}`` — and its jobs per state. ``quota`` is None when the queue has no
    quota at all (the scheduler does not limit it), 0 for a model a limited queue has none of."""
    ids = list(queue_ids)
    held, jobs = queue_usage(ids)
    quotas: dict[int, dict[str, tuple[int, int | None]]] = {}
    for queue_id, slug, gpus, limit in QueueQuota.objects.filter(queue_id__in=ids).values_list(
        "queue_id", "gpu_model__slug", "gpus", "borrowing_limit"
    ):
        quotas.setdefault(queue_id, {})[slug] = (gpus, limit)
    rows: dict[int, list[dict[str, Any]]] = {}
    for queue_id in ids:
        quota, used = quotas.get(queue_id, {}), held.get(queue_id, {})
        rows[queue_id] = [
            {
                "model": slug,
                "quota": quota[slug][0] if slug in quota else (0 if quota else None),
                "borrowingLimit": quota[slug][1] if slug in quota else None,
                "used": used.get(slug, 0),
            }
            for slug in sorted(set(quota) | set(used))
        ]
    return rows, jobs


def gpus_by_model() -> list[dict[str, Any]]:
    """The fleet's GPUs per model, summed over clusters: ``{"model", "total", "healthy",
    "allocated", "free"}`` (free as in ``FleetCapacity``)."""
    totals: dict[str, dict[str, Any]] = {}
    for entries in fleet_capacity().gpus.values():
        for e in entries:
            t = totals.setdefault(
                e["model"], {"model": e["model"], "total": 0, "healthy": 0, "allocated": 0, "free": 0}
            )
            for key in ("total", "healthy", "allocated", "free"):
                t[key] += e[key]
    return [totals[m] for m in sorted(totals)]


def _placement_prefetch() -> Prefetch:
    # A fresh Prefetch per call: Django rewrites nested lookups of a Prefetch in place.
    allocations = Allocation.objects.select_related("node", "gpu")
    attempts = (
        JobAttempt.objects.select_related("cluster")
        .prefetch_related(Prefetch("allocations", queryset=allocations))
        .order_by("number")
    )
    return Prefetch("attempts", queryset=attempts)


def jobs_with_placement(jobs: QuerySet[Job]) -> QuerySet[Job]:
    """``jobs`` with what ``job_placement`` reads prefetched: two more queries per page of jobs,
    not per job."""
    return jobs.prefetch_related(_placement_prefetch())


def jobs_by_id(job_ids: Iterable[int]) -> QuerySet[Job]:
    """These jobs by id, with owner, project, queue and GPU model, and placement prefetched."""
    jobs = Job.objects.select_related("owner", "project", "queue", "gpu_model")
    return jobs_with_placement(jobs.filter(pk__in=list(job_ids)).order_by("id"))


@dataclass(frozen=True)
class JobPlacement:
    """Where a job's latest attempt runs or ran: the attempt (with its cluster), per node name
    the indices of the GPUs it holds there (nodes by name, indices ascending; empty for a node
    where it holds no GPU), and the ids of those GPUs."""

    attempt: JobAttempt
    nodes: dict[str, list[int]]
    gpu_ids: list[int]


def job_placement(job: Job) -> JobPlacement | None:
    """The placement of ``job``'s latest attempt, None before its first. Reads what
    ``jobs_with_placement`` prefetched; on a job without it, fetches it (two queries)."""
    if "attempts" not in getattr(job, "_prefetched_objects_cache", {}):
        # Building the Prefetch is four querysets: a 500-job answer paid 30 ms for nothing.
        prefetch_related_objects([job], _placement_prefetch())
    attempts = list(job._prefetched_objects_cache["attempts"])  # ordered by number
    if not attempts:
        return None
    attempt = attempts[-1]
    nodes: dict[str, list[int]] = {}
    gpu_ids: list[int] = []
    for allocation in attempt.allocations.all():
        indices = nodes.setdefault(allocation.node.name, [])
        if allocation.gpu is not None:
            indices.append(allocation.gpu.index)
            gpu_ids.append(allocation.gpu_id)
    return JobPlacement(attempt, {name: sorted(nodes[name]) for name in sorted(nodes)}, gpu_ids)


def job_events(job: Job) -> QuerySet[JobEvent]:
    """A job's history in order, with the acting user and the attempt."""
    return job.events.select_related("actor", "attempt").order_by("id")


def recent_jobs(jobs: QuerySet[Job], states: Iterable[str], limit: int = 20) -> QuerySet[Job]:
    """The newest ``limit`` of ``jobs`` in one of ``states``, with project and queue."""
    return jobs.filter(state__in=states).select_related("project", "queue").order_by("-id")[:limit]


def active_cluster_names(job_ids: Iterable[int]) -> dict[int, str]:
    """``{job id: name of the cluster its active attempt is on}``; jobs without one are absent."""
    return dict(
        JobAttempt.objects.filter(job__in=list(job_ids), active=True).values_list("job_id", "cluster__name")
    )


@dataclass(frozen=True)
class ClusterJobs:
    """Running jobs per cluster id; waiting jobs per cluster name, for those that name clusters
    (a waiting job belongs to no cluster unless it names some); all waiting jobs."""

    running: dict[int, int]
    pinned: dict[str, int]
    waiting: int


def cluster_jobs() -> ClusterJobs:
    """Three queries, whatever the number of jobs and clusters."""
    running = dict(
        JobAttempt.objects.filter(active=True, job__state__in=ACTIVE_STATES)
        .values("cluster_id")
        .annotate(n=Count("id"))
        .values_list("cluster_id", "n")
    )
    waiting = Job.objects.filter(state__in=WAITING_STATES)
    pinned: dict[str, int] = {}
    for placement in waiting.exclude(placement__clusters=[]).values_list("placement", flat=True):
        for name in (placement or {}).get("clusters") or ():
            pinned[name] = pinned.get(name, 0) + 1
    return ClusterJobs(running, pinned, waiting.count())


def job_state_counts(states: Iterable[str]) -> list[dict[str, Any]]:
    """``[{"state", "n"}]``: jobs per state among ``states``, by state."""
    return list(
        Job.objects.filter(state__in=list(states)).values("state").annotate(n=Count("id")).order_by("state")
    )


def waiting_reasons() -> list[dict[str, Any]]:
    """``[{"state", "reason", "n"}]``: pending and held jobs per reason, the commonest first."""
    return list(
        Job.objects.filter(state__in=[JobState.PENDING, JobState.HELD])
        .values("state", "reason")
        .annotate(n=Count("id"))
        .order_by("-n")
    )


def scheduler_state() -> SchedulerState | None:
    """The scheduler's one state row (epoch, last cycle), None before the first cycle."""
    return SchedulerState.objects.first()


@dataclass(frozen=True)
class NodeHeatmap:
    """Every node in columns, one entry per node in the same order: id, name, cluster name,
    state, GPUs, GPUs held by active allocations, mean utilisation of its reporting GPUs (None
    when none reports)."""

    ids: list[int]
    names: list[str]
    clusters: list[str]
    states: list[str]
    gpus: list[int]
    held: list[int]
    util: list[float | None]


def node_heatmap(cluster_name: str | None = None) -> NodeHeatmap:
    """The nodes of one cluster or of the fleet, by cluster and name. Three queries; for 10,000
    nodes about 80 ms on PostgreSQL."""
    nodes = Node.objects.order_by("cluster_id", "name")
    if cluster_name:
        nodes = nodes.filter(cluster__name=cluster_name)
    rows = list(nodes.values_list("pk", "name", "cluster__name", "state", "gpu_capacity"))
    held = dict(
        Allocation.objects.filter(active=True, gpu__isnull=False)
        .values("node_id")
        .annotate(n=Count("id"))
        .values_list("node_id", "n")
    )
    util = dict(
        GpuDevice.objects.filter(utilization__isnull=False)
        .values("node_id")
        .annotate(mean=Avg("utilization"))
        .values_list("node_id", "mean")
    )
    return NodeHeatmap(
        ids=[r[0] for r in rows],
        names=[r[1] for r in rows],
        clusters=[r[2] for r in rows],
        states=[r[3] for r in rows],
        gpus=[r[4] for r in rows],
        held=[held.get(r[0], 0) for r in rows],
        util=[util.get(r[0]) for r in rows],
    )


def node_rows(
    cluster_name: str | None = None, states: Iterable[str] | None = None, gpu_model: GpuModel | None = None
) -> QuerySet[Node]:
    """Nodes with their cluster, ``gpu_model_slug`` (the model of one of their GPUs),
    ``gpus_healthy`` and ``gpus_allocated`` (GPUs held by active allocations), narrowed to a
    cluster, to states and to nodes with a GPU of a model. Unordered: the caller pages."""
    nodes = Node.objects.select_related("cluster").annotate(
        gpu_model_slug=Subquery(GpuDevice.objects.filter(node=OuterRef("pk")).values("model__slug")[:1]),
        gpus_healthy=Count("gpus", filter=Q(gpus__health=GpuHealth.HEALTHY), distinct=True),
        gpus_allocated=Count(
            "allocations",
            filter=Q(allocations__active=True, allocations__gpu__isnull=False),
            distinct=True,
        ),
    )
    if cluster_name:
        nodes = nodes.filter(cluster__name=cluster_name)
    if states is not None:
        nodes = nodes.filter(state__in=list(states))
    if gpu_model is not None:
        nodes = nodes.filter(gpus__model=gpu_model).distinct()
    return nodes


def allocated_gpu_counts() -> dict[tuple[int, int], int]:
    """``{(cluster id, GPU model id): GPUs held by active allocations}`` for the roll-ups."""
    rows = (
        Allocation.objects.filter(active=True, gpu__isnull=False)
        .values("node__cluster_id", "gpu__model_id")
        .annotate(n=Count("id"))
        .order_by()
    )
    return {(r["node__cluster_id"], r["gpu__model_id"]): r["n"] for r in rows}


def held_gpu_indices(node_ids: Iterable[int]) -> dict[int, set[int]]:
    """``{node id: indices of its GPUs held by active allocations}`` for the nodes given."""
    held: dict[int, set[int]] = {}
    rows = Allocation.objects.filter(node_id__in=list(node_ids), active=True, gpu__isnull=False)
    for node_id, index in rows.values_list("node_id", "gpu__index"):
        held.setdefault(node_id, set()).add(index)
    return held


def log_tail(job_id: int, lines: int) -> tuple[list[str], bool]:
    """The last ``lines`` lines of the job's latest attempt (all its nodes, by node name), and
    whether anything before them was left out."""
    attempt = (
        JobAttempt.objects.filter(job_id=job_id).order_by("-number").values_list("pk", flat=True).first()
    )
    if attempt is None:
        return [], False
    chunks = list(
        JobLog.objects.filter(attempt_id=attempt).order_by("node").values_list("node", "start", "text")
    )
    out: list[str] = []
    truncated = False
    for node, start, text in chunks:
        truncated |= start > 0
        prefix = f"[{node}] " if len(chunks) > 1 else ""
        out += [prefix + line for line in text.splitlines()]
    return out[-lines:], truncated or len(out) > lines


# --- arrays -------------------------------------------------------------------------------------

MAX_SHOWN_SPANS = 20  # ranges in one summary label; more are elided


@dataclass(frozen=True)
class ArrayRow:
    """Members of one array in one state, shown as one row: how many, and their indices as
    inclusive spans (at most ``MAX_SHOWN_SPANS``; ``elided`` says whether more were left off)."""

    count: int
    spans: tuple[tuple[int, int], ...]
    elided: bool


def collapse_waiting_members(jobs: QuerySet[Job]) -> QuerySet[Job]:
    """``jobs`` with the waiting members of each array reduced to one row per (array, state):
    the member with the lowest id stands for the others (squeue shows pending tasks as one
    line, ``74_[4-99%10]``). One grouped subquery over the same filtered jobs, so a filter that
    selects some members collapses those. ``array_rows`` then tells what each row stands for."""
    members = jobs.order_by().filter(array_id__isnull=False, state__in=WAITING_STATES)
    firsts = members.values("array_id", "state").annotate(first=Min("pk")).values("first")
    return jobs.exclude(Q(array_id__isnull=False, state__in=WAITING_STATES) & ~Q(pk__in=Subquery(firsts)))


def array_rows(jobs: QuerySet[Job], shown: Iterable[Job]) -> dict[int, ArrayRow]:
    """For the rows of ``shown`` that stand for waiting members of an array (see
    ``collapse_waiting_members``; ``jobs`` is the same filtered queryset), by job id: the
    count and the index spans of the members each stands for. The spans are computed in SQL
    (gaps and islands: an index less its rank is constant along a run), one query per page."""
    keys = {(job.array_id, job.state): job.pk for job in shown if job.array_id is not None}
    keys = {key: pk for key, pk in keys.items() if key[1] in WAITING_STATES}
    if not keys:
        return {}
    members = (
        jobs.order_by()
        .filter(array_id__in={a for a, _ in keys}, state__in=WAITING_STATES)
        .values_list("array_id", "state", "array_index")
    )
    sql, params = members.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT array_id, state, MIN(array_index), MAX(array_index), COUNT(*) FROM ("
            " SELECT m.array_id, m.state, m.array_index, m.array_index - ROW_NUMBER() OVER"
            " (PARTITION BY m.array_id, m.state ORDER BY m.array_index) AS island"
            f" FROM ({sql}) AS m"
            ") AS runs GROUP BY array_id, state, island ORDER BY array_id, state, 3",
            params,
        )
        spans: dict[tuple[int, str], list[tuple[int, int, int]]] = {}
        for array_id, state, low, high, count in cursor.fetchall():
            spans.setdefault((array_id, state), []).append((low, high, count))
    return {
        pk: ArrayRow(
            count=sum(n for _, _, n in spans.get(key, [])),
            spans=tuple((low, high) for low, high, _ in spans.get(key, [])[:MAX_SHOWN_SPANS]),
            elided=len(spans.get(key, [])) > MAX_SHOWN_SPANS,
        )
        for key, pk in keys.items()
    }


def array_summary(jobs: QuerySet[Job], array_id: int) -> dict[str, Any] | None:
    """One array as ``scontrol show job 74`` sums it up: its first member (name, owner, queue),
    its throttle, how many members it has in each state, and its indices as spans. Two grouped
    queries; None when ``jobs`` holds no member of it."""
    members = jobs.order_by().filter(array_id=array_id)
    counts = dict(members.values_list("state").annotate(n=Count("pk")).values_list("state", "n"))
    if not counts:
        return None
    first = members.select_related("owner", "project", "queue").order_by("pk").first()
    assert first is not None
    stats = members.aggregate(low=Min("array_index"), high=Max("array_index"), n=Count("pk"))
    return {
        "first": first,
        "states": counts,
        "tasks": stats["n"],
        "low": stats["low"],
        "high": stats["high"],
    }
