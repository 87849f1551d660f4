"""Phase 1 of a cycle: one cycle at a time, and the epoch that fences its decisions.

Within a process a lock decides; across processes a transaction-scoped PostgreSQL advisory
lock does, so it is released with the cycle's transaction however that ends. (SQLite, the
embedded default, has one process, serialised by the process lock and SQLite's write lock.)
The epoch — the fencing token every attempt carries — is bumped in the same transaction, so a
cycle that rolls back leaves no epoch behind.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection
from django.utils import timezone

from foundation.sql import is_postgresql
from scheduling.models import SchedulerState

LOCK_KEY = 0x0_5C4E_D01E  # pg advisory lock id of the scheduling cycle
_process_lock = threading.Lock()


@contextmanager
def exclusive() -> Iterator[bool]:
    """One cycle per process at a time; across processes the advisory lock decides. Yields
    whether this cycle got the process lock (it never waits for it)."""
    got = _process_lock.acquire(blocking=False)
    try:
        yield got
    finally:
        if got:
            _process_lock.release()


def advisory_lock() -> bool:
    """Take the cycle's advisory lock for the current transaction; False if another holds it."""
    if not is_postgresql():
        return True  # SQLite: one process, serialised by exclusive() and the write lock
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [LOCK_KEY])
        return bool(cursor.fetchone()[0])


def next_epoch() -> int:
    """Bump and return the scheduler's epoch, in the current transaction."""
    state, _ = SchedulerState.objects.get_or_create(pk=1)
    SchedulerState.objects.filter(pk=1).update(epoch=state.epoch + 1, last_cycle_at=timezone.now())
    return state.epoch + 1
