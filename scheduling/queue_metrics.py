"""Queue state under Kueue's metric names, for dashboards and alerts written for Kueue.

Orrery's queue is Kueue's ClusterQueue (``cluster_queue`` = ``project/queue``), its cohort is
Kueue's cohort, a GPU model of the catalog is a resource flavor (``flavor`` = the model's slug)
and GPUs are the resource (``resource`` = the device plugin's name for the model's vendor:
``nvidia.com/gpu``, ``amd.com/gpu``, ``gpu.intel.com/i915``). A job is a workload.

* ``kueue_pending_workloads{cluster_queue, status}`` — jobs in ``PENDING`` (a held job is not
  pending here, as Kueue does not count a deactivated workload). ``status="active"``: the
  scheduler will place it as soon as GPUs free up or higher-priority work goes — its reason is
  ``Resources``, ``Priority``, or it was not looked at yet or was just requeued (``None``,
  ``Requeued``, ``NodeLost``, ``Preempted``). ``status="inadmissible"``: something other than
  free capacity holds it back — quota (``QuotaExceeded``), a per-user or array limit, a budget,
  a dependency, or no eligible cluster (``ClusterUnavailable``);
* ``kueue_admitted_active_workloads{cluster_queue}`` — jobs holding resources (scheduled,
  starting, running, completing, or draining after a preemption);
* ``kueue_cluster_queue_nominal_quota{cohort, cluster_queue, flavor, resource}`` — the queue's
  quota of each GPU model (``QueueQuota.gpus``); a queue without quota rows has none here;
* ``kueue_cluster_queue_resource_usage{cohort, cluster_queue, flavor, resource}`` — GPUs its
  jobs hold now, counted as the quota counts them (``nodes × gpus per node`` of each job holding
  resources), borrowed GPUs included.

Computed at each scrape of ``/metrics`` by a collector in a registry of its own (``REGISTRY``),
never in django-prometheus' default one: any process exposing that registry (a beat's metrics
port) would otherwise query the database from its exposition thread. Four grouped queries,
whatever the number of jobs (``job_state_queue_idx``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from django.db.models import Count, F, Sum
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from clusters.choices import GpuVendor
from clusters.models import GpuModel
from scheduling.choices import ACTIVE_STATES, JobState, PendingReason
from scheduling.models import Job, Queue, QueueQuota

ACTIVE_REASONS = frozenset(
    {
        PendingReason.NONE,
        PendingReason.RESOURCES,
        PendingReason.PRIORITY,
        PendingReason.REQUEUED,
        PendingReason.NODE_LOST,
        PendingReason.PREEMPTED,
    }
)
# Every other pending reason (quota, limits, budgets, dependencies, no eligible cluster) is
# "inadmissible": freeing GPUs alone would not start the job.

RESOURCES = {
    GpuVendor.NVIDIA: "nvidia.com/gpu",
    GpuVendor.AMD: "amd.com/gpu",
    GpuVendor.INTEL: "gpu.intel.com/i915",
}

QUOTA_LABELS = ["cohort", "cluster_queue", "flavor", "resource"]


def pending_status(reason: str) -> str:
    """Kueue's status of a pending workload for Orrery's pending reason."""
    return "active" if not reason or reason in ACTIVE_REASONS else "inadmissible"


def queue_state() -> list[GaugeMetricFamily]:
    """The four Kueue families, read now: every queue appears in the first two (zeros
    included, so a series does not vanish when a queue empties)."""
    queues = {
        pk: (f"{project}/{name}", cohort)
        for pk, project, name, cohort in Queue.objects.values_list("pk", "project__name", "name", "cohort")
    }
    models = {
        pk: (slug, RESOURCES.get(vendor, f"{vendor}.com/gpu"))
        for pk, slug, vendor in GpuModel.objects.values_list("pk", "slug", "vendor")
    }

    pending: dict[tuple[int, str], int] = defaultdict(int)
    for queue_id, reason, n in (
        Job.objects.filter(state=JobState.PENDING)
        .values_list("queue_id", "reason")
        .annotate(n=Count("id"))
        .order_by()
    ):
        pending[queue_id, pending_status(reason)] += n

    admitted: dict[int, int] = defaultdict(int)
    used: dict[tuple[int, int], int] = defaultdict(int)
    for queue_id, model_id, n, gpus in (
        Job.objects.filter(state__in=list(ACTIVE_STATES))
        .values_list("queue_id", "gpu_model_id")
        .annotate(n=Count("id"), gpus=Sum(F("nodes") * F("gpus_per_node")))
        .order_by()
    ):
        admitted[queue_id] += n
        if model_id is not None and gpus:
            used[queue_id, model_id] += gpus

    nominal = {
        (queue_id, model_id): gpus
        for queue_id, model_id, gpus in QueueQuota.objects.values_list("queue_id", "gpu_model_id", "gpus")
    }
    return [
        _pending_family(queues, pending),
        _admitted_family(queues, admitted),
        _quota_family(
            "kueue_cluster_queue_nominal_quota",
            "Nominal quota of the cluster queue per flavor and resource (Orrery: GPUs of a model).",
            queues,
            models,
            nominal,
        ),
        _quota_family(
            "kueue_cluster_queue_resource_usage",
            "Resources the cluster queue's admitted workloads use, borrowed ones included (Orrery: GPUs "
            "of a model its jobs hold).",
            queues,
            models,
            {key: used.get(key, 0) for key in nominal.keys() | used.keys()},
        ),
    ]


def _pending_family(
    queues: dict[int, tuple[str, str]], pending: dict[tuple[int, str], int]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "kueue_pending_workloads",
        "Pending workloads per cluster queue and status (active: waiting for capacity or priority; "
        "inadmissible: held back by quota, limits, budgets, dependencies or no eligible cluster).",
        labels=["cluster_queue", "status"],
    )
    for pk, (name, _) in sorted(queues.items(), key=lambda item: item[1]):
        for status in ("active", "inadmissible"):
            family.add_metric([name, status], pending.get((pk, status), 0))
    return family


def _admitted_family(queues: dict[int, tuple[str, str]], admitted: dict[int, int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "kueue_admitted_active_workloads",
        "Admitted workloads that are active (Orrery: jobs holding resources) per cluster queue.",
        labels=["cluster_queue"],
    )
    for pk, (name, _) in sorted(queues.items(), key=lambda item: item[1]):
        family.add_metric([name], admitted.get(pk, 0))
    return family


def _quota_family(
    name: str,
    help_text: str,
    queues: dict[int, tuple[str, str]],
    models: dict[int, tuple[str, str]],
    values: dict[tuple[int, int], int],
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=QUOTA_LABELS)
    rows = [
        ([queues[q][1], queues[q][0], *models[m]], value)
        for (q, m), value in values.items()
        if q in queues and m in models
    ]
    for labels, value in sorted(rows):
        family.add_metric(labels, value)
    return family


class QueueStateCollector:
    """The Kueue families, read from the database at each collection."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from queue_state()

    def describe(self) -> Iterator[Any]:
        # Names only (no query) when the collector is registered.
        yield GaugeMetricFamily("kueue_pending_workloads", "", labels=["cluster_queue", "status"])
        yield GaugeMetricFamily("kueue_admitted_active_workloads", "", labels=["cluster_queue"])
        yield GaugeMetricFamily("kueue_cluster_queue_nominal_quota", "", labels=QUOTA_LABELS)
        yield GaugeMetricFamily("kueue_cluster_queue_resource_usage", "", labels=QUOTA_LABELS)


REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(QueueStateCollector())
