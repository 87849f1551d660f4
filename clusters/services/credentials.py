"""Join tokens, node credentials and cluster credentials: issue, register, authenticate, revoke.

Authentication sits on the heartbeat hot path, so it is a cached lookup: each process keeps
``digest → identity`` for ``CACHE_TTL_S`` seconds. A revocation therefore takes effect within
that time on every process (and at once on the one that revoked). A node credential the cache
does not hold costs one read, and at most every ``CACHE_TTL_S / 2`` that read brings along the
live credentials of the node's whole cluster: with nodes reporting every 10 s spread over
several server processes, a per-credential read alone missed on most heartbeats.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, F, OuterRef, Q, QuerySet
from django.utils import timezone

from clusters.choices import GpuHealth, NodeState
from clusters.models import (
    Cluster,
    ClusterCredential,
    GpuDevice,
    GpuModel,
    JoinToken,
    Node,
    NodeCredential,
    NodeLastSeen,
)
from clusters.services.mig import MigDescription, sync_mig_instances
from clusters.services.nodes import set_node_state
from foundation import audit
from foundation.choices import AuditAction
from foundation.secrets import digest, new_secret

JOIN_PREFIX, NODE_PREFIX, CLUSTER_PREFIX = "orj_", "orn_", "orc_"
CACHE_TTL_S = 30.0


class CredentialRefused(Exception):
    """The secret is unknown, expired, used up or revoked."""


class NodeTaken(Exception):
    """A node of that name is registered and holds a live credential: registering it again
    needs that credential, or an operator who lets it register again."""


@dataclass(frozen=True)
class NodeIdentity:
    """Who a node credential speaks for. ``mig_wanted``: some GPU of the node has a MIG layout an
    operator asked for (then its heartbeat's answer reads them: ``clusters.services.mig``); as
    cached with the identity, so a new wish reaches a node within ``CACHE_TTL_S``."""

    node_id: int
    node_name: str
    cluster_id: int
    cluster_kind: str = ""
    mig_wanted: bool = False


@dataclass(frozen=True)
class ClusterIdentity:
    cluster_id: int
    cluster_name: str


class _TtlCache:
    def __init__(self) -> None:
        self._items: dict[str, tuple[float, Any]] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        item = self._items.get(key)
        if item is None or item[0] < time.monotonic():
            return None
        return item[1]

    def put(self, key: str, value: Any) -> None:
        self.put_many({key: value})

    def put_many(self, items: dict[str, Any]) -> None:
        expires = time.monotonic() + CACHE_TTL_S
        with self._lock:
            if len(self._items) + len(items) > MAX_CACHED:
                self._items.clear()
            self._items.update((key, (expires, value)) for key, value in items.items())

    def drop(self, key: str) -> None:
        self._items.pop(key, None)

    def clear(self) -> None:
        self._items.clear()


MAX_CACHED = 250_000
_identities = _TtlCache()
_clusters_read: dict[int, float] = {}  # cluster id → when its node credentials were last read
_clusters_lock = threading.Lock()


@transaction.atomic
def create_join_token(
    cluster: Cluster,
    *,
    name: str = "default",
    expires_at: datetime | None = None,
    max_uses: int | None = 1,
    actor: Any = None,
) -> tuple[JoinToken, str]:
    """A join token for ``cluster``: it expires at ``expires_at`` (default: in
    ``ORRERY_JOIN_TOKEN_TTL_S``, an hour) and admits ``max_uses`` machines (None: any number
    until it expires). The plaintext is returned once, and never recorded: the audit log keeps
    its prefix and who asked (``actor``)."""
    secret = new_secret(JOIN_PREFIX)
    token = JoinToken.objects.create(
        cluster=cluster,
        name=name,
        prefix=secret.prefix,
        digest=secret.digest,
        expires_at=expires_at or timezone.now() + timedelta(seconds=settings.ORRERY_JOIN_TOKEN_TTL_S),
        max_uses=max_uses,
    )
    details = {
        "cluster": cluster.name,
        "name": name,
        "expires_at": token.expires_at.isoformat(),
        "max_uses": max_uses,
    }
    audit.record(
        AuditAction.JOIN_TOKEN_CREATE, actor=actor, target=f"join_token:{token.prefix}", details=details
    )
    return token, secret.plaintext


@transaction.atomic
def issue_cluster_credential(
    cluster: Cluster, *, name: str = "collector", actor: Any = None
) -> tuple[ClusterCredential, str]:
    """A collector credential for ``cluster``; the plaintext is returned once, never recorded."""
    secret = new_secret(CLUSTER_PREFIX)
    credential = ClusterCredential.objects.create(
        cluster=cluster, name=name, prefix=secret.prefix, digest=secret.digest
    )
    audit.record(
        AuditAction.CLUSTER_CREDENTIAL_CREATE,
        actor=actor,
        target=f"cluster_credential:{credential.prefix}",
        details={"cluster": cluster.name, "name": name},
    )
    return credential, secret.plaintext


@transaction.atomic
def revoke(credential: JoinToken | NodeCredential | ClusterCredential, *, actor: Any = None) -> None:
    """Revoke at once in this process, within ``CACHE_TTL_S`` in the others. Idempotent. An
    operator's revocation (``actor`` given) is audited; an agent's rotation of its own node
    credential is not."""
    revoked = (
        type(credential)
        .objects.filter(pk=credential.pk, revoked_at__isnull=True)
        .update(revoked_at=timezone.now())
    )
    _identities.drop(credential.digest)
    # again once committed: a cluster's credentials read meanwhile still saw it live
    transaction.on_commit(lambda: _identities.drop(credential.digest))
    if revoked and actor is not None:
        target = f"{_AUDIT_KIND[type(credential)]}:{credential.prefix}"
        audit.record(AuditAction.CREDENTIAL_REVOKE, actor=actor, target=target)


_AUDIT_KIND = {
    JoinToken: "join_token",
    NodeCredential: "node_credential",
    ClusterCredential: "cluster_credential",
}


@dataclass(frozen=True)
class GpuDescription:
    """One GPU as its node reports it; ``mig``: its instances when it is in MIG mode (None: it
    is not)."""

    index: int
    model: GpuModel
    uuid: str = ""
    memory_mb: int = 0
    topology_group: str = ""
    mig: tuple[MigDescription, ...] | None = None


@dataclass(frozen=True)
class NodeDescription:
    """What a node says about itself when it joins (validated by the caller)."""

    name: str
    cpu_millicores: int
    memory_bytes: int
    gpus: list[GpuDescription]
    labels: dict[str, str]
    agent_version: str = ""
    boot_id: str = ""
    rack: str = ""


def join_cluster(plaintext: str) -> Cluster:
    """The cluster a join token admits to, counting one use; ``CredentialRefused`` otherwise.
    The use is counted by a compare-and-set, so two machines racing for a token's last use
    cannot both win."""
    token = JoinToken.objects.select_related("cluster").filter(digest=digest(plaintext)).first()
    if token is None:
        raise CredentialRefused("unknown join token")
    used = (
        JoinToken.objects.filter(pk=token.pk, revoked_at__isnull=True)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now()))
        .filter(Q(max_uses__isnull=True) | Q(uses__lt=F("max_uses")))
        .update(uses=F("uses") + 1)
    )
    if not used:
        raise CredentialRefused("expired, used up or revoked join token")
    return token.cluster


_REPORTED_GPU_FIELDS = ["model", "uuid", "memory_mb", "topology_group"]


@transaction.atomic
def upsert_node(cluster: Cluster, description: NodeDescription) -> Node:
    """Create the node, or refresh what it says about itself if it exists (same name in the
    cluster). Its GPUs are made to match the description, and so are their MIG instances (but
    not those active allocations hold: ``sync_mig_instances``). A new node is ``not_ready`` until its
    first valid heartbeat and NODE_RECOVERY seconds of them on time (the aggregation pass starts
    its liveness row); an operator state (drained, cordoned…) is kept."""
    node, _ = Node.objects.select_for_update().get_or_create(
        cluster=cluster,
        name=description.name,
        defaults={"state": NodeState.NOT_READY, "state_reason": "registered; waiting for heartbeats"},
    )
    node.cpu_millicores_capacity = node.cpu_millicores_allocatable = description.cpu_millicores
    node.memory_bytes_capacity = node.memory_bytes_allocatable = description.memory_bytes
    node.gpu_capacity = len(description.gpus)
    node.labels = description.labels
    node.agent_version, node.boot_id = description.agent_version, description.boot_id
    node.rack = description.rack or node.rack
    node.save()
    existing = {g.index: g for g in GpuDevice.objects.filter(node=node)}
    wanted = {g.index for g in description.gpus}
    GpuDevice.objects.filter(node=node).exclude(index__in=wanted).delete()
    devices = {}
    for gpu in description.gpus:
        device = existing.get(gpu.index) or GpuDevice(node=node, index=gpu.index, health=GpuHealth.HEALTHY)
        device.model, device.uuid = gpu.model, gpu.uuid
        device.memory_mb = gpu.memory_mb or gpu.model.memory_mb
        device.topology_group = gpu.topology_group
        # Only what the node says: an operator's fields (shareable, the MIG layout wanted) may
        # change meanwhile, and stay as the operator left them.
        device.save(update_fields=_REPORTED_GPU_FIELDS if device.pk else None)
        devices[gpu.index] = device
    # MIG mode and instances are read only where MIG is or was: a node of plain GPUs costs no
    # query more.
    if any(g.mig is not None for g in description.gpus) or any(g.mig_enabled for g in existing.values()):
        sync_mig_instances(node, devices, {g.index: g.mig for g in description.gpus})
    return node


@transaction.atomic
def register_node(join_token: str, description: NodeDescription, current: str = "") -> tuple[Node, str]:
    """Trade a join token for a node credential. A name already registered cannot be taken
    over: registering it again needs its ``current`` credential (an agent rotating it), or an
    operator who let it register again (``allow_reregistration``: a reinstalled machine, a
    wiped work dir); ``NodeTaken`` otherwise, and nothing changes. Either way the node's
    liveness starts afresh: it is not ready until its first valid heartbeat."""
    cluster = join_cluster(join_token)
    existing = Node.objects.select_for_update().filter(cluster=cluster, name=description.name).first()
    if existing is not None:
        live = NodeCredential.objects.filter(node=existing, revoked_at__isnull=True)
        if live.exists() and not (current and live.filter(digest=digest(current)).exists()):
            raise NodeTaken(
                f"node '{existing.name}' is registered; register it again with its current credential, "
                "or ask an operator to let it register again"
            )
        NodeLastSeen.objects.filter(node=existing).delete()
        if existing.state == NodeState.READY:  # through the one place node states change (history)
            set_node_state(
                existing, NodeState.NOT_READY, {NodeState.READY}, actor=None, reason="registered again"
            )
    node = upsert_node(cluster, description)
    for old in NodeCredential.objects.filter(node=node, revoked_at__isnull=True):
        revoke(old)
    secret = new_secret(NODE_PREFIX)
    NodeCredential.objects.create(node=node, prefix=secret.prefix, digest=secret.digest)
    return node, secret.plaintext


@transaction.atomic
def allow_reregistration(node: Node, *, actor: Any = None) -> int:
    """An operator's "replace node": revoke the node's live credentials, so the machine (or its
    replacement) can register under that name again with a join token. Returns how many were
    revoked."""
    live = list(NodeCredential.objects.filter(node=node, revoked_at__isnull=True))
    for credential in live:
        revoke(credential, actor=actor)
    return len(live)


def authenticate_node(plaintext: str) -> NodeIdentity:
    identity = _identity(plaintext, NodeIdentity, _live_node_credentials)
    _read_cluster_credentials(identity.cluster_id)
    return identity


def authenticate_cluster(plaintext: str) -> ClusterIdentity:
    return _identity(plaintext, ClusterIdentity, _live_cluster_credentials)


def _live_node_credentials() -> QuerySet:
    """``(digest, *NodeIdentity fields)`` of live node credentials."""
    wishes = GpuDevice.objects.filter(node_id=OuterRef("node_id"), mig_layout_wanted__isnull=False)
    fields = ("digest", "node_id", "node__name", "node__cluster_id", "node__cluster__kind", "mig_wanted")
    live = NodeCredential.objects.filter(revoked_at__isnull=True)
    return live.annotate(mig_wanted=Exists(wishes)).values_list(*fields)


def _live_cluster_credentials() -> QuerySet:
    """``(digest, *ClusterIdentity fields)`` of live cluster credentials."""
    live = ClusterCredential.objects.filter(revoked_at__isnull=True)
    return live.values_list("digest", "cluster_id", "cluster__name")


def _identity(plaintext: str, kind: type, live: Callable[[], QuerySet]) -> Any:
    """Who a live credential of ``kind`` speaks for: from the process cache, or one indexed
    read of its digest; ``CredentialRefused`` otherwise. The query is built only on a miss:
    building it (joins, an ``Exists``) cost four times the rest of a heartbeat."""
    key = digest(plaintext)
    identity = _identities.get(key)
    if identity is None:
        row = live().filter(digest=key).first()
        if row is None:
            raise CredentialRefused(
                f"unknown or revoked {kind.__name__.removesuffix('Identity').lower()} credential"
            )
        identity = kind(*row[1:])
        _identities.put(key, identity)
    if not isinstance(identity, kind):
        raise CredentialRefused(f"not a {kind.__name__.removesuffix('Identity').lower()} credential")
    return identity


def _read_cluster_credentials(cluster_id: int) -> None:
    """Cache every live node credential of the cluster, unless that was done less than
    ``CACHE_TTL_S / 2`` ago: one read instead of one per node. Each identity is as fresh as a
    read of its own would be, so revocation keeps its bound."""
    now = time.monotonic()
    with _clusters_lock:
        if _clusters_read.get(cluster_id, -CACHE_TTL_S) > now - CACHE_TTL_S / 2:
            return
        _clusters_read[cluster_id] = now  # other threads' misses meanwhile read one row each
    rows = _live_node_credentials().filter(node__cluster_id=cluster_id)
    _identities.put_many({row[0]: NodeIdentity(*row[1:]) for row in rows})


def forget_cached_identities() -> None:
    """For tests and operators' tools: make the next request read the database."""
    _identities.clear()
    _clusters_read.clear()
