"""One adapter interface for every kind of cluster (DESIGN.md §6).

The scheduler decides; an adapter makes a cluster do what was decided and reports back:

* ``inventory(cluster)`` refreshes nodes and GPUs (pulled from Slurm; native nodes and
  simulated fleets push their own through the agent API) and returns how many nodes it knows;
* ``dispatch()`` delivers the pending ``start`` rows of the outbox for its kind (idempotent: a
  row delivered twice starts one job);
* ``poll(cluster)`` brings Orrery's attempts in line with the cluster, both ways: states and
  exit codes come in, and work Orrery no longer wants (cancelled, held, requeued) is stopped
  there. Cancelling is therefore level-triggered: it is a transition in Orrery, and the next
  poll (or heartbeat, for agents) withdraws it;
* ``logs(job_id, lines)`` is the tail of the output the cluster shipped.

``tests/test_adapters.py`` runs one contract suite over every adapter.
"""

from __future__ import annotations

from typing import Protocol

from clusters.choices import ClusterKind
from clusters.models import Cluster, Node
from clusters.services.slurm import collect
from scheduling import agentwork, slurm
from scheduling.scheduler import advance_simulated_jobs


class ClusterAdapter(Protocol):
    kind: str

    def inventory(self, cluster: Cluster) -> int: ...

    def dispatch(self) -> int: ...

    def poll(self, cluster: Cluster) -> int: ...

    def logs(self, job_id: int, lines: int) -> list[str]: ...


class _Pushed:
    """Kinds whose nodes report themselves: inventory is what they registered."""

    def inventory(self, cluster: Cluster) -> int:
        return Node.objects.filter(cluster=cluster).count()

    def logs(self, job_id: int, lines: int) -> list[str]:
        return agentwork.log_tail(job_id, lines)[0]


class NativeAdapter(_Pushed):
    """``orrery-agent`` nodes pull their desired attempts with each heartbeat and report starts,
    ends and output themselves; an attempt no longer desired is killed by its agent."""

    kind = ClusterKind.NATIVE

    def dispatch(self) -> int:
        return agentwork.dispatch_outbox()

    def poll(self, cluster: Cluster) -> int:
        return 0  # agents push their reports (clusters/api/agent.py)


class SimulatedAdapter(_Pushed):
    """In-process jobs: they start when delivered and end after ``spec.sim.durationSeconds``
    with ``spec.sim.exitCode``. They run no command, so they have no output."""

    kind = ClusterKind.SIMULATED

    def dispatch(self) -> int:
        return advance_simulated_jobs()["started"]

    def poll(self, cluster: Cluster) -> int:
        moved = advance_simulated_jobs()
        return moved["finished"] + moved["failed"]


class SlurmAdapter:
    """A real Slurm cluster through slurmrestd (and ``sbatch`` to pin node lists)."""

    kind = ClusterKind.SLURM

    def inventory(self, cluster: Cluster) -> int:
        return collect(cluster).nodes

    def dispatch(self) -> int:
        return slurm.dispatch_slurm()

    def poll(self, cluster: Cluster) -> int:
        counts = slurm.sync_slurm(cluster)
        return counts["moved"] + counts["vanished"]

    def logs(self, job_id: int, lines: int) -> list[str]:
        return agentwork.log_tail(job_id, lines)[0]  # the sync copies Slurm's output file in


ADAPTERS: dict[str, ClusterAdapter] = {
    a.kind: a for a in (NativeAdapter(), SimulatedAdapter(), SlurmAdapter())
}


def adapter_for(cluster: Cluster) -> ClusterAdapter:
    try:
        return ADAPTERS[cluster.kind]
    except KeyError:
        raise LookupError(f"no adapter for clusters of kind '{cluster.kind}'") from None
