"""Reads of the resource model."""

from __future__ import annotations

from django.core.cache import cache
from django.db.models import Count

from clusters.choices import ClusterKind
from clusters.models import GpuDevice, GpuModel, GpuModelAlias


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


def simulated_fleet() -> dict[str, list[tuple[str, str, int]]]:
    """``{cluster: [(node, GPU model slug, GPUs)]}`` of every simulated cluster, for the simulator."""
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
