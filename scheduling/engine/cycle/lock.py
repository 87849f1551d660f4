"""Phase 1 of a cycle: one cycle at a time, the epoch that fences its decisions, and the
replacement of a scheduler that stalls while it holds the lock.

Within a process a lock decides; across processes a transaction-scoped PostgreSQL advisory
lock does, so it is released with the cycle's transaction however that ends. (SQLite, the
embedded default, has one process, serialised by the process lock and SQLite's write lock.)
The epoch — the fencing token every attempt carries — is bumped in the same transaction, so a
cycle that rolls back leaves no epoch behind.

A holder that stops (a paused process, a host gone from the network) would keep the lock as
long as its session lives. Two things bound that by ``ORRERY_SCHEDULER_STALL_S`` (S):

- the cycle's own transaction sets ``statement_timeout``, ``lock_timeout`` and
  ``idle_in_transaction_session_timeout`` to S, so PostgreSQL ends a cycle stuck on a statement
  or a holder gone quiet in its transaction;
- a cycle that finds the lock taken looks the holder up, and if the holder's transaction began
  more than S ago, terminates its backend (``pg_terminate_backend``) and takes the lock. The
  holder's transaction dies with its backend, so nothing it decided is committed; when it
  resumes it finds its connection gone and rolls back (``run_cycle``).

So a stalled or vanished scheduler is replaced by the first cycle attempted after S: within
S + the beat interval (1 s).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from django.db import connection
from django.utils import timezone

from foundation.sql import is_postgresql
from scheduling.metrics import CYCLES_SKIPPED, TAKEOVERS
from scheduling.models import SchedulerState

log = logging.getLogger(__name__)

LOCK_KEY = 0x0_5C4E_D01E  # pg advisory lock id of the scheduling cycle
SKIP_QUIET_S = 3.0  # a holder younger than this (or than half the bound) is an ordinary cycle: no log line
SKIP_LOG_EVERY_S = 10.0  # at most one "skipped" line per process this often
RELEASE_WAIT_S = 2.0  # how long a takeover waits for the terminated holder's lock to go
_process_lock = threading.Lock()
_last_skip_log = 0.0


@dataclass(frozen=True)
class Holder:
    """The backend holding the cycle's advisory lock: its pid, client address and how long its
    transaction has run."""

    pid: int
    host: str
    age_s: float


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


def bound_transaction(stall_s: float) -> None:
    """Bound every statement, lock wait and idle pause of the current transaction by
    ``stall_s`` (PostgreSQL; ``SET LOCAL``, so it ends with the transaction)."""
    if not is_postgresql():
        return
    ms = str(max(int(stall_s * 1000), 1))
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT set_config('statement_timeout', %s, true), set_config('lock_timeout', %s, true), "
            "set_config('idle_in_transaction_session_timeout', %s, true)",
            [ms, ms, ms],
        )


def advisory_lock(stall_s: float) -> bool:
    """Take the cycle's advisory lock for the current transaction; False if another holds it
    and has held it for less than ``stall_s``. A holder past that is terminated and replaced."""
    if not is_postgresql():
        return True  # SQLite: one process, serialised by exclusive() and the write lock
    if _try_lock():
        return True
    held_by = holder()
    if held_by is None:
        return _try_lock()  # it ended between the two looks
    if held_by.age_s <= stall_s:
        _skipped(held_by, stall_s)
        return False
    return _take_over(held_by, stall_s)


def holder() -> Holder | None:
    """Who holds the cycle's advisory lock in this database, from ``pg_locks``: for a bigint key,
    ``classid`` is its high 32 bits, ``objid`` its low 32 bits and ``objsubid`` 1."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT a.pid, coalesce(host(a.client_addr) || ':' || a.client_port, 'local socket'),
                   extract(epoch FROM clock_timestamp() - coalesce(a.xact_start, a.state_change))
            FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
            WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
              AND l.classid::bigint = %s AND l.objid::bigint = %s
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
            """,
            [LOCK_KEY >> 32, LOCK_KEY & 0xFFFF_FFFF],
        )
        row = cursor.fetchone()
    return Holder(int(row[0]), row[1], float(row[2] or 0)) if row else None


def next_epoch() -> int:
    """Bump and return the scheduler's epoch, in the current transaction. The database does the
    increment, so a bump that waited on another transaction's row lock (a pipelined commit's)
    counts from the epoch that one left."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE scheduling_schedulerstate SET epoch = epoch + 1, last_cycle_at = %s WHERE id = 1 "
            "RETURNING epoch",
            [timezone.now()],
        )
        row = cursor.fetchone()
    if row is not None:
        return int(row[0])
    SchedulerState.objects.get_or_create(pk=1)
    return next_epoch()


def current_epoch() -> int:
    """The epoch of the last committed cycle (a pipelined cycle decides on top of it)."""
    state, _ = SchedulerState.objects.get_or_create(pk=1)
    return state.epoch


def advance_epoch(expected: int) -> bool:
    """Move the epoch from ``expected`` to ``expected + 1``, in the current transaction: the fence
    of a pipelined commit. False — and nothing moved — if any other cycle committed since
    ``expected`` was read. The row stays locked until the transaction ends, so two commits that
    expect the same epoch cannot both succeed: the second waits, then finds it moved."""
    moved = SchedulerState.objects.filter(pk=1, epoch=expected).update(
        epoch=expected + 1, last_cycle_at=timezone.now()
    )
    return moved == 1


def _try_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [LOCK_KEY])
        return bool(cursor.fetchone()[0])


def _take_over(held_by: Holder, stall_s: float) -> bool:
    """Terminate a stalled holder's backend and take the lock once it has gone. Its transaction
    rolls back with the backend, so none of its decisions can commit; its epoch is spent."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [held_by.pid])
        terminated = bool(cursor.fetchone()[0])
    deadline = time.monotonic() + RELEASE_WAIT_S
    while True:
        if _try_lock():
            break
        if time.monotonic() > deadline:
            log.error(
                "scheduling lock holder pid %d on %s has held the lock for %.1f s (bound %.0f s) "
                "and could not be replaced (terminated: %s); cycles wait for it",
                held_by.pid,
                held_by.host,
                held_by.age_s,
                stall_s,
                terminated,
            )
            return False
        time.sleep(0.05)
    TAKEOVERS.inc()
    log.error(
        "scheduling lock holder pid %d on %s stalled: its transaction had run %.1f s (bound %.0f s); "
        "terminated and replaced by pid %d",
        held_by.pid,
        held_by.host,
        held_by.age_s,
        stall_s,
        connection.connection.info.backend_pid,
    )
    return True


def _skipped(held_by: Holder, stall_s: float) -> None:
    """Count a cycle skipped for a live holder; say so (at most every ``SKIP_LOG_EVERY_S``)
    once the holder has had the lock for longer than an ordinary cycle takes."""
    global _last_skip_log
    CYCLES_SKIPPED.inc()
    now = time.monotonic()
    if held_by.age_s >= min(SKIP_QUIET_S, stall_s / 2) and now - _last_skip_log >= SKIP_LOG_EVERY_S:
        _last_skip_log = now
        log.warning(
            "scheduling cycles skipped: pid %d on %s has held the scheduling lock for %.1f s; "
            "it is replaced after %.0f s",
            held_by.pid,
            held_by.host,
            held_by.age_s,
            stall_s,
        )
