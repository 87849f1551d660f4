"""What the scheduler reads of the fleet's telemetry and energy facts, into snapshot columns.

Load-aware placement (``plugins/load_aware.py``) reads each node's exponential averages of GPU
utilisation, memory in use and temperature, with the time of the reading: a reading older than
``ORRERY_TELEMETRY_STALE_S`` is not trusted, and the plugin treats the node as unknown rather
than as cool. Shareable GPUs' memory in use (the latest reading, when fresh) bounds what
fractions they can still give. Energy-aware placement (``plugins/energy.py``) reads each row's
GPU model's throughput per watt and its cluster's energy price and carbon intensity.

One grouped read per refresh (a few tens of milliseconds at 80,000 GPUs), at rebuild and then
every ``ORRERY_SCHEDULER_TELEMETRY_S``: averages move over minutes, not cycles.
"""

from __future__ import annotations

import numpy as np
from django.conf import settings
from django.db.models import Avg, Max, Sum

from clusters.models import Cluster, GpuDevice, GpuModel
from scheduling.engine.snapshot import Snapshot


def load_telemetry(snap: Snapshot, now: float) -> None:
    """Fill the snapshot's telemetry and energy columns from the database."""
    _load_averages(snap)
    _load_shared_use(snap, now)
    _load_energy_facts(snap)


def _load_averages(snap: Snapshot) -> None:
    util = np.full(len(snap), np.nan, dtype=np.float32)
    mem_used = np.full(len(snap), np.nan, dtype=np.float32)
    temp = np.full(len(snap), np.nan, dtype=np.float32)
    at = np.zeros(len(snap), dtype=np.float64)
    rows = (
        GpuDevice.objects.filter(telemetry_at__isnull=False)
        .values("node_id")
        .annotate(
            util=Avg("utilization_avg"),
            used=Sum("memory_used_avg_mb"),
            total=Sum("memory_mb"),
            temp=Max("temperature_avg_c"),
            at=Max("telemetry_at"),
        )
        .values_list("node_id", "util", "used", "total", "temp", "at")
    )
    for node_id, u, used, total, t, when in rows:
        row = snap.row_of.get(node_id)
        if row is None:
            continue
        if u is not None:
            util[row] = u
        if used is not None and total:
            mem_used[row] = min(used / total, 1.0)
        if t is not None:
            temp[row] = t
        at[row] = when.timestamp()
    snap.util, snap.mem_used, snap.temp, snap.telemetry_at = util, mem_used, temp, at


def _load_shared_use(snap: Snapshot, now: float) -> None:
    if not snap.shared:
        return
    bound = settings.ORRERY_TELEMETRY_STALE_S
    for node_id, index, used, when in GpuDevice.objects.filter(shareable=True).values_list(
        "node_id", "index", "memory_used_mb", "telemetry_at"
    ):
        row = snap.row_of.get(node_id)
        if row is None:
            continue
        fresh = when is not None and used is not None and now - when.timestamp() <= bound
        snap.set_actual(row, index, used if fresh else 0)


def _load_energy_facts(snap: Snapshot) -> None:
    per_watt = {
        pk: (throughput / tdp if tdp else 0.0)
        for pk, throughput, tdp in GpuModel.objects.values_list("pk", "relative_throughput", "tdp_watts")
    }
    by_model = np.array([per_watt.get(pk, 0.0) for pk in snap.model_ids] + [np.nan], dtype=np.float32)
    snap.perf_per_watt = by_model[np.where(snap.model >= 0, snap.model, len(snap.model_ids))]
    facts = {
        pk: (price, carbon)
        for pk, price, carbon in Cluster.objects.values_list("pk", "energy_price_per_kwh", "carbon_g_per_kwh")
    }
    price = np.array(
        [_number(facts.get(pk, (None,))[0]) for pk in snap.cluster_ids] + [np.nan], dtype=np.float32
    )
    carbon = np.array(
        [_number(facts.get(pk, (None, None))[1]) for pk in snap.cluster_ids] + [np.nan], dtype=np.float32
    )
    snap.price = price[snap.cluster]
    snap.carbon = carbon[snap.cluster]


def _number(value: object) -> float:
    return float(value) if value is not None else float("nan")  # type: ignore[arg-type]
