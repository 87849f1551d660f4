"""One drain loop over the dispatch outbox, for every kind of cluster.

The cycle writes a ``start`` row per placement in its own transaction. Draining claims the
pending rows (oldest first, at most ``dispatch_batch`` a kind), hands each cluster its works in
one ``adapter.dispatch`` call, and records what became of each: sent (with the cluster's own
id), or tried and why not (the row stays pending and the next drain tries again). Delivery is
idempotent at both ends: the remote job is named after the attempt, so a drain that dies after
delivering and before recording finds, rather than duplicates, the job next time.

Runs on the doorbell after each placing cycle (``wakeup.ring_dispatch``) and as a periodic
sweep that re-drives whatever a lost doorbell left behind.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from django.db import transaction
from django.db.models import F

from clusters.adapters.base import AdapterError, RemoteState, Sent
from clusters.adapters.registry import adapter_for
from clusters.models import Cluster
from scheduling.dispatch.desired import forget_desired
from scheduling.dispatch.remote import apply_remote_states
from scheduling.dispatch.works import load_works
from scheduling.models import DispatchOutbox, JobAttempt
from scheduling.wakeup import wake_sync

log = logging.getLogger(__name__)
MAX_BATCH = 5000


def drain_outbox(*, kind: str | None = None) -> int:
    """Deliver pending ``start`` rows (of one kind, or all); returns how many were delivered."""
    pending = DispatchOutbox.objects.filter(
        state=DispatchOutbox.State.PENDING, kind=DispatchOutbox.Kind.START
    )
    if kind is not None:
        pending = pending.filter(cluster__kind=kind)
    rows = _batch(pending.order_by("id").values_list("pk", "attempt_id", "cluster_id", "cluster__kind"))
    if not rows:
        return 0
    active = set(
        JobAttempt.objects.filter(pk__in=[r[1] for r in rows], active=True).values_list("pk", flat=True)
    )
    # An attempt already ended or requeued needs no delivery: its row is done.
    DispatchOutbox.objects.filter(pk__in=[r[0] for r in rows if r[1] not in active]).update(
        state=DispatchOutbox.State.SENT
    )
    by_cluster: dict[int, list[tuple[int, Any]]] = defaultdict(list)
    for pk, attempt_id, cluster_id, _ in rows:
        if attempt_id in active:
            by_cluster[cluster_id].append((pk, attempt_id))
    delivered = 0
    for cluster in Cluster.objects.filter(pk__in=list(by_cluster)):
        delivered += _deliver(cluster, by_cluster[cluster.pk])
    return delivered


def _batch(rows: Any) -> list[tuple[int, Any, int, str]]:
    """The oldest pending rows, at most ``dispatch_batch`` of each kind: a kind that submits one
    job at a time must not hold up a kind that delivers thousands at once."""
    taken: dict[str, int] = defaultdict(int)
    batch = []
    for row in rows[:MAX_BATCH]:
        taken[row[3]] += 1
        if taken[row[3]] <= adapter_for(row[3]).dispatch_batch:
            batch.append(row)
    return batch


def _deliver(cluster: Cluster, rows: list[tuple[int, Any]]) -> int:
    adapter = adapter_for(cluster.kind)
    works = load_works(attempt for _, attempt in rows)
    try:
        sent = adapter.dispatch(cluster, works)
    except AdapterError as exc:
        log.warning("dispatch to %s failed: %s", cluster.name, exc)
        sent = [Sent(w.attempt_id, error=str(exc)[:1000]) for w in works]
    row_of = {str(attempt): pk for pk, attempt in rows}
    ok = [s for s in sent if not s.error]
    with transaction.atomic():
        for s in ok:
            if s.remote_id:
                JobAttempt.objects.filter(pk=s.attempt_id).update(remote_id=s.remote_id)
        DispatchOutbox.objects.filter(pk__in=[row_of[s.attempt_id] for s in ok]).update(
            state=DispatchOutbox.State.SENT, tries=F("tries") + 1
        )
        for s in sent:
            if s.error:
                DispatchOutbox.objects.filter(pk=row_of[s.attempt_id]).update(
                    tries=F("tries") + 1, last_error=s.error
                )
    delivered = {s.attempt_id for s in ok}
    forget_desired(sorted({share.node_id for w in works if w.attempt_id in delivered for share in w.shares}))
    apply_remote_states([RemoteState(s.attempt_id, s.phase, message=s.message) for s in ok if s.phase])
    if ok and getattr(adapter, "sync_every_s", None) is not None:
        wake_sync(cluster.pk, 0.0)  # a polled cluster is read at once after a delivery
    return len(ok)
