from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "scheduling"
    verbose_name = "Scheduling"

    def ready(self) -> None:
        # A bad scheduler profile must stop the process at start-up, not at the first cycle.
        from clusters.ports import register_ports
        from scheduling.dispatch.agent import apply_reports, desired_for_node
        from scheduling.engine.policies import active_profile
        from scheduling.selectors import (
            allocated_gpu_counts,
            busy_node_ids,
            held_gpu_indices,
            last_release_times,
            waiting_gpu_demand,
        )
        from scheduling.services.allocations import retire_mig_instances
        from scheduling.services.failover import handle_node_lost
        from scheduling.wakeup import ring_sync

        active_profile()
        register_ports(
            node_workload=busy_node_ids,
            node_last_release=last_release_times,
            waiting_demand=waiting_gpu_demand,
            gpu_allocation=allocated_gpu_counts,
            held_gpus=held_gpu_indices,
            retire_mig_instances=retire_mig_instances,
            node_lost=handle_node_lost,
            agent_desired=desired_for_node,
            agent_reports=apply_reports,
            cluster_job_ended=ring_sync,
        )
