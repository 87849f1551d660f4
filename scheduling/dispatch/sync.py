"""Reading polled clusters back: states, exit codes, output, and work to withdraw.

``sync_cluster`` asks the cluster's adapter about every attempt Orrery considers active there,
stores the output it brings, enforces time limits to the second where the cluster's own are
coarser, drains preempted attempts (``_drain``), hands the states to the one mapper
(``dispatch.remote``), and cancels on the cluster what Orrery no longer runs (a job cancelled,
held or requeued in Orrery: cancelling is level-triggered). ``sync_due_clusters`` is the
periodic pass over every polled kind.

A preempted attempt (its job PREEMPTED, its ``Work.stop`` set) is drained in three steps, each
taken by the first sync that finds it due: its running job is sent the stop's signal once
(``signalled_at`` records it; a kind that cannot signal cancels at once), it is cancelled once
its grace period has run from the preemption, and the cluster's report of its end requeues the
job (the mapper: any end of a PREEMPTED job is PENDING again). One still queued on the cluster
is withdrawn at once, and one the cluster has not had yet ends at once: nothing ran.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from django.conf import settings
from django.utils import timezone

from clusters.adapters.base import (
    AdapterError,
    ClusterAdapter,
    Orphan,
    Phase,
    RemoteState,
    Work,
    signal_or_cancel,
)
from clusters.adapters.registry import ADAPTERS, adapter_for
from clusters.models import Cluster
from foundation.pacing import due
from foundation.units import duration_text
from scheduling.dispatch.remote import apply_remote_states, past_time_limit
from scheduling.dispatch.works import load_works
from scheduling.models import JobAttempt
from scheduling.services.logs import store_log
from scheduling.wakeup import ring_sync, rings, wake_sync

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncCounts:
    moved: int  # jobs whose state changed
    cancelled: int  # jobs stopped on the cluster (past their limit, preempted, no longer Orrery's)
    signalled: int = 0  # preempted jobs sent their signal


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
                message=f"ran past its time limit of {duration_text(limit)}",
            )
        states.append(state)
    drained = _drain(adapter, cluster, works, states)
    moved = apply_remote_states(states + drained.ended)
    cancelled += drained.cancelled + _withdraw(cluster, synced.orphans)
    again = min((t for t in (synced.again_in_s, drained.again_in_s) if t is not None), default=None)
    if again is not None:
        wake_sync(cluster.pk, again)
    return SyncCounts(moved, cancelled, drained.signalled)


MAX_READ_BACKS = 20  # a rung job still completing is read again at most this many times
MAX_RUNG = 1000  # rung jobs read at once; more (a flood of rings) are left to the periodic pass


def sync_rung(cluster: Cluster, rung: Collection[str]) -> SyncCounts:
    """Read back only the jobs the cluster rang about (``agent/ended``, ``wakeup.rung_jobs``:
    remote ids, each with how often it was read back already as ``id/n``), where its kind can
    (``SupportsReadBack``); the whole sync otherwise. Only this cluster's active attempts with
    those ids are read, so a ring names nothing Orrery would not ask about anyway, and what the
    cluster says of them goes through the one mapper. One still being cleaned up there is rung
    again shortly, a bounded number of times (the periodic pass reads it after that). At most
    ``MAX_RUNG`` rung jobs are read at once: the rest of a flood of rings is left to the periodic
    pass."""
    read_back = getattr(adapter_for(cluster.kind), "read_back", None)  # SupportsReadBack
    if not callable(read_back):
        return sync_cluster(cluster)
    if len(rung) > MAX_RUNG:
        log.warning("cluster %s rang about %d jobs at once; reading %d", cluster.name, len(rung), MAX_RUNG)
    reads = {}
    for item in sorted(rung)[:MAX_RUNG]:
        remote_id, _, n = item.partition("/")
        reads[remote_id] = int(n) if n.isdigit() else 0
    works = load_works(
        JobAttempt.objects.filter(cluster=cluster, active=True, remote_id__in=list(reads))
        .order_by("created_at")
        .values_list("pk", flat=True)
    )
    if not works:
        return SyncCounts(0, 0)
    synced = read_back(cluster, works)
    for chunk in synced.output:
        store_log(chunk)
    moved = apply_remote_states(synced.states)
    if synced.again_in_s is not None:
        ended = {s.attempt_id for s in synced.states if s.phase.ended}
        for work in works:
            n = reads.get(work.remote_id, 0) + 1
            if work.attempt_id not in ended and n < MAX_READ_BACKS:
                ring_sync(cluster.pk, f"{work.remote_id}/{n}", countdown=synced.again_in_s)
    return SyncCounts(moved, 0)


@dataclass(frozen=True)
class Drained:
    ended: list[RemoteState]  # preempted attempts that ended without running (nothing to drain)
    signalled: int
    cancelled: int
    again_in_s: float | None  # the next grace period to end, if before the next pass


def _drain(
    adapter: ClusterAdapter, cluster: Cluster, works: Sequence[Work], states: Sequence[RemoteState]
) -> Drained:
    """The next step of each preempted attempt's stop (see the module): signal, cancel after
    the grace, withdraw what only waits there. An attempt the cluster reports ended needs none:
    the mapper requeues it. Every step is safe to take twice (a crash before ``signalled_at`` is
    written signals again)."""
    if adapter.sync_every_s is None:
        return Drained([], 0, 0, None)  # agents stop their attempts themselves (dispatch.agent)
    said = {s.attempt_id: s for s in states}
    now = time.time()
    ended, signalled, cancelled, soonest = [], 0, 0, None
    for work in works:
        stop, state = work.stop, said.get(work.attempt_id)
        if stop is None or (state is not None and state.phase.ended):
            continue
        remote_id = (state.remote_id if state else "") or work.remote_id
        if not remote_id:
            # Not on the cluster yet (its delivery is due, or in flight: a job delivered for an
            # attempt that ended is an orphan, and the next sync cancels it).
            ended.append(
                RemoteState(work.attempt_id, Phase.PREEMPTED, message="before it reached the cluster")
            )
        elif state is not None and state.phase in (Phase.QUEUED, Phase.HELD):
            if adapter.cancel(cluster, [remote_id]):
                cancelled += 1
                ended.append(
                    RemoteState(work.attempt_id, Phase.PREEMPTED, remote_id, message="withdrawn while queued")
                )
        elif now >= stop.deadline:
            # Past its grace: killed. Its end comes with a later sync (the cluster keeps its
            # GPUs until then); cancelling again meanwhile is harmless.
            cancelled += adapter.cancel(cluster, [remote_id])
        else:
            if stop.signalled_at is None and signal_or_cancel(
                adapter, cluster, [remote_id], stop.signal, int(stop.deadline - now)
            ):
                signalled += 1
                JobAttempt.objects.filter(pk=work.attempt_id, signalled_at__isnull=True).update(
                    signalled_at=timezone.now()
                )
            soonest = stop.deadline - now if soonest is None else min(soonest, stop.deadline - now)
    return Drained(ended, signalled, cancelled, soonest)


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
    work already there must still finish); a cluster that rings at its jobs' ends
    (``wakeup.rings``) at the slower ``ORRERY_RUNG_SYNC_EVERY_S`` when that is longer. One that
    cannot be reached is logged and skipped. Returns how many clusters were synced."""
    now = now or time.time()
    paces = {k: every for k in ADAPTERS if (every := adapter_for(k).sync_every_s) is not None}
    kinds = [k for k, every in paces.items() if due(f"orrery:synced:{k}", every, now)]
    rung_every = settings.ORRERY_RUNG_SYNC_EVERY_S
    done = 0
    for cluster in Cluster.objects.filter(kind__in=kinds):
        if (
            rung_every > paces[cluster.kind]
            and rings(cluster.pk)
            and not due(f"orrery:synced-rung:{cluster.pk}", rung_every, now)
        ):
            continue
        try:
            sync_cluster(cluster)
            done += 1
        except AdapterError as exc:
            log.warning("%s cluster %s: %s", cluster.kind, cluster.name, exc)
        except Exception:  # one broken cluster must not stop the others' sync
            log.exception("sync of %s cluster %s failed", cluster.kind, cluster.name)
    return done
