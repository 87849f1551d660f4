"""A Slurm cluster's inventory: the collector that keeps its nodes and GPUs current through the
ordinary heartbeat pipeline, and the client built from the cluster's stored settings.

A node's GPUs come from its GRES (``gres.parse_node_gres``): its whole GPUs first (indices 0…,
of the first GPU type it lists), then its MIG instances grouped into GPUs in MIG mode
(``clusters.adapters.mig.pack``), of the GPU type their Slurm type names (``a100_1g.10gb``), or
of the node's whole GPUs' type, or of the cluster's ``gpu_type``. Orrery has one GPU model a
node: MIG instances of another model than the node's whole GPUs are left out. The node's GRES is
kept in its labels (``slurm.io/gres``; its whole GPUs' type in ``slurm.io/gres-type``), which is
what dispatch asks for GPUs by, and a node whose GRES, partitions, CPUs or memory changed is
described again.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction
from django.db.models import ProtectedError

from clusters.adapters.base import Inventory
from clusters.adapters.mig import pack
from clusters.adapters.slurm.api import SlurmClient, SlurmNode
from clusters.adapters.slurm.gres import MAX_GRES_CHARS, NodeGres, parse_node_gres
from clusters.choices import OPERATOR_NODE_STATES, NodeState
from clusters.ingest.buffer import get_buffer
from clusters.ingest.records import MAX_GPUS, collector_record
from clusters.models import Cluster, ClusterSecret, GpuModel, Node
from clusters.selectors import resolve_gpu_model
from clusters.services.credentials import GpuDescription, NodeDescription, upsert_node
from clusters.services.mig import MigDescription
from clusters.services.nodes import set_node_state

log = logging.getLogger(__name__)
_BOOT = uuid.uuid4().hex  # one "boot" per collector process: its sequence numbers start afresh
GRES_LABEL = "slurm.io/gres"
GRES_TYPE_LABEL = "slurm.io/gres-type"
PARTITIONS_LABEL = "slurm.io/partitions"


@dataclass(frozen=True)
class SlurmGpus:
    """A node's GPUs as Orrery models them (pure: from its GRES alone). ``whole`` GPUs of
    ``whole_type`` first, then ``mig``: GPUs in MIG mode of ``mig_type``, each its instances in
    the agent-report shape; ``dropped`` instances did not fit in a node's ``MAX_GPUS``."""

    whole_type: str | None = None
    whole: int = 0
    gres_type: str = ""  # the whole GPUs' type as the GRES names it ("" for untyped GRES)
    mig_type: str | None = None
    mig: list[list[dict[str, Any]]] = field(default_factory=list)
    dropped: int = 0


def slurm_gpus(gres: NodeGres, default_type: str | None = None) -> SlurmGpus:
    """The GPUs of a node with this GRES (module docstring); ``default_type`` is the type of
    GPUs whose GRES names none (the cluster's ``gpu_type``)."""
    whole_type = gres.gpu_type
    whole = min(gres.gpus.get(whole_type, 0), MAX_GPUS) if gres.gpus else 0
    parents = [e.parent_type for e in gres.mig.values() if e.parent_type]
    mig_type = parents[0] if parents else (whole_type or default_type)
    counts = {
        profile: entry.count
        for profile, entry in gres.mig.items()
        if entry.parent_type in (None, mig_type)  # one model a node: another parent is left out
    }
    mig, dropped = pack(counts, max_gpus=MAX_GPUS - whole)
    return SlurmGpus(whole_type or default_type, whole, whole_type or "", mig_type, mig, dropped)


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
    existing = {
        row[0]: row[1:]
        for row in Node.objects.filter(cluster=cluster).values_list(
            "name", "pk", "cpu_millicores_capacity", "memory_bytes_capacity", "gpu_capacity", "labels"
        )
    }
    models: dict[str, GpuModel | None] = {}
    default_type = cluster.config.get("gpu_type")
    default_type = default_type if isinstance(default_type, str) and default_type else None
    records = []
    now = time.time()
    for n in nodes:
        layout = slurm_gpus(parse_node_gres(n.gres), default_type)
        if layout.dropped:
            log.warning(
                "slurm node %s/%s: %d MIG instances past %d GPUs left out",
                cluster,
                n.name,
                layout.dropped,
                MAX_GPUS,
            )
        description, missing = _description(n, layout, models)
        unknown |= missing
        row = existing.get(n.name)
        facts = (
            description.cpu_millicores,
            description.memory_bytes,
            len(description.gpus),
            description.labels,
        )
        if row is None or tuple(row[1:]) != facts:
            node_id = _upsert(cluster, description)
            if node_id is None and row is None:
                continue
            if node_id is not None:
                existing[n.name] = (node_id, *facts)
        node_id = existing[n.name][0]
        gpus += len(description.gpus)
        _follow_slurm_state(node_id, n)
        if n.state == NodeState.READY:
            devices = [
                [g.index, "", "", 0, None, None, None, None, "healthy", None] for g in description.gpus
            ]
            records.append(
                collector_record(node_id, cluster.pk, boot=_BOOT, agent="slurm", gpus=devices, now=now)
            )
    if records:  # after commit: onboarding creates the nodes in the same transaction
        transaction.on_commit(lambda: get_buffer().put(records))
    return Inventory(len(nodes), gpus, tuple(sorted(unknown)))


def _description(
    n: SlurmNode, layout: SlurmGpus, models: dict[str, GpuModel | None]
) -> tuple[NodeDescription, set[str]]:
    """The node as the resource model describes it, and the GPU types the catalog lacks."""

    def model_of(name: str | None) -> GpuModel | None:
        if name and name not in models:
            models[name] = resolve_gpu_model(name)
        return models.get(name) if name else None

    unknown: set[str] = set()
    gpus: list[GpuDescription] = []
    whole = model_of(layout.whole_type)
    if layout.whole:
        if whole is None:
            unknown.add(layout.whole_type or "(untyped)")
        else:
            gpus += [GpuDescription(index=i, model=whole) for i in range(layout.whole)]
    if layout.mig:
        parent = model_of(layout.mig_type)
        if parent is None:
            unknown.add(layout.mig_type or "(untyped MIG)")
        elif not gpus or parent == whole:
            start = len(gpus)
            gpus += [_mig_gpu(start + i, parent, instances) for i, instances in enumerate(layout.mig)]
    labels = {PARTITIONS_LABEL: ",".join(n.partitions)}
    if n.gres and len(n.gres) <= MAX_GRES_CHARS:
        labels[GRES_LABEL] = n.gres
    if layout.gres_type:
        labels[GRES_TYPE_LABEL] = layout.gres_type  # asked for by name: a MIG instance never answers
    description = NodeDescription(
        name=n.name,
        cpu_millicores=n.cpus * 1000,
        memory_bytes=n.memory_mb * 2**20,
        gpus=gpus,
        labels=labels,
        agent_version="slurm",
        boot_id=_BOOT,
    )
    return description, unknown


def _mig_gpu(index: int, model: GpuModel, instances: list[dict[str, Any]]) -> GpuDescription:
    """A GPU in MIG mode, its instances in the agent-report shape (``GpuDescription.mig``)."""
    return GpuDescription(index=index, model=model, mig=tuple(MigDescription(**i) for i in instances))


def _upsert(cluster: Cluster, description: NodeDescription) -> int | None:
    """Describe the node (a savepoint: one node refused does not undo the pass); None when a GPU
    that went away is still held by an allocation (it is tried again at the next pass)."""
    try:
        with transaction.atomic():
            return upsert_node(cluster, description).pk
    except ProtectedError:
        log.warning("slurm node %s/%s: a GPU that went away is still allocated", cluster, description.name)
        return None


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
