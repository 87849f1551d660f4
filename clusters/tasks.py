"""Thin Celery tasks over the reporting pipeline's services (beat schedule in settings)."""

from celery import shared_task

from clusters.services.aggregation import flush_heartbeats, prune_metrics, sync_telemetry
from clusters.services.inventory import take_inventories
from clusters.services.lifecycle import run_node_lifecycle
from clusters.services.nodes import settle_draining_nodes
from clusters.services.power import apply_power_saving


@shared_task(ignore_result=True)
def flush_heartbeats_task() -> int:
    return flush_heartbeats().nodes


@shared_task(ignore_result=True)
def sync_telemetry_task() -> int:
    return sync_telemetry()


@shared_task(ignore_result=True)
def node_lifecycle_task() -> int:
    result = run_node_lifecycle()
    return len(result.not_ready) + len(result.down) + len(result.ready)


@shared_task(ignore_result=True)
def prune_metrics_task() -> int:
    return prune_metrics()


@shared_task(ignore_result=True)
def settle_draining_nodes_task() -> int:
    return settle_draining_nodes()


@shared_task(ignore_result=True)
def take_inventories_task() -> int:
    return take_inventories()


@shared_task(ignore_result=True)
def power_saving_task() -> int:
    return apply_power_saving()
