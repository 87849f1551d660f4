"""Waking the scheduler early: a submission or freed capacity asks for a cycle now instead of
at the next beat. Asks are debounced (one per second), and a cycle task that waits longer than
a few seconds expires instead of running late: a late cycle never queues a second one."""

from __future__ import annotations

import logging
import time

from django.conf import settings
from django.core.cache import cache
from django.db import transaction

log = logging.getLogger(__name__)
_KEY = "orrery:cycle-requested"


def request_cycle() -> None:
    """After the current transaction commits, ask for a scheduling cycle. In the embedded
    default the in-process timer runs a cycle every second anyway."""
    if settings.REDIS_URL:
        transaction.on_commit(_ask)


def _ask() -> None:
    """At most one cycle now per second, and one more at the end of that second for what
    arrived meanwhile (a trailing edge): capacity freed just after a cycle is not left idle
    until the next beat."""
    from scheduling.tasks import scheduling_cycle_task

    try:
        if cache.add(_KEY, 1, timeout=1):
            scheduling_cycle_task.apply_async(expires=5)
        elif cache.add(f"{_KEY}:trailing", 1, timeout=1):
            scheduling_cycle_task.apply_async(countdown=0.5, expires=5)
    except Exception:  # the beat runs a cycle every second regardless
        log.warning("could not wake the scheduler early", exc_info=True)


def wake_simulated(delay_s: float | None) -> None:
    """Run the simulated clusters' pass again in ``delay_s`` (when a job there ends before the
    next beat, or work was just placed there), so simulated jobs start when placed and end on
    time instead of on the beat's one-second tick. One wake-up per 50 ms slot."""
    if not settings.REDIS_URL or delay_s is None or delay_s >= 1.0:
        return
    from scheduling.tasks import simulated_clusters_task

    delay_s = max(delay_s, 0.0) + 0.05  # never early: a job found not yet ended waits for the beat
    slot = int((time.time() + delay_s) * 20)
    try:
        if cache.add(f"orrery:simulated-wake:{slot}", 1, timeout=2):
            simulated_clusters_task.apply_async(countdown=delay_s, expires=5)
    except Exception:
        log.warning("could not wake the simulated clusters", exc_info=True)


def ring_dispatch() -> None:
    """After commit, deliver the new outbox rows now rather than at the next sweep. Only a
    doorbell: the periodic sweep delivers whatever a lost message left behind."""
    if settings.REDIS_URL:
        transaction.on_commit(_ring)


def _ring() -> None:
    from scheduling.tasks import dispatch_outbox_task

    try:
        if cache.add("orrery:dispatch-requested", 1, timeout=1):
            dispatch_outbox_task.apply_async(expires=10)
    except Exception:
        log.warning("could not ring the dispatcher", exc_info=True)
    wake_simulated(0.0)
