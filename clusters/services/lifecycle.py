"""Node lifecycle on server time, run every few seconds.

::

    ready ──(no heartbeat for NODE_GRACE)──► not_ready ──(none for NODE_FAILOVER_AFTER)──► down
      ▲                                          │                                         │
      └────────(a run of on-time heartbeats, still going)◄─────────────────────────────────┘

Operator states (draining, drained, cordoned) are left alone.

Silence is judged only while the control plane itself hears (``clusters.services.hearing``):
while the heartbeat flush is behind, or back from an outage for less than ``NODE_GRACE``, no
node goes not ready or down — the rows are old because nobody wrote them, not because the nodes
are quiet. The pass logs once when such a pause starts and counts every paused pass.

Recovery needs the last heartbeat within ``NODE_RECOVERY_FRESH`` (about two intervals) and a
run of heartbeats without a longer gap (``good_since`` to the last one) of at least
``NODE_RECOVERY``, doubled for each further time the node went not ready within
``NODE_FLAP_WINDOW`` and capped at ``NODE_RECOVERY_MAX``: a flapping node stays not ready
instead of flipping at every return.

Going ``down`` is what triggers the job failover policy, so it is guarded twice more, as
Kubernetes' node lifecycle controller does:

* per cluster at most ``ORRERY_FAILOVER_PER_MINUTE`` nodes go down per minute (the oldest
  silent first); the rest wait for the next pass;
* when more than half of a cluster is silent at once, failover pauses for that cluster with a
  loud error: that is a network or control-plane fault, not thousands of broken machines.

Every change is a compare-and-set (only rows still in the expected state move) with a NodeEvent
in the same transaction. A cluster's own state follows its nodes: ``unreachable`` when most are
silent, ``degraded`` when some are not ready, ``ready`` otherwise.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from clusters import ports
from clusters.choices import ClusterState, NodeState
from clusters.events import NodesStateChanged
from clusters.metrics import FAILOVER_PAUSED, LIFECYCLE_DEAF, NODE_TRANSITIONS, RECOVERIES_DAMPED
from clusters.models import Cluster, Node, NodeEvent
from clusters.services.hearing import deafness
from foundation.live import publish_on_commit

log = logging.getLogger(__name__)
WATCHED = (NodeState.READY, NodeState.NOT_READY, NodeState.DOWN)
AUTOMATIC_CLUSTER_STATES = (
    ClusterState.ONBOARDING,
    ClusterState.READY,
    ClusterState.DEGRADED,
    ClusterState.UNREACHABLE,
)


@dataclass
class LifecycleResult:
    not_ready: list[int] = field(default_factory=list)
    down: list[int] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    paused: list[str] = field(default_factory=list)
    deferred: int = 0
    deaf: str | None = None  # why silence was not judged this pass (clusters.services.hearing)


def run_node_lifecycle(now: datetime | None = None) -> LifecycleResult:
    """One pass over every watched node; ``now`` is injectable so tests control the clock."""
    now = now or timezone.now()
    grace = now - timedelta(seconds=settings.NODE_GRACE)
    failover = now - timedelta(seconds=settings.NODE_FAILOVER_AFTER)
    fresh = now - timedelta(seconds=fresh_bound())
    deaf = _deafness()

    # Only nodes the lifecycle watches count: a drained or cordoned node switched off for
    # maintenance is not "silent", and must not pause failover or make its cluster unreachable.
    rows = Node.objects.filter(state__in=WATCHED).values_list(
        "pk", "cluster_id", "state", "state_changed_at", "last_seen__seen_at", "last_seen__good_since"
    )
    totals: dict[int, int] = defaultdict(int)
    silent: dict[int, int] = defaultdict(int)
    not_ready, candidates, runs = [], defaultdict(list), {}
    for pk, cluster_id, state, changed_at, seen_at, good_since in rows:
        totals[cluster_id] += 1
        seen = seen_at or changed_at  # never heartbeated: silent since it was created or last moved
        if seen < grace:
            silent[cluster_id] += 1
        if state == NodeState.READY and seen < grace:
            not_ready.append(pk)
        elif state == NodeState.NOT_READY and seen < failover:
            candidates[cluster_id].append((seen, pk))
        elif state in (NodeState.NOT_READY, NodeState.DOWN) and seen_at and seen_at >= fresh and good_since:
            runs[pk] = (seen_at - good_since).total_seconds()

    result = LifecycleResult()
    ready = _recovered(runs, now)
    if deaf:
        # Judge no silence: neither not_ready nor down, nor a cluster's state from its silent
        # nodes. Recovery goes on: a fresh run of heartbeats is evidence, not its absence.
        result.deaf = deaf
        not_ready, candidates = [], {}
    names = dict(Cluster.objects.values_list("pk", "name"))
    recent_downs = _downs_in_last_minute(now)
    for cluster_id, waiting in candidates.items():
        if silent[cluster_id] * 2 > totals[cluster_id]:
            FAILOVER_PAUSED.labels(names.get(cluster_id, str(cluster_id))).inc()
            log.error(
                "cluster %s: %d of %d nodes silent at once; failover PAUSED (suspect the network or the "
                "control plane, not the nodes)",
                names.get(cluster_id),
                silent[cluster_id],
                totals[cluster_id],
            )
            result.paused.append(names.get(cluster_id, str(cluster_id)))
            continue
        budget = max(settings.ORRERY_FAILOVER_PER_MINUTE - recent_downs.get(cluster_id, 0), 0)
        chosen = [pk for _, pk in sorted(waiting)[:budget]]
        result.deferred += len(waiting) - len(chosen)
        result.down += chosen

    with transaction.atomic():
        result.not_ready = _move(
            not_ready, NodeState.READY, NodeState.NOT_READY, f"no heartbeat for {settings.NODE_GRACE}s"
        )
        result.down = _move(
            result.down,
            NodeState.NOT_READY,
            NodeState.DOWN,
            f"no heartbeat for {settings.NODE_FAILOVER_AFTER}s",
        )
        for required, ids in sorted(ready.items()):
            result.ready += _move(
                ids,
                (NodeState.NOT_READY, NodeState.DOWN),
                NodeState.READY,
                f"heartbeats on time for {required}s",
            )
        if not deaf:
            _update_clusters(totals, silent)
        if result.down:
            lost = list(result.down)
            handler = ports.node_lost()
            transaction.on_commit(lambda: handler(lost))
    return result


def fresh_bound() -> float:
    """Seconds within which a heartbeat counts as on time: ``NODE_RECOVERY_FRESH``, and never
    more than ``NODE_GRACE`` (a node silent past the grace is not on time) — but never less
    than one flush period and one heartbeat interval: heartbeats reach the database only at
    each flush, so two consecutive ones seen there are that far apart on a healthy node (with
    short test timers a grace under the flush period would otherwise keep every node out)."""
    flush_every = float(settings.CELERY_BEAT_SCHEDULE["flush-heartbeats"]["schedule"])
    floor = flush_every + settings.ORRERY_HEARTBEAT_INTERVAL
    return max(min(settings.NODE_RECOVERY_FRESH, settings.NODE_GRACE), floor)


_deaf_since: str | None = None  # this process's current pause, so that it is logged once


def _deafness() -> str | None:
    """Why the control plane cannot judge silence now (None: it can); logs a pause's start and
    end once each, and counts every paused pass."""
    global _deaf_since
    deaf = deafness()
    if deaf:
        LIFECYCLE_DEAF.inc()
        if _deaf_since is None:
            log.warning(
                "node lifecycle PAUSED: %s; no node goes not ready or down until the control plane "
                "has heard for %ss",
                deaf,
                settings.NODE_GRACE,
            )
    elif _deaf_since is not None:
        log.warning("node lifecycle resumed: the control plane hears again")
    _deaf_since = deaf
    return deaf


def _recovered(runs: dict[int, float], now: datetime) -> dict[int, list[int]]:
    """The nodes whose run of on-time heartbeats is long enough, by the run they needed:
    ``NODE_RECOVERY`` doubled for every time after the first that the node went not ready
    within ``NODE_FLAP_WINDOW``, at most ``NODE_RECOVERY_MAX``."""
    if not runs:
        return {}
    flaps = dict(
        NodeEvent.objects.filter(
            node_id__in=list(runs),
            to_state=NodeState.NOT_READY,
            at__gte=now - timedelta(seconds=settings.NODE_FLAP_WINDOW),
        )
        .values("node_id")
        .annotate(n=Count("id"))
        .order_by()
        .values_list("node_id", "n")
    )
    ready: dict[int, list[int]] = defaultdict(list)
    for pk, run in runs.items():
        base = settings.NODE_RECOVERY
        required = min(base * 2 ** max(flaps.get(pk, 0) - 1, 0), max(settings.NODE_RECOVERY_MAX, base))
        if run >= required:
            ready[required].append(pk)
        elif run >= base:
            RECOVERIES_DAMPED.inc()
    return ready


def _downs_in_last_minute(now: datetime) -> dict[int, int]:
    rows = (
        NodeEvent.objects.filter(to_state=NodeState.DOWN, at__gte=now - timedelta(seconds=60))
        .values("node__cluster_id")
        .annotate(n=Count("id"))
        .order_by()
    )
    return {r["node__cluster_id"]: r["n"] for r in rows}


def _move(ids: list[int], from_states: str | tuple[str, ...], to: str, reason: str) -> list[int]:
    """Compare-and-set: move the nodes still in ``from_states``; returns the ids that moved."""
    if not ids:
        return []
    sources = (from_states,) if isinstance(from_states, str) else from_states
    locked = list(
        Node.objects.select_for_update(skip_locked=True)
        .filter(pk__in=ids, state__in=sources)
        .values_list("pk", "state", "cluster_id", "name")
    )
    if not locked:
        return []
    now = timezone.now()
    moved = [row[0] for row in locked]
    Node.objects.filter(pk__in=moved).update(state=to, state_reason=reason, state_changed_at=now)
    NodeEvent.objects.bulk_create(
        NodeEvent(node_id=pk, from_state=state, to_state=to, reason=reason) for pk, state, _, _ in locked
    )
    NODE_TRANSITIONS.labels(to).inc(len(moved))
    by_cluster: dict[int, list[int]] = defaultdict(list)
    for pk, _, cluster_id, _ in locked:
        by_cluster[cluster_id].append(pk)
    for cluster_id, node_ids in by_cluster.items():  # one live message per cluster, not per node
        event = NodesStateChanged(cluster_id, node_ids[:5000], len(node_ids), to, reason, now.isoformat())
        publish_on_commit([f"cluster.{cluster_id}", "fleet"], event)
    return moved


def _update_clusters(totals: dict[int, int], silent: dict[int, int]) -> None:
    states = dict(
        Node.objects.filter(state__in=(NodeState.NOT_READY, NodeState.DOWN))
        .values("cluster_id")
        .annotate(n=Count("id"))
        .values_list("cluster_id", "n")
    )
    for cluster in Cluster.objects.filter(state__in=AUTOMATIC_CLUSTER_STATES, pk__in=list(totals)):
        total, quiet = totals[cluster.pk], silent.get(cluster.pk, 0)
        if quiet * 2 > total:
            state, reason = ClusterState.UNREACHABLE, f"{quiet}/{total} nodes silent"
        elif states.get(cluster.pk):
            state, reason = ClusterState.DEGRADED, f"{states[cluster.pk]}/{total} nodes not ready"
        else:
            state, reason = ClusterState.READY, f"{total} nodes reporting"
        if (cluster.state, cluster.state_reason) != (state, reason):
            Cluster.objects.filter(pk=cluster.pk, state=cluster.state).update(
                state=state,
                state_reason=reason,
                state_changed_at=timezone.now() if state != cluster.state else cluster.state_changed_at,
            )
