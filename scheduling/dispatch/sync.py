"""Reading polled clusters back: states, exit codes, output, and work to withdraw.

``sync_cluster`` asks the cluster's adapter about every attempt Orrery considers active there,
stores the output it brings, enforces time limits to the second where the cluster's own are
coarser, hands the states to the one mapper (``dispatch.remote``), and cancels on the cluster
what Orrery no longer runs (a job cancelled, held or requeued in Orrery: cancelling is
level-triggered). ``sync_due_clusters`` is the periodic pass over every polled kind.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from clusters.adapters.base import AdapterError, Orphan, Phase, RemoteState
from clusters.adapters.registry import ADAPTERS, adapter_for
from clusters.models import Cluster
from foundation.pacing import due
from scheduling.dispatch.remote import apply_remote_states, past_time_limit
from scheduling.dispatch.works import load_works
from scheduling.models import JobAttempt
from scheduling.services.logs import store_log
from scheduling.wakeup import wake_sync

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncCounts:
    moved: int  # jobs whose state changed
    cancelled: int  # jobs stopped on the cluster (past their limit, or no longer Orrery's)


def sync_cluster(cluster: Cluster) -> SyncCounts:
    """One sync of one cluster. Raises ``AdapterError`` when the cluster cannot be read."""
    adapter = adapter_for(cluster.kind)
    works = load_works(
        JobAttempt.objects.filter(cluster=cluster, active=True)
        .order_by("created_at")
        .values_list("pk", flat=True)
    )
    synced = adapter.sync(cluster, works)
    for chunk in synced.output:
        store_log(chunk)
    limits = {w.attempt_id: w.time_limit_s for w in works}
    states, cancelled = [], 0
    for state in synced.states:
        limit = limits.get(state.attempt_id)
        if past_time_limit(state, limit) and adapter.cancel(cluster, [state.remote_id]):
            cancelled += 1
            state = RemoteState(
                state.attempt_id,
                Phase.TIMEOUT,
                state.remote_id,
                message=f"ran past its time limit of {limit} s",
            )
        states.append(state)
    moved = apply_remote_states(states)
    cancelled += _withdraw(cluster, synced.orphans)
    if synced.again_in_s is not None:
        wake_sync(cluster.pk, synced.again_in_s)
    return SyncCounts(moved, cancelled)


def _withdraw(cluster: Cluster, orphans: Sequence[Orphan]) -> int:
    """Cancel the cluster's jobs for attempts Orrery made and no longer runs there, and second
    jobs under a running attempt's name. An attempt active on this cluster whose job is not yet
    recorded is left alone: it may have been delivered while this sync was reading."""
    names: dict[uuid.UUID, list[str]] = {}
    for orphan in orphans:
        try:
            names.setdefault(uuid.UUID(orphan.attempt_id), []).append(orphan.remote_id)
        except ValueError:
            continue  # not named by Orrery: not ours to touch
    if not names:
        return 0
    stop = []
    # Only this cluster's attempts: two Orrery clusters on one Slurm never touch each other's jobs.
    for pk, active, remote_id in JobAttempt.objects.filter(pk__in=list(names), cluster=cluster).values_list(
        "pk", "active", "remote_id"
    ):
        if not active:
            stop += names[pk]
        elif remote_id:
            stop += [r for r in names[pk] if r != remote_id]  # a duplicate of a recorded job
    return adapter_for(cluster.kind).cancel(cluster, stop) if stop else 0


def sync_due_clusters(now: float | None = None) -> int:
    """Sync every cluster of a polled kind whose interval has passed (disabled clusters too:
    work already there must still finish). One that cannot be reached is logged and skipped.
    Returns how many clusters were synced."""
    now = now or time.time()
    kinds = [
        k
        for k in ADAPTERS
        if (every := adapter_for(k).sync_every_s) is not None and due(f"orrery:synced:{k}", every, now)
    ]
    done = 0
    for cluster in Cluster.objects.filter(kind__in=kinds):
        try:
            sync_cluster(cluster)
            done += 1
        except AdapterError as exc:
            log.warning("%s cluster %s: %s", cluster.kind, cluster.name, exc)
        except Exception:  # one broken cluster must not stop the others' sync
            log.exception("sync of %s cluster %s failed", cluster.kind, cluster.name)
    return done
