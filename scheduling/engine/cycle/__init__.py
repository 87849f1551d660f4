"""One scheduling cycle, in numbered phases with per-phase timing (as Kueue's ``schedule()``).

1. **Lock** (``lock``). A transaction-scoped PostgreSQL advisory lock: a second concurrent cycle
   finds it taken and does nothing. (SQLite, the embedded default: a process lock.) The epoch —
   the fencing token every attempt carries — is bumped in the same transaction.
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
5. **Explain** (``explain``). Pending reasons, written only when they change (and at most every
   10 s per class).

``run_cycle`` runs the phases in order and reports what they did (``CycleReport``).
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
from django.db import transaction

from foundation.performance import collector_paused
from scheduling.engine.cache import SchedulerCache, scheduler_cache
from scheduling.engine.cycle import commit, decide, explain, lock
from scheduling.engine.policies import active_profile
from scheduling.metrics import ATTEMPTS, CYCLE_SECONDS, GPUS, PENDING_JOBS

__all__ = ["RECENT_CYCLES_KEY", "CycleReport", "run_cycle"]

log = logging.getLogger(__name__)
RECENT_CYCLES_KEY = "orrery:recent-cycles"  # the last 50 cycles, for the console's scheduler page


@dataclass
class CycleReport:
    """What one call of ``run_cycle`` did; ``ran`` is False when another cycle held the lock."""

    ran: bool = False
    epoch: int = 0
    placed: int = 0
    lost_races: int = 0
    unschedulable_classes: int = 0
    pending: int = 0
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
    """Run one cycle; returns what it did. ``cache`` defaults to the process's scheduler cache."""
    cache = cache or scheduler_cache()
    report = CycleReport()
    phase = _Phases(report)
    started = time.perf_counter()
    with lock.exclusive() as got_it, collector_paused():
        if not got_it:
            return report  # another cycle is running: this one is a no-op
        try:
            with transaction.atomic():
                with phase("1_lock"):
                    if not lock.advisory_lock():
                        return report
                    report.ran = True
                    report.epoch = lock.next_epoch()
                with phase("2_sync"):
                    snap = cache.ensure()
                with phase("3_decide"):
                    decisions, blocked = decide.decide(
                        active_profile(),
                        cache,
                        snap,
                        report.epoch,
                        limit or settings.ORRERY_SCHEDULER_MAX_PLACEMENTS,
                    )
                with phase("4_commit"):
                    placed, lost, attempt_ids = commit.commit(decisions, snap, report.epoch)
                    cache.placed_by_us.update(attempt_ids)
                    for job in lost:
                        cache.forget_lost(job)
                with phase("5_explain"):
                    explain.explain(cache, blocked)
        except Exception:
            cache.invalidate()  # assumed decisions died with the transaction
            raise
    report.placed, report.lost_races = len(placed), len(lost)
    report.unschedulable_classes = len(blocked)
    report.pending = len(cache.queue)
    CYCLE_SECONDS.observe(time.perf_counter() - started)
    ATTEMPTS.labels("scheduled").inc(report.placed)
    ATTEMPTS.labels("lost_race").inc(report.lost_races)
    ATTEMPTS.labels("unschedulable").inc(sum(len(b.cls) for b in blocked))
    _gauges(cache)
    _remember(report)
    return report


def _remember(report: CycleReport) -> None:
    """Keep a short history of cycles that placed work, for operators (best effort). A cycle
    that places nothing costs nothing here: with jobs waiting, that is every idle second."""
    if not report.ran or not (report.placed or report.lost_races):
        return
    entry = {
        "at": time.time(),
        "epoch": report.epoch,
        "ms": round(report.total_ms, 1),
        "placed": report.placed,
        "lost": report.lost_races,
        "blocked": report.unschedulable_classes,
        "pending": report.pending,
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
