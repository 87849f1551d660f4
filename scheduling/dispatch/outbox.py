"""One drain loop over the dispatch outbox, for every kind of cluster.

The cycle writes a ``start`` row per placement in its own transaction. Draining takes each
kind's oldest pending rows (at most its adapter's ``dispatch_batch``), closes rows whose attempt
already ended, hands each cluster its works in one ``adapter.dispatch`` call, and records what
became of each as the adapter yields it: sent (with the cluster's own id, and the attempt's first
move when the cluster made one at once), or tried and why not (the row stays pending and the
next drain tries again).

Before a cluster's works are read, each attempt of a kind that runs user code gets the port its
gang agrees on (``ports.assign_master_ports``; kept once chosen).

Delivery is idempotent at both ends: the remote job is named after the attempt, so a drain that
dies after delivering and before recording finds, rather than duplicates, the job next time; and
only one drain at a time delivers to a cluster (a session-level PostgreSQL advisory lock per
cluster, released with the drain or with its connection; the cache on SQLite, which has one
process), so two workers never submit the same rows side by side, and delivery goes on while
Redis is away. Runs on the doorbell after each placing cycle
(``wakeup.ring_dispatch``) and as a periodic sweep that re-drives whatever a lost doorbell left.

**Rate.** Each cluster is handed at most ``ORRERY_DISPATCH_PER_CLUSTER_PER_S`` works a second
(per kind: ``ORRERY_DISPATCH_PER_S_BY_KIND``; 0 is no limit), through a token bucket holding
one second's worth: a burst of placements reaches a slurmctld or an API server as that many
submissions a second, never all at once. Rows are taken per cluster, oldest first, as many as
its bucket allows, so a cluster's backlog never holds back another's rows and each cluster's
rows go in order; what waits stays pending for the next sweep (a second later, when the bucket
has refilled). The bucket lives in the cache, read and written only by the cluster's lock
holder, so every worker shares it; when the cache cannot be reached it is kept in the
process instead (each worker then keeps the limit on its own).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db import connection, transaction
from django.db.models import F

from clusters.adapters.base import AdapterError, RemoteState, Sent, Work
from clusters.adapters.registry import ADAPTERS, adapter_for
from clusters.models import Cluster
from scheduling.dispatch.desired import forget_desired
from scheduling.dispatch.ports import assign_master_ports
from scheduling.dispatch.remote import apply_remote_states
from scheduling.dispatch.works import load_works
from scheduling.models import DispatchOutbox, JobAttempt
from scheduling.wakeup import ring_dispatch, ring_dispatch_again, rings, wake_sync

log = logging.getLogger(__name__)
LEASE_S = 120  # SQLite's cache lease: longer than one delivery can take (squeue + sbatch time-outs)
LOCK_CLASS = 0x0D15  # pg advisory lock (class, cluster id) of one cluster's delivery
RECORD_EVERY_S = 0.2  # a slow adapter's results are recorded at least this often


def drain_outbox() -> int:
    """Deliver pending ``start`` rows of every kind that has an adapter (rows of a kind without
    one wait), each cluster's oldest first and no more than its rate allows. Returns how many
    were delivered."""
    delivered = 0
    for kind in ADAPTERS:
        adapter = adapter_for(kind)
        pending = DispatchOutbox.objects.filter(
            state=DispatchOutbox.State.PENDING, kind=DispatchOutbox.Kind.START
        )
        of_kind = pending.filter(cluster__kind=kind).order_by()
        clusters = set(of_kind.values_list("cluster_id", flat=True).distinct())
        more = busy = False
        for cluster in Cluster.objects.filter(pk__in=clusters).order_by("pk"):
            with _delivering(cluster.pk) as ours:
                if not ours:
                    busy = True  # another drain is delivering to this cluster now
                    continue
                try:
                    bucket = _Bucket(cluster.pk, _rate(kind))
                    allowed = min(adapter.dispatch_batch, bucket.tokens())
                    if not allowed:
                        continue  # spent for now: the next sweep finds the bucket refilled
                    rows = list(
                        pending.filter(cluster_id=cluster.pk)
                        .order_by("id")
                        .values_list("pk", "attempt_id")[:allowed]
                    )
                    handed, sent = _drain(cluster, rows)
                    bucket.spend(handed)
                    delivered += sent
                    more |= len(rows) == adapter.dispatch_batch
                except Exception:  # one broken cluster must not stop delivery to the others
                    log.exception("dispatch to cluster %s failed; its rows are tried again", cluster.name)
        if more:
            ring_dispatch()  # a batch was full: come back at once rather than at the next sweep
        elif busy:
            ring_dispatch_again()  # rows the other drain did not read are delivered shortly
    return delivered


@contextmanager
def _delivering(cluster_id: int) -> Iterator[bool]:
    """Whether this drain may deliver to the cluster now: one drain per cluster at a time."""
    if connection.vendor != "postgresql":
        lease = f"orrery:dispatching:{cluster_id}"
        ours = cache.add(lease, 1, timeout=LEASE_S)
        try:
            yield ours
        finally:
            if ours:
                cache.delete(lease)
        return
    key = [LOCK_CLASS, cluster_id % (1 << 31)]
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s, %s)", key)
        ours = bool(cursor.fetchone()[0])
    try:
        yield ours
    finally:
        if ours and connection.is_usable():
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s, %s)", key)
        # (a connection that died took its session's lock with it)


def _rate(kind: str) -> float:
    """Works a second one cluster of ``kind`` may be handed; 0 is no limit."""
    return settings.ORRERY_DISPATCH_PER_S_BY_KIND.get(kind, settings.ORRERY_DISPATCH_PER_CLUSTER_PER_S)


_LOCAL_BUCKETS: dict[int, tuple[float, float]] = {}  # cluster → (tokens, at), while the cache is away


class _Bucket:
    """One cluster's token bucket: ``rate`` tokens a second, holding at most one second's worth
    (and at least one token, for rates under one a second). Read and written by the holder of
    the cluster's delivery lock only, so a read-modify-write needs no other lock."""

    def __init__(self, cluster_id: int, rate: float) -> None:
        self.key, self.cluster_id, self.rate = f"orrery:dispatch-bucket:{cluster_id}", cluster_id, rate
        self.capacity = max(rate, 1.0)
        self.level = self.capacity

    def tokens(self) -> int:
        """Whole tokens available now (a large number when there is no limit)."""
        if self.rate <= 0:
            return 1 << 30
        now = time.time()
        try:
            stored = cache.get(self.key)
        except Exception:  # the cache is away: this process's own bucket, bounded all the same
            stored = _LOCAL_BUCKETS.get(self.cluster_id)
        if stored is not None:
            level, at = stored
            self.level = min(self.capacity, level + max(now - at, 0.0) * self.rate)
        return math.floor(self.level)

    def spend(self, n: int) -> None:
        if self.rate <= 0:
            return
        state = (self.level - n, time.time())
        _LOCAL_BUCKETS[self.cluster_id] = state
        try:
            cache.set(self.key, state, timeout=max(60, math.ceil(2 * self.capacity / self.rate)))
        except Exception:
            log.warning("dispatch rate of cluster %s kept in this process: no cache", self.cluster_id)


def _drain(cluster: Cluster, rows: list[tuple[int, Any]]) -> tuple[int, int]:
    """Deliver one cluster's rows (oldest first). Returns how many works the adapter was handed
    (what the cluster's rate counts) and how many were delivered."""
    active = set(
        JobAttempt.objects.filter(pk__in=[r[1] for r in rows], active=True).values_list("pk", flat=True)
    )
    # An attempt already ended or requeued needs no delivery: its row is done.
    DispatchOutbox.objects.filter(pk__in=[pk for pk, attempt in rows if attempt not in active]).update(
        state=DispatchOutbox.State.SENT
    )
    live = [(pk, attempt) for pk, attempt in rows if attempt in active]
    if not live:
        return 0, 0
    if adapter_for(cluster.kind).runs_user_code:
        assign_master_ports(attempt for _, attempt in live)  # before the works are read: they carry it
    return len(live), _deliver(cluster, live)


def _deliver(cluster: Cluster, rows: list[tuple[int, Any]]) -> int:
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
    except AdapterError as exc:
        log.warning("dispatch to %s failed: %s", cluster.name, exc)
        pending += [Sent(w.attempt_id, error=str(exc)[:1000]) for w in works if w.attempt_id not in told]
    finally:
        delivered += _record(pending, row_of, by_id)
    if delivered and adapter.sync_every_s is not None and not rings(cluster.pk):
        # A polled cluster is read at once after a delivery (one that rings at its jobs' ends
        # is read at its slower pace: its starts matter to no decision).
        wake_sync(cluster.pk, 0.0)
    return delivered


def _record(sent: list[Sent], row_of: dict[str, int], works: dict[str, Work]) -> int:
    """Record deliveries in one transaction: remote ids, rows sent (with the attempts' first
    move, when the cluster made one at once) or tried with their error."""
    ok = [s for s in sent if not s.error and s.attempt_id in row_of]
    with transaction.atomic():
        # One statement for every remote id: a delivery of hundreds of jobs is not that many
        # round trips to the database.
        JobAttempt.objects.bulk_update(
            [JobAttempt(pk=s.attempt_id, remote_id=s.remote_id) for s in ok if s.remote_id], ["remote_id"]
        )
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
