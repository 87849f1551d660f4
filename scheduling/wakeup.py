"""Waking periodic work early: a submission or freed capacity asks for a scheduling cycle now
instead of at the next beat, a placing cycle rings the dispatcher, and a polled cluster whose
next change is due before the next beat asks to be synced then.

At most one woken cycle, one woken drain and one rung sync per cluster wait in the queue at a
time: each clears its mark as it starts, so what is asked while it runs is taken by the next one
at once, and a burst of asks costs one run. A woken task that waits longer than a few seconds
expires instead of running late. This module is a leaf: it sends tasks by name, so nothing it
wakes imports it back. In the embedded default (no broker) the in-process timers run every
second anyway.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import current_app
from django.conf import settings
from django.core.cache import cache
from django.db import transaction

log = logging.getLogger(__name__)
_CYCLE_QUEUED = "orrery:cycle-queued"
_DISPATCH_QUEUED = "orrery:dispatch-queued"
RETRY_S = 0.2  # a cycle or drain that found another at work asks again after this
CYCLE_TASK = "scheduling.tasks.scheduling_cycle_task"
DISPATCH_TASK = "scheduling.tasks.dispatch_outbox_task"
SYNC_TASK = "scheduling.tasks.sync_cluster_task"
RINGING_FOR_S = 60  # a cluster that rang this recently is taken to ring at every job's end


def _send(task: str, **options: Any) -> None:
    current_app.send_task(task, **options)


def request_cycle() -> None:
    """After the current transaction commits, ask for a scheduling cycle."""
    if settings.REDIS_URL:
        transaction.on_commit(_ask)


def _ask(countdown: float = 0.0) -> None:
    """A cycle now, unless one already waits in the queue: it starts after this commit, so it
    reads what was committed. A cycle that has started clears the mark (``cycle_started``), so an
    ask while it runs queues the next, which runs as soon as it ends: capacity freed or work
    submitted during a cycle waits for no beat and no fixed pause, and a burst of asks is one
    cycle."""
    _queue_once(_CYCLE_QUEUED, CYCLE_TASK, expires=5, countdown=countdown)


def cycle_started() -> None:
    """A cycle task starts: the next ask queues another (``_ask``)."""
    _started(_CYCLE_QUEUED)


def cycle_skipped() -> None:
    """A cycle found another holding the lock (a second scheduling worker): what it was asked
    for may have been committed after the holder read, so ask again shortly rather than leave it
    to the beat."""
    if settings.REDIS_URL:
        _ask(countdown=RETRY_S)


def _queue_once(mark: str, task: str, *, expires: float, countdown: float = 0.0, **options: Any) -> None:
    """Send ``task`` unless one sent this way still waits in the queue (``mark`` is set until the
    task starts, or expires with it if the message is lost)."""
    try:
        if cache.add(mark, 1, timeout=int(countdown + expires) + 1):
            try:
                _send(task, countdown=countdown, expires=expires, **options)
            except Exception:
                cache.delete(mark)  # nothing waits: the next ask must send
                raise
    except Exception:  # the beat runs the task every second regardless
        log.warning("could not send %s early", task, exc_info=True)


def _started(mark: str) -> None:
    try:
        cache.delete(mark)
    except Exception:  # the mark expires by itself
        log.warning("could not clear %s", mark, exc_info=True)


def wake_sync(cluster_id: int, delay_s: float | None) -> None:
    """Sync a polled cluster again in ``delay_s`` (a simulated job ending before the next beat,
    work just delivered), so its jobs are seen to start and end on time rather than on the
    beat's tick. One wake-up per cluster per 50 ms slot."""
    if not settings.REDIS_URL or delay_s is None or delay_s >= 1.0:
        return
    delay_s = max(delay_s, 0.0) + 0.05  # never early: a job found not yet ended waits for the beat
    slot = int((time.time() + delay_s) * 20)
    try:
        if cache.add(f"orrery:sync-wake:{cluster_id}:{slot}", 1, timeout=2):
            _send(SYNC_TASK, args=[cluster_id], countdown=delay_s, expires=5)
    except Exception:
        log.warning("could not wake the sync of cluster %s", cluster_id, exc_info=True)


def ring_sync(cluster_id: int, job: str, *, countdown: float = 0.0) -> None:
    """The cluster's own scheduler says its job ``job`` ended (Slurm's ``EpilogSlurmctld``
    through ``agent/ended``): read it back now, so its GPUs go to the next job without waiting
    for the next poll. The rung jobs are noted in a set that the sync takes whole
    (``rung_jobs``), and at most one rung sync waits in the queue per cluster: a burst of ends
    is one read of those jobs, and an end rung while a read runs is taken by the one queued
    behind it (``sync_started``). A ring whose job cannot be noted (the cache is away) wakes the
    whole sync instead. A doorbell only: the periodic pass reads whatever a lost ring left."""
    if not settings.REDIS_URL:
        return  # the embedded default's in-process timer syncs every second anyway
    # Redis away: the note is dropped, and the whole sync keeps the polled pace (foundation.cache)
    cache.set(ringing_key(cluster_id), 1, timeout=RINGING_FOR_S)
    note = getattr(cache, "set_add", None)
    if note is None or not note(_rung_jobs(cluster_id), job, timeout=60):
        wake_sync(cluster_id, 0.0)
        return
    rung = {"args": [cluster_id], "kwargs": {"rung": True}}
    _queue_once(_sync_rung(cluster_id), SYNC_TASK, expires=5, countdown=countdown, **rung)


def rings(cluster_id: int) -> bool:
    """Whether the cluster rang at a job's end within the last ``RINGING_FOR_S``: its ends then
    come by ring, and its whole sync, which is left to find starts, lost rings and orphans, may
    keep a slower pace (``settings.ORRERY_RUNG_SYNC_EVERY_S``). A cluster whose ring breaks is
    polled at its own pace again within ``RINGING_FOR_S``."""
    return bool(settings.REDIS_URL) and bool(cache.get(ringing_key(cluster_id)))


def ringing_key(cluster_id: int) -> str:
    return f"orrery:rings:{cluster_id}"


def sync_started(cluster_id: int) -> None:
    """A rung sync starts: the next ring queues another (``ring_sync``)."""
    _started(_sync_rung(cluster_id))


def rung_jobs(cluster_id: int) -> set[str] | None:
    """The jobs rung about since the last rung sync took them, taken now (each is read once);
    None when the set is out of reach (the whole cluster is read instead)."""
    take = getattr(cache, "set_take", None)
    return take(_rung_jobs(cluster_id)) if take is not None else None


def _sync_rung(cluster_id: int) -> str:
    return f"orrery:sync-rung:{cluster_id}"


def _rung_jobs(cluster_id: int) -> str:
    return f"orrery:sync-rung-jobs:{cluster_id}"


def ring_dispatch() -> None:
    """After commit, deliver the new outbox rows now rather than at the next sweep. Only a
    doorbell: the periodic sweep delivers whatever a lost message left behind."""
    if settings.REDIS_URL:
        transaction.on_commit(_ring)


def _ring(countdown: float = 0.0) -> None:
    """A drain now, unless one already waits in the queue (the drain clears the mark as it
    starts, ``dispatch_started``): rows placed while a drain delivers are delivered by the next,
    at once."""
    _queue_once(_DISPATCH_QUEUED, DISPATCH_TASK, expires=10, countdown=countdown)


def dispatch_started() -> None:
    """A drain starts: the next ring queues another (``_ring``)."""
    _started(_DISPATCH_QUEUED)


def ring_dispatch_again() -> None:
    """A drain found a cluster being delivered to by another: look again shortly, so rows that
    drain did not read are not left to the sweep."""
    if settings.REDIS_URL:
        _ring(countdown=RETRY_S)
