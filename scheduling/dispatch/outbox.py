"""One drain loop over the dispatch outbox, for every kind of cluster.

The cycle writes a ``start`` row per placement in its own transaction. Draining takes each
kind's oldest pending rows (at most its adapter's ``dispatch_batch``), closes rows whose attempt
already ended, hands each cluster its works in one ``adapter.dispatch`` call, and records what
became of each as the adapter yields it: sent (with the cluster's own id, and the attempt's first
move when the cluster made one at once), or tried and why not (the row stays pending and the
next drain tries again).

Delivery is idempotent at both ends: the remote job is named after the attempt, so a drain that
dies after delivering and before recording finds, rather than duplicates, the job next time; and
only one drain at a time delivers to a cluster (a lease in the cache), so two workers never
submit the same rows side by side. Runs on the doorbell after each placing cycle
(``wakeup.ring_dispatch``) and as a periodic sweep that re-drives whatever a lost doorbell left.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from django.core.cache import cache
from django.db import transaction
from django.db.models import F

from clusters.adapters.base import AdapterError, RemoteState, Sent, Work
from clusters.adapters.registry import ADAPTERS, adapter_for
from clusters.models import Cluster
from scheduling.dispatch.desired import forget_desired
from scheduling.dispatch.remote import apply_remote_states
from scheduling.dispatch.works import load_works
from scheduling.models import DispatchOutbox, JobAttempt
from scheduling.wakeup import ring_dispatch, wake_sync

log = logging.getLogger(__name__)
LEASE_S = 120  # renewed at each record: longer than one delivery can take (squeue + sbatch time-outs)
RECORD_EVERY_S = 0.2  # a slow adapter's results are recorded at least this often


def drain_outbox() -> int:
    """Deliver pending ``start`` rows of every kind that has an adapter (rows of a kind without
    one wait). Returns how many were delivered."""
    delivered = 0
    for kind in ADAPTERS:
        batch = adapter_for(kind).dispatch_batch
        rows = list(
            DispatchOutbox.objects.filter(
                state=DispatchOutbox.State.PENDING, kind=DispatchOutbox.Kind.START, cluster__kind=kind
            )
            .order_by("id")
            .values_list("pk", "attempt_id", "cluster_id")[:batch]
        )
        if not rows:
            continue
        delivered += _drain(rows)
        if len(rows) == batch:
            ring_dispatch()  # more are waiting: come back at once rather than at the next sweep
    return delivered


def _drain(rows: list[tuple[int, Any, int]]) -> int:
    active = set(
        JobAttempt.objects.filter(pk__in=[r[1] for r in rows], active=True).values_list("pk", flat=True)
    )
    # An attempt already ended or requeued needs no delivery: its row is done.
    DispatchOutbox.objects.filter(pk__in=[pk for pk, attempt, _ in rows if attempt not in active]).update(
        state=DispatchOutbox.State.SENT
    )
    by_cluster: dict[int, list[tuple[int, Any]]] = defaultdict(list)
    for pk, attempt, cluster_id in rows:
        if attempt in active:
            by_cluster[cluster_id].append((pk, attempt))
    delivered = 0
    for cluster in Cluster.objects.filter(pk__in=list(by_cluster)):
        lease = f"orrery:dispatching:{cluster.pk}"
        if not cache.add(lease, 1, timeout=LEASE_S):
            continue  # another drain is delivering to this cluster now
        try:
            delivered += _deliver(cluster, by_cluster[cluster.pk], lease)
        except Exception:  # one broken cluster must not stop delivery to the others
            log.exception("dispatch to cluster %s failed; its rows are tried again", cluster.name)
        finally:
            cache.delete(lease)
    return delivered


def _deliver(cluster: Cluster, rows: list[tuple[int, Any]], lease: str) -> int:
    adapter = adapter_for(cluster.kind)
    works = load_works(attempt for _, attempt in rows)
    row_of = {str(attempt): pk for pk, attempt in rows}
    by_id = {w.attempt_id: w for w in works}
    delivered, pending, told, last = 0, [], set(), time.monotonic()
    try:
        for sent in adapter.dispatch(cluster, works):
            pending.append(sent)
            told.add(sent.attempt_id)
            if time.monotonic() - last >= RECORD_EVERY_S:
                delivered += _record(pending, row_of, by_id)
                pending, last = [], time.monotonic()
                cache.touch(lease, LEASE_S)
    except AdapterError as exc:
        log.warning("dispatch to %s failed: %s", cluster.name, exc)
        pending += [Sent(w.attempt_id, error=str(exc)[:1000]) for w in works if w.attempt_id not in told]
    finally:
        delivered += _record(pending, row_of, by_id)
    if delivered and adapter.sync_every_s is not None:
        wake_sync(cluster.pk, 0.0)  # a polled cluster is read at once after a delivery
    return delivered


def _record(sent: list[Sent], row_of: dict[str, int], works: dict[str, Work]) -> int:
    """Record deliveries in one transaction: remote ids, rows sent (with the attempts' first
    move, when the cluster made one at once) or tried with their error."""
    ok = [s for s in sent if not s.error and s.attempt_id in row_of]
    with transaction.atomic():
        for s in ok:
            if s.remote_id:
                JobAttempt.objects.filter(pk=s.attempt_id).update(remote_id=s.remote_id)
        apply_remote_states([RemoteState(s.attempt_id, s.phase, message=s.message) for s in ok if s.phase])
        DispatchOutbox.objects.filter(pk__in=[row_of[s.attempt_id] for s in ok]).update(
            state=DispatchOutbox.State.SENT, tries=F("tries") + 1
        )
        for s in sent:
            if s.error and s.attempt_id in row_of:
                DispatchOutbox.objects.filter(pk=row_of[s.attempt_id]).update(
                    tries=F("tries") + 1, last_error=s.error
                )
    forget_desired(_nodes(works[s.attempt_id] for s in ok if s.attempt_id in works))
    return len(ok)


def _nodes(works: Iterable[Work]) -> list[int]:
    return sorted({share.node_id for w in works for share in w.shares})
