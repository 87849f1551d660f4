"""What the clusters app needs from the apps above it, as typed ports.

The clusters app owns nodes, heartbeats and the agent protocol, but not jobs: whether a node
still holds work, which GPUs and MIG instances are allocated, what happens to jobs on a lost
node, and what an agent should run are the scheduling app's business, which this app must not
import. Each is a port: a ``Protocol`` here, an implementation registered by the scheduling app
at start-up (``SchedulingConfig.ready``). Using a port nobody registered is a start-up bug and says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from datetime import datetime
from typing import Any, Protocol

from django.core.exceptions import ImproperlyConfigured


class NodeWorkload(Protocol):
    def __call__(self, node_ids: list[int]) -> set[int]:
        """The nodes among ``node_ids`` that hold work."""
        ...


class NodeLastRelease(Protocol):
    def __call__(self, node_ids: list[int]) -> dict[int, datetime]:
        """When work last left each of ``node_ids`` (its last allocation released); a node that
        never held work is absent."""
        ...


class WaitingDemand(Protocol):
    def __call__(self) -> dict[int, int]:
        """``{GPU model id: GPUs that jobs waiting for free resources ask for}``."""
        ...


class GpuAllocation(Protocol):
    def __call__(self) -> dict[tuple[int, int], int]:
        """``{(cluster id, GPU model id): GPUs allocated}``."""
        ...


class HeldGpus(Protocol):
    def __call__(self, node_ids: list[int]) -> dict[int, set[int]]:
        """``{node id: indices of its GPUs held by active allocations}``."""
        ...


class RetireMigInstances(Protocol):
    def __call__(self, instance_ids: list[int]) -> set[int]:
        """Of these MIG instances, about to go because their GPU's layout changed, those an
        active allocation holds (they must stay as they are); released allocations that name
        the others forget them, so that they can be deleted (their GPU stays named)."""
        ...


class NodeLostHandler(Protocol):
    def __call__(self, node_ids: list[int]) -> int:
        """Apply the failover policy of the jobs on nodes that just went down."""
        ...


class AgentDesired(Protocol):
    def __call__(self, node_id: int) -> list[dict[str, Any]]:
        """The attempts a native node's agent should be running now."""
        ...


class AgentReports(Protocol):
    def __call__(
        self, node_id: int, reports: list[dict[str, Any]], logs: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """Apply an agent's well-formed reports and log chunks: counts of ``applied`` and
        ``ignored`` reports, and ``refused_logs`` — (position, why) of chunks not kept."""
        ...


class ClusterJobEnded(Protocol):
    def __call__(self, cluster_id: int, job: str) -> None:
        """The cluster's own scheduler says its job ``job`` (a remote id) ended: read it back
        now rather than at the next poll."""
        ...


@dataclass(frozen=True)
class Ports:
    node_workload: NodeWorkload | None = None
    node_last_release: NodeLastRelease | None = None
    waiting_demand: WaitingDemand | None = None
    gpu_allocation: GpuAllocation | None = None
    held_gpus: HeldGpus | None = None
    retire_mig_instances: RetireMigInstances | None = None
    node_lost: NodeLostHandler | None = None
    agent_desired: AgentDesired | None = None
    agent_reports: AgentReports | None = None
    cluster_job_ended: ClusterJobEnded | None = None


_ports = Ports()


def register_ports(**implementations: Any) -> None:
    """Register implementations by port name (``node_lost=handle_node_lost``)."""
    global _ports
    unknown = set(implementations) - {f.name for f in fields(Ports)}
    if unknown:
        raise ImproperlyConfigured(f"no such port: {', '.join(sorted(unknown))}")
    _ports = replace(_ports, **implementations)


def port(name: str) -> Any:
    """The registered implementation of a port."""
    found = getattr(_ports, name)
    if found is None:
        raise ImproperlyConfigured(f"nothing registered the port '{name}' (is the scheduling app installed?)")
    return found


def node_workload() -> NodeWorkload:
    return port("node_workload")


def node_last_release() -> NodeLastRelease:
    return port("node_last_release")


def waiting_demand() -> WaitingDemand:
    return port("waiting_demand")


def gpu_allocation() -> GpuAllocation:
    return port("gpu_allocation")


def held_gpus() -> HeldGpus:
    return port("held_gpus")


def retire_mig_instances() -> RetireMigInstances:
    return port("retire_mig_instances")


def node_lost() -> NodeLostHandler:
    return port("node_lost")


def agent_desired() -> AgentDesired:
    return port("agent_desired")


def agent_reports() -> AgentReports:
    return port("agent_reports")


def cluster_job_ended() -> ClusterJobEnded:
    return port("cluster_job_ended")


@contextmanager
def ports_replaced(**implementations: Any) -> Iterator[None]:
    """Swap implementations for the length of a block (tests)."""
    global _ports
    before = _ports
    register_ports(**implementations)
    try:
        yield
    finally:
        _ports = before
