"""Machines running the Orrery node agent (``orrery-agent``).

Agents pull: each heartbeat's answer lists the attempts the node should run, and the agent
reports starts, exits and output itself (``POST agent/attempts``), killing whatever it runs
that is no longer desired. So there is nothing to push and nothing to poll: a delivery is
acknowledged at once (the kind-agnostic dispatcher refreshes the nodes' desired lists), and a
cancel takes effect at the node's next heartbeat, when the attempt is no longer desired.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from clusters.adapters.base import Inventory, Sent, Synced, Work
from clusters.choices import ClusterKind
from clusters.models import Cluster, GpuDevice, Node


class NativeAdapter:
    kind: ClassVar[str] = ClusterKind.NATIVE
    runs_images: ClassVar[bool] = True
    image_label: ClassVar[str | None] = "orrery.io/containers"  # agents that found podman say so
    needs_image: ClassVar[bool] = False
    shares_node_network: ClassVar[bool] = True
    runs_user_code: ClassVar[bool] = True
    pulls_inventory: ClassVar[bool] = False
    inventory_every_s: ClassVar[float] = 10.0
    dispatch_batch: ClassVar[int] = 5000
    sync_every_s: ClassVar[float | None] = None  # agents push their reports

    def inventory(self, cluster: Cluster) -> Inventory:
        return registered_inventory(cluster)

    def dispatch(self, cluster: Cluster, works: Sequence[Work]) -> list[Sent]:
        return [Sent(w.attempt_id) for w in works]

    def sync(self, cluster: Cluster, works: Sequence[Work]) -> Synced:
        return Synced()

    def cancel(self, cluster: Cluster, remote_ids: Sequence[str]) -> int:
        return 0  # level-triggered: an attempt no longer desired is killed by its agent


def registered_inventory(cluster: Cluster) -> Inventory:
    """The nodes and GPUs a cluster's members registered themselves (agents, collectors)."""
    return Inventory(
        Node.objects.filter(cluster=cluster).count(),
        GpuDevice.objects.filter(node__cluster=cluster).count(),
    )
