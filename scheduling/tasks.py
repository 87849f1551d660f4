"""Thin Celery tasks over the scheduler (beat schedule in settings)."""

from celery import shared_task

from clusters.choices import ClusterKind
from scheduling.engine.cycle import run_cycle
from scheduling.scheduler import advance_simulated_jobs


@shared_task(ignore_result=True)
def scheduling_cycle_task() -> int:
    return run_cycle().placed


@shared_task(ignore_result=True)
def simulated_clusters_task() -> dict[str, int]:
    return advance_simulated_jobs()


@shared_task(ignore_result=True)
def dispatch_outbox_task() -> int:
    from scheduling.adapters import ADAPTERS

    return ADAPTERS[ClusterKind.NATIVE].dispatch()


@shared_task(ignore_result=True)
def sweep_lost_nodes_task() -> int:
    from scheduling.agentwork import sweep_lost_nodes

    return sweep_lost_nodes()


@shared_task(ignore_result=True)
def slurm_dispatch_task() -> int:
    from scheduling.adapters import ADAPTERS

    return ADAPTERS[ClusterKind.SLURM].dispatch()


@shared_task(ignore_result=True)
def slurm_sync_task() -> int:
    """Poll every Slurm cluster, disabled ones too: work already there must still finish."""
    from clusters.services.slurm import for_each_slurm_cluster
    from scheduling.adapters import ADAPTERS

    return for_each_slurm_cluster(ADAPTERS[ClusterKind.SLURM].poll, include_disabled=True)
