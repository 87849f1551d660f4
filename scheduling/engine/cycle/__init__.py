"""One scheduling cycle, in numbered phases with per-phase timing (as Kueue's ``schedule()``).

1. **Lock** (``lock``). The transaction is bounded by ``ORRERY_SCHEDULER_STALL_S`` (statement,
   lock-wait and idle-in-transaction timeouts), then takes a transaction-scoped PostgreSQL
   advisory lock: a second concurrent cycle finds it taken and does nothing, unless the holder's
   transaction is older than the bound — then the holder is terminated and replaced. (SQLite, the
   embedded default: a process lock.) The epoch — the fencing token every attempt carries — is
   bumped in the same transaction.
2. **Sync** (``SchedulerCache.ensure``). The cache brings the snapshot and the pending queue up
   to date from the event logs.
3. **Decide** (``decide``). Equivalence classes in queue-sort order; for each head job:
   PreFilter (quota, gang), the class's Filter mask (computed once per class, then re-checked
   only on rows that changed), Score, select nodes and exact GPU indices, Reserve, assume. A
   class that does not fit is given up for the rest of the cycle (capacity only shrinks within
   a cycle) and its jobs are told why, in a sentence built from the filter masks.
4. **Commit** (``commit``), in the same transaction: compare-and-set every placed job PENDING →
   SCHEDULED (a job cancelled meanwhile loses its placement), then bulk-insert attempts,
   allocations, events and outbox rows (``COPY`` on PostgreSQL). A crash before commit leaves
   no trace.
   Post-filters act on jobs that cannot be placed now: preemption chooses victims, backfill
   gives the first blocked jobs reservations and predicted starts.
4. **Commit** also preempts the victims chosen (``preempt_jobs``: each moves to PREEMPTED and
   gets its signal and grace period; the preemptor is held their GPUs by a reservation).
5. **Explain** (``explain``). Pending reasons, written only when they change (and at most every
   10 s per class), and predicted start times, written only when they move.

``run_cycle`` runs the phases in order and reports what they did (``CycleReport``). A cycle the
database rolls back (a lost race, a timeout, a terminated connection) is logged, counted and
reported as ``aborted``, never raised.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from django.conf import settings
from django.core.cache import cache as django_cache
from django.db import (
    DatabaseError,
    IntegrityError,
    InterfaceError,
    InternalError,
    OperationalError,
    connection,
    transaction,
)
from django.utils import timezone

from foundation.performance import collector_paused
from scheduling.engine.cache import SchedulerCache, scheduler_cache
from scheduling.engine.cycle import commit, decide, explain, lock
from scheduling.engine.framework import JobView, Placement
from scheduling.engine.policies import active_profile
from scheduling.metrics import (
    ATTEMPTS,
    BACKFILLED,
    CYCLE_SECONDS,
    CYCLES_ABORTED,
    GPUS,
    LAST_CYCLE_AGE,
    PENDING_JOBS,
    RESERVATIONS,
)
from scheduling.models import SchedulerState

__all__ = ["RECENT_CYCLES_KEY", "CycleReport", "run_cycle"]

log = logging.getLogger(__name__)
RECENT_CYCLES_KEY = "orrery:recent-cycles"  # the last 50 cycles, for the console's scheduler page
_Outcome = tuple[list[Placement], list[JobView], list[decide.Blocked]]
_CONFLICT = {"23505", "40001", "40P01"}  # unique violation, serialization failure, deadlock
_TIMEOUT = {"57014", "55P03", "25P03"}  # statement timeout, lock timeout, idle in transaction


@dataclass
class CycleReport:
    """What one call of ``run_cycle`` did; ``ran`` is False when another cycle held the lock,
    ``aborted`` says why the database rolled back a cycle that ran."""

    ran: bool = False
    epoch: int = 0
    placed: int = 0
    lost_races: int = 0
    unschedulable_classes: int = 0
    pending: int = 0
    preempted: int = 0
    reserved: int = 0
    backfilled: int = 0
    aborted: str = ""  # why the database rolled the cycle back (conflict, timeout, connection)
    phases_ms: dict[str, float] = field(default_factory=dict)

    @property
    def total_ms(self) -> float:
        return sum(self.phases_ms.values())


class _Phases:
    """Times each phase into ``report.phases_ms``."""

    def __init__(self, report: CycleReport) -> None:
        self.report = report

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.report.phases_ms[name] = round((time.perf_counter() - started) * 1000, 2)


def run_cycle(cache: SchedulerCache | None = None, *, limit: int | None = None) -> CycleReport:
    """Run one cycle; returns what it did. ``cache`` defaults to the process's scheduler cache.

    A cycle the database rolls back — it lost a race at commit, it ran past the stall bound, its
    connection was terminated (a takeover) or lost — returns with ``aborted`` set instead of
    raising: nothing of it is committed, the cache is dropped (the next cycle rebuilds it from
    the database) and a broken connection is closed, so the next cycle gets a fresh one."""
    cache = cache or scheduler_cache()
    report = CycleReport()
    phase = _Phases(report)
    started = time.perf_counter()
    with lock.exclusive() as got_it, collector_paused():
        if not got_it:
            return report  # another cycle is running: this one is a no-op
        try:
            with transaction.atomic():
                outcome = _phases(cache, report, phase, limit)
        except DatabaseError as exc:
            cache.invalidate()  # assumed decisions died with the transaction
            if not _aborted(report, exc):
                raise  # a programming error is not a race: let it be seen
            outcome = None
        except Exception:
            cache.invalidate()
            raise
    if outcome is None:
        _last_cycle_age()
        return report
    LAST_CYCLE_AGE.set(time.perf_counter() - started)  # it stamped last_cycle_at as it began
    placed, lost, blocked = outcome
    report.placed, report.lost_races = len(placed), len(lost)
    report.unschedulable_classes = len(blocked)
    report.pending = len(cache.queue)
    CYCLE_SECONDS.observe(time.perf_counter() - started)
    BACKFILLED.inc(report.backfilled)
    RESERVATIONS.set(report.reserved)
    ATTEMPTS.labels("scheduled").inc(report.placed)
    ATTEMPTS.labels("lost_race").inc(report.lost_races)
    ATTEMPTS.labels("unschedulable").inc(sum(len(b.cls) for b in blocked))
    _gauges(cache)
    _remember(report)
    return report


def _phases(cache: SchedulerCache, report: CycleReport, phase: _Phases, limit: int | None) -> _Outcome | None:
    """The five phases, in the caller's transaction; None when another scheduler holds the lock."""
    with phase("1_lock"):
        stall_s = settings.ORRERY_SCHEDULER_STALL_S
        lock.bound_transaction(stall_s)
        if not lock.advisory_lock(stall_s):
            return None
        report.ran = True
        report.epoch = lock.next_epoch()
    with phase("2_sync"):
        snap = cache.ensure()
    now = time.time()
    with phase("3_decide"):
        decided = decide.decide(
            active_profile(),
            cache,
            snap,
            report.epoch,
            limit or settings.ORRERY_SCHEDULER_MAX_PLACEMENTS,
            now=now,
        )
        blocked = decided.blocked
    with phase("4_commit"):
        placed, lost, attempt_ids = commit.commit(decided.placements, snap, report.epoch)
        cache.placed_by_us.update(attempt_ids)
        for job in lost:
            cache.forget_lost(job)
        report.preempted = commit.preempt(decided.preemptions)
        report.reserved, report.backfilled = decided.reserved, decided.backfilled
    with phase("5_explain"):
        explain.explain(cache, blocked)
        explain.estimates(cache, decided.estimates, now)
    return placed, lost, blocked


def _aborted(report: CycleReport, exc: DatabaseError) -> bool:
    """If the database rolled the cycle back for a reason of its own (a race, a timeout, a lost
    connection): say why, count it, drop a broken connection and return True."""
    cause = exc.__cause__
    sqlstate = getattr(cause, "sqlstate", None) or ""
    if isinstance(exc, IntegrityError) or sqlstate in _CONFLICT:
        reason = "conflict"
        constraint = getattr(getattr(cause, "diag", None), "constraint_name", None)
        what = f"another scheduler's writes won ({constraint or sqlstate})"
    elif sqlstate in _TIMEOUT:
        reason = "timeout"
        what = f"it ran past the stall bound of {settings.ORRERY_SCHEDULER_STALL_S:g} s"
    elif isinstance(exc, (OperationalError, InterfaceError, InternalError)):
        reason = "connection"
        what = "its database connection was terminated or lost"
    else:
        return False
    report.aborted = reason
    CYCLES_ABORTED.labels(reason).inc()
    log.warning(
        "scheduling cycle (epoch %d) rolled back: %s; nothing of it was committed and the cache is "
        "rebuilt next cycle (%s)",
        report.epoch,
        what,
        str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
    )
    if not connection.in_atomic_block:
        connection.close_if_unusable_or_obsolete()
    return True


def _last_cycle_age() -> None:
    """After a cycle that committed nothing: seconds since any scheduler last committed one
    (best effort; one primary-key read)."""
    try:
        at = SchedulerState.objects.filter(pk=1).values_list("last_cycle_at", flat=True).first()
    except DatabaseError:
        if not connection.in_atomic_block:
            connection.close_if_unusable_or_obsolete()
        return
    if at is not None:
        LAST_CYCLE_AGE.set(max((timezone.now() - at).total_seconds(), 0.0))


def _remember(report: CycleReport) -> None:
    """Keep a short history of cycles that placed work, for operators (best effort). A cycle
    that places nothing costs nothing here: with jobs waiting, that is every idle second."""
    if not report.ran or not (report.placed or report.lost_races or report.preempted):
        return
    entry = {
        "at": time.time(),
        "epoch": report.epoch,
        "ms": round(report.total_ms, 1),
        "placed": report.placed,
        "lost": report.lost_races,
        "blocked": report.unschedulable_classes,
        "pending": report.pending,
        "reserved": report.reserved,
        "preempted": report.preempted,
        "backfilled": report.backfilled,
        "phases": report.phases_ms,
    }
    try:
        recent = django_cache.get(RECENT_CYCLES_KEY) or []
        django_cache.set(RECENT_CYCLES_KEY, [*recent[-49:], entry], timeout=None)
    except Exception:  # a console nicety must never fail a cycle
        log.warning("could not record the cycle", exc_info=True)


def _gauges(cache: SchedulerCache) -> None:
    """Pending jobs by queue and GPUs by model and cluster, from the cache (no queries)."""
    snap = cache.snap
    if snap is None:
        return
    waiting: dict[int, int] = defaultdict(int)
    for cls in cache.queue:
        waiting[cls.shape[0]] += len(cls)
    for queue_id, name in snap.queue_names.items():
        PENDING_JOBS.labels(name).set(waiting.get(queue_id, 0))
    with_gpus = snap.model >= 0
    for c, cluster in enumerate(snap.cluster_names):
        for m, model in enumerate(snap.model_names):
            rows = with_gpus & (snap.cluster == c) & (snap.model == m)
            if rows.any():
                total = int(snap.gpu_total[rows].sum())
                GPUS.labels(model, cluster, "total").set(total)
                GPUS.labels(model, cluster, "allocated").set(total - int(snap.gpu_free[rows].sum()))
