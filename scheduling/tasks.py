"""Thin Celery tasks over the scheduler (beat schedule in settings)."""

from celery import shared_task

from scheduling.cycle import run_cycle
from scheduling.scheduler import advance_simulated_jobs


@shared_task(ignore_result=True)
def scheduling_cycle_task() -> int:
    return run_cycle().placed


@shared_task(ignore_result=True)
def simulated_clusters_task() -> dict[str, int]:
    return advance_simulated_jobs()


@shared_task(ignore_result=True)
def dispatch_outbox_task() -> int:
    from scheduling.agentwork import dispatch_outbox

    return dispatch_outbox()


@shared_task(ignore_result=True)
def sweep_lost_nodes_task() -> int:
    from scheduling.agentwork import sweep_lost_nodes

    return sweep_lost_nodes()


@shared_task(ignore_result=True)
def slurm_dispatch_task() -> int:
    from scheduling.slurm import dispatch_slurm

    return dispatch_slurm()


@shared_task(ignore_result=True)
def slurm_sync_task() -> int:
    from scheduling.slurm import sync_all

    return sync_all()
