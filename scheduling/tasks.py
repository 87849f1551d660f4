"""Thin Celery tasks over the scheduler and the dispatcher (beat schedule in settings)."""

import logging

from celery import shared_task

from clusters.adapters.base import AdapterError
from clusters.models import Cluster
from scheduling.dispatch.outbox import drain_outbox
from scheduling.dispatch.sync import sync_cluster, sync_due_clusters
from scheduling.engine.cycle import run_cycles
from scheduling.services.budget_holds import release_due
from scheduling.services.energy import meter_energy
from scheduling.services.failover import sweep_lost_nodes
from scheduling.services.notification_delivery import deliver_due

log = logging.getLogger(__name__)


@shared_task(ignore_result=True)
def scheduling_cycle_task() -> int:
    """Cycles through a backlog back to back (each commit overlapping the next decision on
    PostgreSQL); jobs placed."""
    return sum(report.placed for report in run_cycles())


@shared_task(ignore_result=True)
def dispatch_outbox_task() -> int:
    return drain_outbox()


@shared_task(ignore_result=True)
def sync_clusters_task() -> int:
    return sync_due_clusters()


@shared_task(ignore_result=True)
def sync_cluster_task(cluster_id: int) -> int:
    cluster = Cluster.objects.filter(pk=cluster_id).first()
    if cluster is None:
        return 0
    try:
        return sync_cluster(cluster).moved
    except AdapterError as exc:
        log.warning("%s cluster %s: %s", cluster.kind, cluster.name, exc)
        return 0  # the periodic pass tries again


@shared_task(ignore_result=True)
def sweep_lost_nodes_task() -> int:
    return sweep_lost_nodes()


@shared_task(ignore_result=True)
def deliver_notifications_task() -> int:
    return deliver_due().sent


@shared_task(ignore_result=True)
def release_budget_holds_task() -> int:
    return release_due()


@shared_task(ignore_result=True)
def meter_energy_task() -> int:
    return meter_energy()
