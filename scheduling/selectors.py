"""Reads of the scheduling app."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db.models import Count, Q

from clusters.choices import GpuHealth, NodeState
from clusters.models import GpuDevice, Node
from scheduling.choices import ACTIVE_STATES, WAITING_STATES
from scheduling.models import Allocation, Job, JobAttempt, JobLog, QueueQuota


def busy_node_ids(node_ids: Iterable[int]) -> set[int]:
    """The nodes among ``node_ids`` that hold at least one active allocation."""
    return set(
        Allocation.objects.filter(node_id__in=list(node_ids), active=True)
        .values_list("node_id", flat=True)
        .distinct()
    )


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


def allocated_gpu_counts() -> dict[tuple[int, int], int]:
    """``{(cluster id, GPU model id): GPUs held by active allocations}`` for the roll-ups."""
    rows = (
        Allocation.objects.filter(active=True, gpu__isnull=False)
        .values("node__cluster_id", "gpu__model_id")
        .annotate(n=Count("id"))
        .order_by()
    )
    return {(r["node__cluster_id"], r["gpu__model_id"]): r["n"] for r in rows}


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
