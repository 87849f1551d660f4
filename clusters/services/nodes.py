"""Operator actions on nodes: drain, cordon, resume.

Every change is a compare-and-set ``UPDATE … WHERE state IN (allowed)`` plus a NodeEvent in the
same transaction (and, for an operator's action, an audit entry), and a live event after commit.

A drained node is one that is draining *and* holds no work. What holds work is the scheduling
app's business, which this app must not import: it asks the ``node_workload`` port
(``clusters.ports``).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from clusters import ports
from clusters.choices import NodeState
from clusters.events import NodeStateChanged
from clusters.models import Node, NodeEvent, NodeLastSeen
from foundation import audit
from foundation.choices import AuditAction
from foundation.live import publish_on_commit


class NodeActionRefused(Exception):
    """The node is not in a state the action applies to; nothing was changed."""


def busy_node_ids(node_ids: Iterable[int]) -> set[int]:
    return set(ports.node_workload()(list(node_ids)))


def set_node_state(
    node: Node, to: str, allowed: Iterable[str], *, actor: AbstractBaseUser | None, reason: str
) -> bool:
    """Move one node to ``to`` if it is still in one of ``allowed``. False if someone else won."""
    now = timezone.now()
    current = node.state
    if current not in allowed:
        return False
    updated = Node.objects.filter(pk=node.pk, state=current).update(
        state=to, state_reason=reason, state_changed_at=now
    )
    if not updated:
        return False
    NodeEvent.objects.create(node=node, from_state=current, to_state=to, reason=reason, actor=actor)
    node.state, node.state_reason, node.state_changed_at = to, reason, now
    event = NodeStateChanged(node.pk, node.cluster_id, node.name, current, to, reason, now.isoformat())
    publish_on_commit([f"cluster.{node.cluster_id}", "fleet"], event)
    return True


@transaction.atomic
def drain_node(node: Node, *, actor: AbstractBaseUser | None, reason: str = "") -> Node:
    """Stop new placements on the node; running work finishes. The node is ``drained`` at once
    if it holds no work, ``draining`` otherwise (``settle_draining_nodes`` finishes the job).
    Idempotent: draining a draining or drained node changes nothing."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    if node.state in (NodeState.DRAINING, NodeState.DRAINED):
        return node
    to = NodeState.DRAINING if node.pk in busy_node_ids([node.pk]) else NodeState.DRAINED
    allowed = set(NodeState.values) - {NodeState.DRAINING, NodeState.DRAINED}
    if set_node_state(node, to, allowed, actor=actor, reason=reason or "drained by an operator"):
        _audit(AuditAction.NODE_DRAIN, node, actor)
    return node


@transaction.atomic
def cordon_node(node: Node, *, actor: AbstractBaseUser | None, reason: str = "") -> Node:
    """Stop new placements on the node without waiting for anything; running work goes on."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    allowed = {NodeState.READY, NodeState.NOT_READY, NodeState.DOWN}
    if node.state == NodeState.CORDONED:
        return node
    if not set_node_state(
        node, NodeState.CORDONED, allowed, actor=actor, reason=reason or "cordoned by an operator"
    ):
        raise NodeActionRefused(f"{node} is {node.state}; only a ready, not-ready or down node is cordoned.")
    _audit(AuditAction.NODE_CORDON, node, actor)
    return node


@transaction.atomic
def resume_node(node: Node, *, actor: AbstractBaseUser | None, reason: str = "") -> Node:
    """Undo drain or cordon. The node becomes ``ready`` if it heartbeated within NODE_GRACE,
    otherwise ``not_ready`` until heartbeats return."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    allowed = {NodeState.DRAINING, NodeState.DRAINED, NodeState.CORDONED}
    if node.state not in allowed:
        raise NodeActionRefused(f"{node} is {node.state}; only a draining, drained or cordoned node resumes.")
    fresh = NodeLastSeen.objects.filter(
        node=node, seen_at__gte=timezone.now() - timedelta(seconds=settings.NODE_GRACE)
    ).exists()
    to = NodeState.READY if fresh else NodeState.NOT_READY
    if set_node_state(node, to, allowed, actor=actor, reason=reason or "resumed by an operator"):
        _audit(AuditAction.NODE_RESUME, node, actor)
    return node


def _audit(action: str, node: Node, actor: AbstractBaseUser | None) -> None:
    details = {"node_id": node.pk, "state": node.state, "reason": node.state_reason}
    audit.record(action, actor=actor, target=f"node:{node.cluster.name}/{node.name}", details=details)


def settle_draining_nodes(node_ids: Iterable[int] | None = None) -> int:
    """Mark ``drained`` every draining node (of ``node_ids``, or all) that holds no work.
    Returns how many nodes it settled. Safe to call from any transaction, any number of times."""
    candidates = Node.objects.filter(state=NodeState.DRAINING)
    if node_ids is not None:
        candidates = candidates.filter(pk__in=list(node_ids))
    nodes = list(candidates)
    if not nodes:
        return 0
    busy = busy_node_ids(n.pk for n in nodes)
    settled = 0
    with transaction.atomic():
        for node in nodes:
            if node.pk not in busy and set_node_state(
                node, NodeState.DRAINED, {NodeState.DRAINING}, actor=None, reason="drained: no work left"
            ):
                settled += 1
    return settled
