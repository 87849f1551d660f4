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

**Pipelined** (PostgreSQL, outside a caller's transaction; ``pipelining()``): phases 1, 2, 3 and 5
run in one transaction on the caller's connection and phase 4 in another, on a committer
thread's connection, fenced by a compare-and-set of the epoch instead of the lock. ``run_cycles``
(the Celery task) runs cycles back to back through a backlog with each commit overlapping the
next cycle's decisions (``CyclePipeline`` says what each guarantee rests on); ``run_cycle`` waits
for its commit. SQLite, the embedded default, keeps the one-transaction cycle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

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
from foundation.sql import is_postgresql
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

__all__ = ["RECENT_CYCLES_KEY", "CyclePipeline", "CycleReport", "run_cycle", "run_cycles"]

log = logging.getLogger(__name__)
RECENT_CYCLES_KEY = "orrery:recent-cycles"  # the last 50 cycles, for the console's scheduler page
_Outcome = tuple[list[Placement], list[JobView], list[decide.Blocked]]
_CONFLICT = {"23505", "40001", "40P01"}  # unique violation, serialization failure, deadlock
_TIMEOUT = {"57014", "55P03", "25P03"}  # statement timeout, lock timeout, idle in transaction
BURST_S = 5.0  # run_cycles: how long back-to-back cycles may run through a backlog


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
    # why nothing of the cycle committed: the database rolled it back (conflict, timeout,
    # connection), a pipelined commit was fenced out (fenced) or came after one that did not land
    # (superseded)
    aborted: str = ""
    committing: bool = False  # pipelined: its commit is in flight (``placed`` is what it decided)
    landed_at: float = 0.0  # pipelined: ``time.perf_counter()`` when its commit landed
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


def run_cycle(
    cache: SchedulerCache | None = None, *, limit: int | None = None, pipelined: bool | None = None
) -> CycleReport:
    """Run one cycle; returns what it did, committed. ``cache`` defaults to the process's
    scheduler cache. ``pipelined`` (default: ``pipelining()``) decides and commits on two
    connections as ``CyclePipeline`` does, waiting for the commit; otherwise one transaction.

    A cycle the database rolls back — it lost a race at commit, it ran past the stall bound, its
    connection was terminated (a takeover) or lost — returns with ``aborted`` set instead of
    raising: nothing of it is committed, the cache is dropped (the next cycle rebuilds it from
    the database) and a broken connection is closed, so the next cycle gets a fresh one."""
    cache = cache or scheduler_cache()
    if pipelining() if pipelined is None else pipelined:
        pipeline = CyclePipeline(cache, limit=limit)
        report = pipeline.run()
        pipeline.drain()
        return report
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
    report.unschedulable_classes = len(blocked)
    _counted(cache, report, placed, lost, blocked, started)
    return report


def _counted(
    cache: SchedulerCache,
    report: CycleReport,
    placed: list[Placement],
    lost: list[JobView],
    blocked: list[decide.Blocked],
    started: float,
) -> None:
    """Metrics and the console's history for a cycle whose commit has landed."""
    report.placed, report.lost_races = len(placed), len(lost)
    report.pending = len(cache.queue)
    CYCLE_SECONDS.observe(time.perf_counter() - started)
    BACKFILLED.inc(report.backfilled)
    RESERVATIONS.set(report.reserved)
    ATTEMPTS.labels("scheduled").inc(report.placed)
    ATTEMPTS.labels("lost_race").inc(report.lost_races)
    ATTEMPTS.labels("unschedulable").inc(sum(len(b.cls) for b in blocked))
    _gauges(cache)
    _remember(report)


def _phases(cache: SchedulerCache, report: CycleReport, phase: _Phases, limit: int | None) -> _Outcome | None:
    """The five phases, in the caller's transaction; None when another scheduler holds the lock."""
    with phase("1_lock"):
        if not _locked():
            return None
        report.ran = True
        report.epoch = lock.next_epoch()
    with phase("2_sync"):
        snap = cache.ensure()
    now = time.time()
    with phase("3_decide"):
        decided = _decided(cache, snap, report.epoch, limit, now)
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


def _locked() -> bool:
    """Bound the transaction by the stall setting and take the scheduling lock; False when
    another scheduler holds it."""
    stall_s = settings.ORRERY_SCHEDULER_STALL_S
    lock.bound_transaction(stall_s)
    return lock.advisory_lock(stall_s)


def _decided(cache: SchedulerCache, snap: Any, epoch: int, limit: int | None, now: float) -> decide.Decided:
    return decide.decide(
        active_profile(), cache, snap, epoch, limit or settings.ORRERY_SCHEDULER_MAX_PLACEMENTS, now=now
    )


def pipelining() -> bool:
    """Whether cycles commit on a second connection: on PostgreSQL (SQLite, the embedded default,
    has one writer; its cycles stay sequential), unless ``ORRERY_SCHEDULER_PIPELINE`` is off, and
    never inside a caller's transaction, whose rows another connection cannot see."""
    return settings.ORRERY_SCHEDULER_PIPELINE and is_postgresql() and not connection.in_atomic_block


def run_cycles(
    cache: SchedulerCache | None = None, *, limit: int | None = None, budget_s: float = BURST_S
) -> list[CycleReport]:
    """Cycles back to back while each fills its placement limit (a backlog) and ``budget_s``
    lasts, pipelined where ``pipelining()`` allows; returns their reports, every commit landed."""
    cache = cache or scheduler_cache()
    limit = limit or settings.ORRERY_SCHEDULER_MAX_PLACEMENTS
    deadline = time.monotonic() + budget_s
    if not pipelining():
        reports = [run_cycle(cache, limit=limit, pipelined=False)]
        while reports[-1].placed >= limit and time.monotonic() < deadline:
            reports.append(run_cycle(cache, limit=limit, pipelined=False))
        return reports
    pipeline = CyclePipeline(cache, limit=limit)
    reports = []
    try:
        while True:
            report = pipeline.run()
            reports.append(report)
            if not report.ran or report.aborted or report.placed < limit or time.monotonic() >= deadline:
                break
    finally:
        pipeline.drain()
    return reports


class Fenced(Exception):
    """A pipelined commit found the epoch moved since its cycle read it: another cycle committed
    in between, so its decisions may rest on a view that no longer holds."""


@dataclass
class _Flight:
    """A cycle's decisions on their way to the database, on the committer thread."""

    report: CycleReport
    decided: decide.Decided
    snap: Any
    started: float
    thread: threading.Thread | None = None
    placed: list[Placement] = field(default_factory=list)
    lost: list[JobView] = field(default_factory=list)
    failed: bool = False
    error: BaseException | None = None  # not a database's refusal: raised on the caller's thread

    @property
    def epoch(self) -> int:
        return self.report.epoch


class CyclePipeline:
    """Cycles whose commits overlap the next cycle's decisions (PostgreSQL).

    ``run`` decides in a transaction of its own on the caller's connection (phases 1, 2, 3 and 5:
    the lock, sync, decide, explain), then hands the placements and preemptions to a committer
    thread, which writes them in one transaction on a connection of its own (phase 4) while the
    next ``run`` decides. What each guarantee rests on:

    - **Fencing.** A cycle decides on top of an epoch — the last committed one, or the one the
      commit still in flight will leave — and its commit first moves the epoch from that to its
      own by compare-and-set (``lock.advance_epoch``). Any other commit in between (a scheduler
      that took over, a second worker) leaves it moving nothing, and the commit is refused whole.
    - **Compare-and-set and nothing visible before commit.** The commit is ``commit.commit`` in
      one transaction, as in a sequential cycle.
    - **The cache.** The next cycle decides with the in-flight decisions assumed. Before handing
      its own on it waits for that commit; if it did not land (refused, rolled back), the cache is
      dropped and this cycle's decisions with it — nothing decided on top of a decision that did
      not commit is ever committed — and the next cycle rebuilds from the database.
    - **Own events.** Attempt ids are chosen with the decisions and registered in
      ``placed_by_us`` before the hand-off, so a sync that meets their events skips them
      whenever the commit lands.

    Reports of a cycle whose commit is in flight say ``committing``; ``placed`` is then what it
    decided, and becomes what committed once the commit lands (a later ``run`` or ``drain``).
    """

    def __init__(self, cache: SchedulerCache | None = None, *, limit: int | None = None) -> None:
        self.cache = cache or scheduler_cache()
        self.limit = limit
        self._flight: _Flight | None = None

    def run(self) -> CycleReport:
        """Decide one cycle, wait for the previous one's commit, hand this one's on."""
        cache = self.cache
        report = CycleReport()
        phase = _Phases(report)
        started = time.perf_counter()
        with lock.exclusive() as got_it, collector_paused():
            if not got_it:
                return report
            try:
                with transaction.atomic():
                    decided = self._decide(report, phase)
            except Fenced:
                cache.invalidate()
                _fenced(report)
                return report
            except DatabaseError as exc:
                cache.invalidate()
                self._settle(report)
                if not _aborted(report, exc):
                    raise
                return report
            except Exception:
                cache.invalidate()
                self._settle(report)
                raise
            landed = self._settle(report)
            if decided is None:
                _last_cycle_age()
                return report
            if not landed:
                # Decided on top of decisions that did not commit: drop both with the cache.
                cache.invalidate()
                report.aborted = "superseded"
                CYCLES_ABORTED.labels("superseded").inc()
                return report
            flight = _Flight(report, decided, cache.snap, started)
            cache.placed_by_us.update(d.attempt for d in decided.placements)
            report.placed = len(decided.placements)
            if decided.placements or decided.preemptions:
                report.committing = True
                flight.thread = threading.Thread(target=self._commit, args=(flight,), name="cycle-commit")
                flight.thread.start()
                self._flight = flight
            else:  # nothing to write: the epoch moved in the decide transaction
                LAST_CYCLE_AGE.set(0.0)
                _counted(cache, report, [], [], decided.blocked, started)
        return report

    def drain(self) -> CycleReport | None:
        """Wait for the commit in flight; returns its cycle's report, now final (None if none)."""
        flight = self._flight
        if flight is None:
            return None
        with collector_paused():
            self._settle(None)
        return flight.report

    def _decide(self, report: CycleReport, phase: _Phases) -> decide.Decided | None:
        """Phases 1, 2, 3 and 5 in the caller's transaction; None when another scheduler holds
        the lock."""
        cache = self.cache
        with phase("1_lock"):
            if not _locked():
                return None
            report.ran = True
        with phase("2_sync"):
            # A rebuild reads the database, where the commit in flight may not have landed: it
            # would see that commit's jobs pending and its GPUs free. So land it first.
            if self._flight is not None and cache.rebuild_due():
                self._settle(report)
            snap = cache.ensure()
            if self._flight is not None and snap is not self._flight.snap:  # the sync chose to rebuild
                self._settle(report)
                cache.rebuild()
                snap = cache.ensure()
        # On top of the commit in flight, if any (its epoch), else of the last committed one.
        report.epoch = (self._flight.epoch if self._flight is not None else lock.current_epoch()) + 1
        now = time.time()
        with phase("3_decide"):
            decided = _decided(cache, snap, report.epoch, self.limit, now)
        report.unschedulable_classes = len(decided.blocked)
        report.reserved, report.backfilled = decided.reserved, decided.backfilled
        with phase("5_explain"):
            # Reasons and estimates speak of jobs left pending: true whether or not the
            # placements in flight land, so they commit with the decisions' transaction.
            explain.explain(cache, decided.blocked)
            explain.estimates(cache, decided.estimates, now)
        # Nothing to write and nothing in flight: the epoch moves here, fenced as a commit's,
        # without a second transaction (what an idle cycle costs). With a commit in flight
        # it stays: that commit's epoch is this cycle's too.
        nothing = not decided.placements and not decided.preemptions
        if nothing and self._flight is None and not lock.advance_epoch(report.epoch - 1):
            raise Fenced
        return decided

    def _commit(self, flight: _Flight) -> None:
        """Phase 4 in one transaction on the committer thread's own connection (closed after):
        the fence, then the decisions."""
        report, decided = flight.report, flight.decided
        started = time.perf_counter()
        try:
            with transaction.atomic():
                lock.bound_transaction(settings.ORRERY_SCHEDULER_STALL_S)
                if not lock.advance_epoch(report.epoch - 1):
                    raise Fenced
                flight.placed, flight.lost, _ = commit.commit(decided.placements, flight.snap, report.epoch)
                report.preempted = commit.preempt(decided.preemptions)
            report.landed_at = time.perf_counter()
        except Fenced:
            flight.failed = True
            _fenced(report)
        except DatabaseError as exc:
            flight.failed = True
            if not _aborted(report, exc):
                flight.error = exc
        except BaseException as exc:
            flight.failed, flight.error = True, exc
        finally:
            report.phases_ms["4_commit"] = round((time.perf_counter() - started) * 1000, 2)
            connection.close()

    def _settle(self, current: CycleReport | None) -> bool:
        """Wait for the commit in flight and account for it; False if it did not land (the cache
        is then dropped). ``current``'s report gets the wait as ``4_wait``."""
        flight, self._flight = self._flight, None
        if flight is None:
            return True
        waited = time.perf_counter()
        if flight.thread is not None:
            flight.thread.join()
        if current is not None and current is not flight.report:
            current.phases_ms["4_wait"] = round((time.perf_counter() - waited) * 1000, 2)
        report, cache = flight.report, self.cache
        report.committing = False
        if flight.failed:
            cache.invalidate()
            report.placed = 0
            if flight.error is not None:
                raise flight.error
            return False
        LAST_CYCLE_AGE.set(0.0)  # it stamped last_cycle_at as it committed
        lost = {job.id for job in flight.lost}
        cache.placed_by_us.difference_update(d.attempt for d in flight.decided.placements if d.job.id in lost)
        if cache.snap is flight.snap:  # (None once dropped: the rebuild reads what did commit)
            for job in flight.lost:
                cache.forget_lost(job)
        _counted(cache, report, flight.placed, flight.lost, flight.decided.blocked, flight.started)
        return True


def _fenced(report: CycleReport) -> None:
    report.aborted = "fenced"
    report.placed = 0
    CYCLES_ABORTED.labels("fenced").inc()
    log.warning(
        "scheduling cycle (epoch %d) refused at commit: another cycle committed since it read "
        "epoch %d; nothing of it was committed and the cache is rebuilt",
        report.epoch,
        report.epoch - 1,
    )


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
