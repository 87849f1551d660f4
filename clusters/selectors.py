"""Reads of the resource model."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.core.cache import cache
from django.db.models import Count, Max, QuerySet

from clusters.agent.mig import same_layout
from clusters.choices import ClusterKind
from clusters.models import (
    Cluster,
    GpuDevice,
    GpuModel,
    GpuModelAlias,
    MetricPoint,
    MigInstance,
    Node,
    NodeEvent,
)


def resolve_gpu_model(name: str) -> GpuModel | None:
    """The catalog entry for a slug, an alias or a vendor product string (case-insensitive)."""
    key = name.strip().lower()
    model = GpuModel.objects.filter(slug=key).first()
    if model is not None:
        return model
    alias = GpuModelAlias.objects.select_related("gpu_model").filter(name=key).first()
    return alias.gpu_model if alias else None


_CAPACITY_TTL_S = 30


def gpu_capacity_histogram(gpu_model_id: int) -> dict[int, int]:
    """``{GPUs of this model on a node: number of such nodes}`` over the whole fleet, whatever the
    nodes' state. Cached for 30 s: submission asks it for every job, the fleet changes slowly."""
    key = f"orrery:gpu-capacity:{gpu_model_id}"
    histogram = cache.get(key)
    if histogram is None:
        per_node = (
            GpuDevice.objects.filter(model_id=gpu_model_id)
            .values("node_id")
            .annotate(n=Count("id"))
            .values_list("n", flat=True)
        )
        histogram = {}
        for n in per_node:
            histogram[n] = histogram.get(n, 0) + 1
        cache.set(key, histogram, _CAPACITY_TTL_S)
    return histogram


def mig_capacity(gpu_model_id: int, profile: str) -> int:
    """The most MIG instances of ``profile`` any one node has on GPUs of the model (cached 30 s,
    as ``gpu_capacity_histogram``)."""
    key = f"orrery:mig-capacity:{gpu_model_id}:{profile}"
    most = cache.get(key)
    if most is None:
        per_node = (
            MigInstance.objects.filter(gpu__model_id=gpu_model_id, gpu__mig_enabled=True, profile=profile)
            .values("gpu__node_id")
            .annotate(n=Count("id"))
            .values_list("n", flat=True)
        )
        most = max(per_node, default=0)
        cache.set(key, most, _CAPACITY_TTL_S)
    return most


def shareable_memory_mb(gpu_model_id: int) -> int:
    """The memory (MiB) of the largest GPU of the model an operator offers in fractions; 0: none."""
    key = f"orrery:shareable:{gpu_model_id}"
    largest = cache.get(key)
    if largest is None:
        largest = (
            GpuDevice.objects.filter(model_id=gpu_model_id, shareable=True, mig_enabled=False).aggregate(
                m=Max("memory_mb")
            )["m"]
            or 0
        )
        cache.set(key, largest, _CAPACITY_TTL_S)
    return largest


def reconfiguring_gpus(node_ids: Iterable[int] | None = None) -> set[tuple[int, int]]:
    """(node id, GPU index) of the GPUs (of these nodes, or all) whose MIG layout an operator
    changed and whose node has not yet reported it: the scheduler keeps them out of placement,
    so they go idle and the agent can apply the change. One query, on GPUs with a wish only."""
    wished = GpuDevice.objects.filter(mig_layout_wanted__isnull=False)
    if node_ids is not None:
        wished = wished.filter(node_id__in=list(node_ids))
    gpus: dict[tuple[int, int], tuple[Any, bool, list[str]]] = {}
    for node_id, index, wanted, enabled, profile in wished.values_list(
        "node_id", "index", "mig_layout_wanted", "mig_enabled", "mig_instances__profile"
    ):
        gpus.setdefault((node_id, index), (wanted, enabled, []))[2].extend([profile] if profile else [])
    return {
        key
        for key, (wanted, enabled, profiles) in gpus.items()
        if isinstance(wanted, list) and (enabled != bool(wanted) or not same_layout(profiles, wanted))
    }


def simulated_fleet() -> dict[str, list[tuple[str, str, int]]]:
    """``{cluster: [(node, GPU model slug, GPUs)]}`` of every simulated cluster, for the heartbeat
    traffic (``clusters.traffic``)."""
    fleet: dict[str, list[tuple[str, str, int]]] = {}
    rows = (
        GpuDevice.objects.filter(node__cluster__kind=ClusterKind.SIMULATED)
        .values("node__cluster__name", "node__name", "model__slug")
        .annotate(n=Count("id"))
        .order_by("node__cluster__name", "node__name")
    )
    for row in rows:
        fleet.setdefault(row["node__cluster__name"], []).append(
            (row["node__name"], row["model__slug"], row["n"])
        )
    return fleet


def all_clusters() -> QuerySet[Cluster]:
    """Every cluster, by name."""
    return Cluster.objects.order_by("name")


def cluster_by_name(name: str) -> Cluster | None:
    """The cluster called ``name`` (names are exact and case-sensitive), or None."""
    return Cluster.objects.filter(name=name).first()


def cluster_state_counts() -> list[dict[str, Any]]:
    """``[{"state", "n"}]``: clusters per state, by state."""
    return list(Cluster.objects.values("state").annotate(n=Count("id")).order_by("state"))


def node_state_counts(cluster: Cluster | None = None) -> list[dict[str, Any]]:
    """``[{"state", "n"}]``: nodes per state, by state, of one cluster or of the whole fleet."""
    nodes = Node.objects.all() if cluster is None else Node.objects.filter(cluster=cluster)
    return list(nodes.values("state").annotate(n=Count("id")).order_by("state"))


def node_events(node_id: int) -> QuerySet[NodeEvent] | None:
    """A node's state history with the acting user, or None when there is no such node."""
    if not Node.objects.filter(pk=node_id).exists():
        return None
    return NodeEvent.objects.filter(node_id=node_id).select_related("actor")


def gpu_catalog() -> QuerySet[GpuModel]:
    """Every GPU model with its aliases (prefetched), by slug."""
    return GpuModel.objects.prefetch_related("aliases").order_by("slug")


def gpus_with_nodes(gpu_ids: Iterable[int]) -> QuerySet[GpuDevice]:
    """These GPUs with their nodes, by node name and index."""
    return (
        GpuDevice.objects.filter(pk__in=list(gpu_ids)).select_related("node").order_by("node__name", "index")
    )


@dataclass(frozen=True)
class MinuteTotals:
    """The fleet's one-minute roll-ups of one minute, summed over clusters and GPU models."""

    samples: int
    gpus_total: int
    gpus_allocated: int
    utilization_sum: float
    power_w_sum: float


def minute_totals(since: datetime, cluster_name: str | None = None) -> dict[int, MinuteTotals]:
    """``{minute as a Unix time: MinuteTotals}`` from ``since`` on, of one cluster or of all. One
    query; minutes without a roll-up are absent."""
    points = MetricPoint.objects.filter(resolution=MetricPoint.Resolution.MINUTE, at__gte=since)
    if cluster_name:
        points = points.filter(cluster__name=cluster_name)
    sums: dict[int, list[float]] = {}
    for at, samples, total, allocated, util, power in points.values_list(
        "at", "samples", "gpus_total", "gpus_allocated", "utilization_sum", "power_w_sum"
    ):
        b = sums.setdefault(int(at.timestamp()), [0, 0, 0, 0.0, 0.0])
        b[0] += samples
        b[1] += total
        b[2] += allocated
        b[3] += util
        b[4] += power
    return {t: MinuteTotals(*b) for t, b in sums.items()}
