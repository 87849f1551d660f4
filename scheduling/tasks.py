"""Thin Celery tasks over the scheduler and the dispatcher (beat schedule in settings)."""

import logging

from celery import shared_task

from clusters.adapters.base import AdapterError
from clusters.models import Cluster
from scheduling.dispatch.outbox import drain_outbox
from scheduling.dispatch.sync import sync_cluster, sync_due_clusters, sync_rung
from scheduling.engine.cycle import run_cycles
from scheduling.services.budget_holds import release_due
from scheduling.services.energy import meter_energy
from scheduling.services.failover import sweep_lost_nodes
from scheduling.services.notification_delivery import deliver_due
from scheduling.wakeup import cycle_skipped, cycle_started, dispatch_started, rung_jobs, sync_started

log = logging.getLogger(__name__)


@shared_task(ignore_result=True)
def scheduling_cycle_task() -> int:
    """Cycles through a backlog back to back (each commit overlapping the next decision on
    PostgreSQL); jobs placed."""
    cycle_started()  # before reading: what is asked from now on is for the next cycle
    reports = run_cycles()
    if reports and not reports[0].ran:
        cycle_skipped()
    return sum(report.placed for report in reports)


@shared_task(ignore_result=True)
def dispatch_outbox_task() -> int:
    dispatch_started()  # before reading: rows rung from now on are for the next drain
    return drain_outbox()


@shared_task(ignore_result=True)
def sync_clusters_task() -> int:
    return sync_due_clusters()


@shared_task(ignore_result=True)
def sync_cluster_task(cluster_id: int, rung: bool = False) -> int:
    """One sync of one cluster, woken early (``wakeup.wake_sync``) or rung by the cluster
    (``wakeup.ring_sync``)."""
    jobs = None
    if rung:
        sync_started(cluster_id)  # before reading: an end rung from now on is read by the next
        jobs = rung_jobs(cluster_id)
    cluster = Cluster.objects.filter(pk=cluster_id).first()
    if cluster is None:
        return 0
    try:
        return (sync_cluster(cluster) if jobs is None else sync_rung(cluster, jobs)).moved
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
