"""Waking periodic work early: a submission or freed capacity asks for a scheduling cycle now
instead of at the next beat, a placing cycle rings the dispatcher, and a polled cluster whose
next change is due before the next beat asks to be synced then.

Asks are debounced, and a woken task that waits longer than a few seconds expires instead of
running late. This module is a leaf: it sends tasks by name, so nothing it wakes imports it
back. In the embedded default (no broker) the in-process timers run every second anyway.
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
_KEY = "orrery:cycle-requested"
CYCLE_TASK = "scheduling.tasks.scheduling_cycle_task"
DISPATCH_TASK = "scheduling.tasks.dispatch_outbox_task"
SYNC_TASK = "scheduling.tasks.sync_cluster_task"


def _send(task: str, **options: Any) -> None:
    current_app.send_task(task, **options)


def request_cycle() -> None:
    """After the current transaction commits, ask for a scheduling cycle."""
    if settings.REDIS_URL:
        transaction.on_commit(_ask)


def _ask() -> None:
    """At most one cycle now per second, and one more at the end of that second for what
    arrived meanwhile (a trailing edge): capacity freed just after a cycle is not left idle
    until the next beat."""
    try:
        if _add(_KEY):
            _send(CYCLE_TASK, expires=5)
        elif _add(f"{_KEY}:trailing"):
            _send(CYCLE_TASK, countdown=0.5, expires=5)
    except Exception:  # the beat runs a cycle every second regardless
        log.warning("could not wake the scheduler early", exc_info=True)


_set_until: dict[str, float] = {}  # keys this process added, and until when they surely stay


def _add(key: str) -> bool:
    """``cache.add`` for one second, without asking the cache while this process knows the key is
    there (it added it less than a second ago): a stream of submissions asks once a second, not
    twice a request."""
    now = time.monotonic()
    if _set_until.get(key, 0.0) > now:
        return False
    if cache.add(key, 1, timeout=1):
        _set_until[key] = now + 1.0  # measured before the cache set it: it outlives this
        return True
    return False


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


def ring_dispatch() -> None:
    """After commit, deliver the new outbox rows now rather than at the next sweep. Only a
    doorbell: the periodic sweep delivers whatever a lost message left behind."""
    if settings.REDIS_URL:
        transaction.on_commit(_ring)


def _ring() -> None:
    """At most one drain now per second, and one more half a second later for rows placed
    meanwhile (the trailing cycle's placements start then, not at the next sweep)."""
    try:
        if cache.add("orrery:dispatch-requested", 1, timeout=1):
            _send(DISPATCH_TASK, expires=10)
        elif cache.add("orrery:dispatch-requested:trailing", 1, timeout=1):
            _send(DISPATCH_TASK, countdown=0.5, expires=10)
    except Exception:
        log.warning("could not ring the dispatcher", exc_info=True)
