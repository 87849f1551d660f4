"""A Slurm cluster's inventory: the collector that keeps its nodes and GPUs current through the
ordinary heartbeat pipeline, and the client built from the cluster's stored settings."""

from __future__ import annotations

import time
import uuid

from django.db import transaction

from clusters.adapters.base import Inventory
from clusters.adapters.slurm.api import SlurmClient, SlurmNode
from clusters.choices import OPERATOR_NODE_STATES, NodeState
from clusters.ingest.buffer import get_buffer
from clusters.ingest.records import collector_record
from clusters.models import Cluster, ClusterSecret, Node
from clusters.selectors import resolve_gpu_model
from clusters.services.credentials import GpuDescription, NodeDescription, upsert_node
from clusters.services.nodes import set_node_state

_BOOT = uuid.uuid4().hex  # one "boot" per collector process: its sequence numbers start afresh


def client_for(cluster: Cluster) -> SlurmClient:
    row = ClusterSecret.objects.filter(cluster=cluster).first()
    secret = row.data if row is not None else {}
    return SlurmClient(
        cluster.config.get("url", ""), secret.get("token", ""), cluster.config.get("user", "root")
    )


def collect(cluster: Cluster, client: SlurmClient | None = None) -> Inventory:
    """One inventory pass: nodes and GPUs as Slurm sees them. Nodes Slurm reports healthy send a
    heartbeat through the buffer (so the lifecycle treats them like any other); drained and
    down nodes take Slurm's state at once."""
    client = client or client_for(cluster)
    nodes = client.nodes()
    unknown: set[str] = set()
    gpus = 0
    existing = dict(Node.objects.filter(cluster=cluster).values_list("name", "pk"))
    records = []
    now = time.time()
    for n in nodes:
        model = resolve_gpu_model(n.gpu_type) if n.gpu_type else None
        if n.gpus and model is None:
            unknown.add(n.gpu_type or "(untyped)")
        description = NodeDescription(
            name=n.name,
            cpu_millicores=n.cpus * 1000,
            memory_bytes=n.memory_mb * 2**20,
            gpus=[GpuDescription(index=i, model=model) for i in range(n.gpus)] if model else [],
            labels={"slurm.io/partitions": ",".join(n.partitions)},
            agent_version="slurm",
            boot_id=_BOOT,
        )
        if n.name not in existing:
            existing[n.name] = upsert_node(cluster, description).pk
        gpus += n.gpus if model else 0
        _follow_slurm_state(existing[n.name], n)
        if n.state == NodeState.READY:
            devices = [[i, "", "", 0, None, None, None, None, "healthy", None] for i in range(n.gpus)]
            records.append(
                collector_record(
                    existing[n.name], cluster.pk, boot=_BOOT, agent="slurm", gpus=devices, now=now
                )
            )
    if records:  # after commit: onboarding creates the nodes in the same transaction
        transaction.on_commit(lambda: get_buffer().put(records))
    return Inventory(len(nodes), gpus, tuple(sorted(unknown)))


def _follow_slurm_state(node_id: int, n: SlurmNode) -> None:
    """Slurm's drain and down are facts about the node Orrery must not schedule around; a
    node Slurm calls healthy is left to the heartbeat lifecycle (it may be drained in Orrery)."""
    if n.state not in (NodeState.DOWN, NodeState.DRAINED, NodeState.DRAINING):
        if Node.objects.filter(
            pk=node_id, state__in=OPERATOR_NODE_STATES | {NodeState.DOWN}, state_reason__startswith="slurm: "
        ).exists():
            _set(node_id, NodeState.NOT_READY, "slurm: back in service")
        return
    _set(node_id, n.state, f"slurm: {n.reason or n.state}")


def _set(node_id: int, state: str, reason: str) -> None:
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(pk=node_id).first()
        if node is not None and node.state != state:
            set_node_state(node, state, {node.state}, actor=None, reason=reason[:255])
