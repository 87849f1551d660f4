"""One scheduling cycle, in numbered phases with per-phase timing (as Kueue's ``schedule()``).

1. **Lock.** A transaction-scoped PostgreSQL advisory lock: a second concurrent cycle finds it
   taken and does nothing. (SQLite, the embedded default: a process lock.) The epoch — the
   fencing token every attempt carries — is bumped in the same transaction.
2. **Sync.** The cache brings the snapshot and the pending queue up to date from the event logs.
3. **Decide.** Equivalence classes in queue-sort order; for each head job: PreFilter (quota,
   gang), the class's Filter mask (computed once per class, then re-checked only on rows that
   changed), Score, select nodes and exact GPU indices, Reserve, assume. A class that does not
   fit is given up for the rest of the cycle (capacity only shrinks within a cycle) and its
   jobs are told why, in a sentence built from the filter masks.
4. **Commit**, in the same transaction: compare-and-set every placed job PENDING → SCHEDULED
   (a job cancelled meanwhile loses its placement), then bulk-insert attempts, allocations,
   events and outbox rows (``COPY`` on PostgreSQL). A crash before commit leaves no trace.
5. **Explain.** Pending reasons, written only when they change (and at most every 10 s per
   class).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import uuid
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from django.conf import settings
from django.core.cache import cache as django_cache
from django.db import connection, transaction
from django.utils import timezone

from foundation.live import publish_on_commit
from foundation.performance import collector_paused
from foundation.sql import NULL, TRUE, bulk_insert, copy_escape, is_postgresql, pg_array
from scheduling.choices import AttemptState, EventKind, JobState, PendingReason
from scheduling.desired import forget_desired
from scheduling.engine.cache import scheduler_cache
from scheduling.engine.framework import Code, CycleState, JobView, NodeChoice, Placement, Status
from scheduling.engine.policies import Profile, active_profile
from scheduling.engine.queue import JobClass
from scheduling.metrics import ATTEMPTS, CYCLE_SECONDS, GPUS, PENDING_JOBS
from scheduling.models import DispatchOutbox, Queue, SchedulerState
from scheduling.wakeup import ring_dispatch

log = logging.getLogger(__name__)
LOCK_KEY = 0x0_5C4E_D01E  # pg advisory lock id of the scheduling cycle
EXPLAIN_EVERY_S = 10.0
RECENT_CYCLES_KEY = "orrery:recent-cycles"  # the last 50 cycles, for the console's scheduler page
_process_lock = threading.Lock()


@dataclass
class CycleReport:
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
    def __init__(self, report: CycleReport) -> None:
        self.report = report

    @contextmanager
    def __call__(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.report.phases_ms[name] = round((time.perf_counter() - started) * 1000, 2)


def run_cycle(cache: Any = None, *, limit: int | None = None) -> CycleReport:
    """Run one cycle; returns what it did. ``cache`` defaults to the process's scheduler cache."""
    cache = cache or scheduler_cache()
    report = CycleReport()
    phase = _Phases(report)
    started = time.perf_counter()
    with _exclusive() as got_it, collector_paused():
        if not got_it:
            return report  # another cycle is running: this one is a no-op
        try:
            with transaction.atomic():
                with phase("1_lock"):
                    if not _advisory_lock():
                        return report
                    report.ran = True
                    report.epoch = _next_epoch()
                with phase("2_sync"):
                    snap = cache.ensure()
                with phase("3_decide"):
                    decisions, blocked = decide(
                        active_profile(),
                        cache,
                        snap,
                        report.epoch,
                        limit or settings.ORRERY_SCHEDULER_MAX_PLACEMENTS,
                    )
                with phase("4_commit"):
                    placed, lost, attempt_ids = commit(decisions, snap, report.epoch)
                    cache.placed_by_us.update(attempt_ids)
                    for job in lost:
                        cache.forget_lost(job)
                with phase("5_explain"):
                    explain(cache, blocked)
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


def _gauges(cache: Any) -> None:
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


@contextmanager
def _exclusive():
    """One cycle per process at a time; across processes the advisory lock decides."""
    got = _process_lock.acquire(blocking=False)
    try:
        yield got
    finally:
        if got:
            _process_lock.release()


def _advisory_lock() -> bool:
    if not is_postgresql():
        return True  # SQLite: one process, serialised by _exclusive and the write lock
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [LOCK_KEY])
        return bool(cursor.fetchone()[0])


def _next_epoch() -> int:
    state, _ = SchedulerState.objects.get_or_create(pk=1)
    SchedulerState.objects.filter(pk=1).update(epoch=state.epoch + 1, last_cycle_at=timezone.now())
    return state.epoch + 1


# --- 3. decide ------------------------------------------------------------------------------


@dataclass
class Blocked:
    cls: JobClass
    status: Status


def decide(
    profile: Profile,
    cache: Any,
    snap: Any,
    epoch: int,
    limit: int,
    queues: dict[int, tuple[int, float, int]] | None = None,
) -> tuple[list[Placement], list[Blocked]]:
    """Decide placements in memory (no writes): ``queues`` maps queue id → (priority,
    fair-share weight, project id) and is read from the database when not given."""
    state = CycleState(epoch=epoch)
    if queues is None:
        queues = {
            pk: (prio, weight, project)
            for pk, prio, weight, project in Queue.objects.values_list(
                "pk", "priority", "fair_share_weight", "project_id"
            )
        }
    state.data["queue_priority"] = {q: v[0] for q, v in queues.items()}
    state.data["queue_project"] = {q: v[2] for q, v in queues.items()}
    weights: dict[int, float] = {}
    for _, weight, project in queues.values():
        weights[project] = max(weights.get(project, 0.0), weight)
    state.data["project_weight"] = weights

    def key(cls: JobClass) -> tuple[Any, ...]:
        head = cls.head
        parts: tuple[Any, ...] = ()
        for plugin in profile.queue_sort:
            parts += plugin.sort_key(state, snap, head)
        return (*parts, head.submitted_at, head.id)

    heap = [(key(cls), n, cls) for n, cls in enumerate(cache.queue)]
    heapq.heapify(heap)
    masks: dict[tuple[Any, ...], tuple[np.ndarray, int]] = {}
    decisions: list[Placement] = []
    blocked: list[Blocked] = []
    counter = len(heap)
    while heap and len(decisions) < limit:
        stale_key, _, cls = heapq.heappop(heap)
        if not len(cls):
            continue
        # Keys can go stale (a placement raises a project's fair share): re-key lazily, and go
        # back in line if another class now comes first.
        fresh = key(cls)
        if heap and fresh != stale_key and fresh > heap[0][0]:
            counter += 1
            heapq.heappush(heap, (fresh, counter, cls))
            continue
        job = cls.head
        # A class found not to fit, with nothing changed in the snapshot since (no placement,
        # release or node change): the same verdict, without looking again.
        verdict = cache.verdicts.get(cls.shape)
        if verdict is not None and verdict[0] is snap and verdict[1] == len(snap.changed):
            blocked.append(Blocked(cls, verdict[2]))
            continue
        status = next((s for p in profile.pre_filter if not (s := p.pre_filter(state, snap, job)).ok), None)
        placement = None
        if status is None:
            mask = _class_mask(profile, state, snap, job, masks)
            placement = select(profile, state, snap, job, mask)
            if placement is None:
                status = _why(profile, state, snap, job)
                for plugin in profile.post_filter:  # preemption's extension point
                    plugin.post_filter(state, snap, job)
        if placement is not None:
            status = _reserve(profile, state, snap, placement)
        if status is not None:
            cache.verdicts[cls.shape] = (snap, len(snap.changed), status)
            blocked.append(Blocked(cls, status))
            continue
        cache.queue.pop_head(cls)
        cache.assume(job, [(c.row, c.gpu_indices) for c in placement.nodes], job.queue_id)
        decisions.append(placement)
        if len(cls):
            counter += 1
            heapq.heappush(heap, (key(cls), counter, cls))
    return decisions, blocked


def _reserve(profile: Profile, state: CycleState, snap: Any, placement: Placement) -> Status | None:
    """Run every Reserve plugin; if one refuses, undo the ones before it and say why."""
    done = []
    for plugin in profile.reserve:
        status = plugin.reserve(state, snap, placement)
        if not status.ok:
            for earlier in reversed(done):
                earlier.unreserve(state, snap, placement)
            return status
        done.append(plugin)
    return None


def _class_mask(
    profile: Profile,
    state: CycleState,
    snap: Any,
    job: JobView,
    masks: dict[tuple[Any, ...], tuple[np.ndarray, int]],
) -> np.ndarray:
    """The class's filter mask over all rows: computed once, then only rows changed since (by
    placements of this cycle) are checked again."""
    shape = job.shape()
    cached = masks.get(shape)
    if cached is None:
        rows = snap.all_rows
        mask = np.ones(len(rows), dtype=bool)
        for plugin in profile.filter:
            mask &= plugin.filter(state, snap, job, rows)
    else:
        mask, seen = cached
        if seen < len(snap.changed):
            rows = np.unique(np.asarray(snap.changed[seen:], dtype=np.int64))
            ok = np.ones(len(rows), dtype=bool)
            for plugin in profile.filter:
                ok &= plugin.filter(state, snap, job, rows)
            mask[rows] = ok
    masks[shape] = (mask, len(snap.changed))
    return mask


def select(
    profile: Profile, state: CycleState, snap: Any, job: JobView, mask: np.ndarray
) -> Placement | None:
    """The best node (or, for a gang, the best set of nodes in one cluster) among the feasible
    rows, by weighted score; GPU indices chosen on each. None when nothing fits."""
    rows = np.flatnonzero(mask)
    if len(rows) < job.nodes:
        return None
    scores = np.zeros(len(rows))
    for plugin, weight in profile.score:
        if weight:
            scores += weight * plugin.score(state, snap, job, rows)
    if job.nodes == 1:
        row = int(rows[int(np.argmax(scores))])
        chosen = [row]
    else:
        chosen = []
        best_total = -np.inf
        clusters = snap.cluster[rows]
        for cluster in np.unique(clusters):
            in_cluster = np.flatnonzero(clusters == cluster)
            if len(in_cluster) < job.nodes:
                continue
            top = in_cluster[np.argsort(-scores[in_cluster], kind="stable")[: job.nodes]]
            total = float(scores[top].sum())
            if total > best_total:
                best_total, chosen = total, [int(r) for r in rows[top]]
        if not chosen:
            return None
    nodes = tuple(NodeChoice(row, snap.choose_gpus(row, job.gpus)) for row in chosen)
    return Placement(job, int(snap.cluster[chosen[0]]), nodes)


def _why(profile: Profile, state: CycleState, snap: Any, job: JobView) -> Status:
    """'0/10,000 nodes fit: 9,800 lack 8 free h100-80g, 200 not ready' from the filter masks."""
    rows = snap.all_rows
    remaining = np.ones(len(rows), dtype=bool)
    parts, stopped_by = [], []
    for plugin in profile.filter:
        ok = plugin.filter(state, snap, job, rows)
        refused = int(np.count_nonzero(remaining & ~ok))
        if refused:
            parts.append(plugin.explain(job, snap, refused))
            stopped_by.append(plugin.name)
        remaining &= ok
    fit = int(np.count_nonzero(remaining))
    if fit and job.nodes > 1:
        message = f"{fit:,}/{len(rows):,} nodes fit, not {job.nodes} in one cluster"
    else:
        message = f"{fit:,}/{len(rows):,} nodes fit" + (": " + ", ".join(parts) if parts else "")
    reason = PendingReason.RESOURCES
    if stopped_by and set(stopped_by) <= {"node_state", "cluster_affinity"}:
        reason = PendingReason.CLUSTER_UNAVAILABLE
    return Status(Code.UNSCHEDULABLE, reason, message)


# --- 4. commit -------------------------------------------------------------------------------


def commit(
    decisions: list[Placement], snap: Any, epoch: int
) -> tuple[list[Placement], list[JobView], list[uuid.UUID]]:
    """Write every decision in the current transaction; returns (placed, jobs that lost a race,
    the new attempts' ids)."""
    if not decisions:
        return [], [], []
    won = _claim([d.job for d in decisions])
    placed = [d for d in decisions if d.job.id in won]
    lost = [d.job for d in decisions if d.job.id not in won]
    if not placed:
        return [], lost, []
    now = timezone.now()
    # Rows are built text-ready for COPY (one string per timestamp and attempt id, "t" for
    # true, NULL as \N); ``bulk_insert`` turns them back into values for SQLite.
    at, yes, null = now.isoformat(), TRUE, NULL
    attempts, allocations, events, outbox = [], [], [], []
    for d in placed:
        job = d.job
        attempt = str(uuid.uuid4())
        cluster_id = snap.cluster_ids[d.cluster]
        attempts.append(
            (attempt, job.id, job.attempts + 1, cluster_id, AttemptState.SCHEDULED, yes, epoch, "", "", at)
        )
        where = []
        for choice in d.nodes:
            node_id = int(snap.node_id[choice.row])
            allocations.append((attempt, job.id, node_id, null, job.cpu, job.memory, yes, at))
            ids = snap.gpu_ids[choice.row]
            for i in choice.gpu_indices:
                allocations.append((attempt, job.id, node_id, ids[i], 0, 0, yes, at))
            where.append(f"{snap.names[choice.row]}[{','.join(map(str, choice.gpu_indices))}]")
        message = copy_escape(f"placed on {snap.cluster_names[d.cluster]}: {' '.join(where)} (epoch {epoch})")
        events.append(
            (job.id, attempt, at, EventKind.TRANSITION, JobState.PENDING, JobState.SCHEDULED, "", message)
        )
        outbox.append(
            (attempt, cluster_id, DispatchOutbox.Kind.START, DispatchOutbox.State.PENDING, epoch, at, 0, "")
        )
    bulk_insert(
        "scheduling_jobattempt",
        [
            "id",
            "job_id",
            "number",
            "cluster_id",
            "state",
            "active",
            "epoch",
            "remote_id",
            "reason",
            "created_at",
        ],
        attempts,
    )
    bulk_insert(
        "scheduling_allocation",
        [
            "attempt_id",
            "job_id",
            "node_id",
            "gpu_id",
            "cpu_millicores",
            "memory_bytes",
            "active",
            "allocated_at",
        ],
        allocations,
    )
    bulk_insert(
        "scheduling_jobevent",
        ["job_id", "attempt_id", "at", "kind", "from_state", "to_state", "reason", "message"],
        events,
    )
    bulk_insert(
        "scheduling_dispatchoutbox",
        ["attempt_id", "cluster_id", "kind", "state", "epoch", "created_at", "tries", "last_error"],
        outbox,
    )
    placed_nodes = sorted({int(snap.node_id[c.row]) for d in placed for c in d.nodes})
    transaction.on_commit(lambda: forget_desired(placed_nodes))
    ring_dispatch()
    by_project: dict[int, list[int]] = defaultdict(list)
    for d in placed:
        by_project[d.job.project_id].append(d.job.id)
    from scheduling.events import JobsScheduled

    for project_id, ids in by_project.items():
        publish_on_commit([f"project.{project_id}"], JobsScheduled(project_id, ids[:100], len(ids), epoch))
    return placed, lost, [uuid.UUID(row[0]) for row in attempts]


def _claim(jobs: list[JobView]) -> set[int]:
    """Compare-and-set PENDING → SCHEDULED for all placed jobs at once; returns the winners."""
    ids = [j.id for j in jobs]
    with connection.cursor() as cursor:
        if is_postgresql():
            cursor.execute(
                """
                UPDATE scheduling_job j SET state = %s, version = j.version + 1, attempt_count = j.attempt_count + 1,
                    reason = '', reason_message = ''
                FROM unnest(%s::bigint[]) AS v(id)
                WHERE j.id = v.id AND j.state = %s
                RETURNING j.id
                """,
                [JobState.SCHEDULED, pg_array(ids), JobState.PENDING],
            )
            return {row[0] for row in cursor.fetchall()}
        won = set()
        for job_id in ids:
            cursor.execute(
                "UPDATE scheduling_job SET state = %s, version = version + 1, attempt_count = attempt_count + 1, "
                "reason = '', reason_message = '' WHERE id = %s AND state = %s",
                [JobState.SCHEDULED, job_id, JobState.PENDING],
            )
            if cursor.rowcount == 1:
                won.add(job_id)
        return won


# --- 5. explain ------------------------------------------------------------------------------


def explain(cache: Any, blocked: list[Blocked]) -> None:
    """Tell waiting jobs why, in as few writes as possible: only when a class's reason changed
    (its counts at most every 10 s), and at most ``ORRERY_SCHEDULER_EXPLAIN_BUDGET`` jobs a
    cycle — a class too large for one cycle is told in slices, in the cycles that follow."""
    now = time.monotonic()
    budget = settings.ORRERY_SCHEDULER_EXPLAIN_BUDGET
    for b in blocked:
        if budget <= 0:
            break
        shape = b.cls.shape
        said = ((b.status.reason or PendingReason.RESOURCES), b.status.message[:512])
        last = cache.explained.get(shape)  # (what was said, when it was finished, jobs, told so far)
        if (
            last is not None
            and last[3] >= len(b.cls)
            and now - last[1] < EXPLAIN_EVERY_S
            and last[0][0] == said[0]
        ):
            continue  # told, and the reason is the same (counts in the sentence may have moved)
        told = last[3] if last is not None and last[0] == said and last[3] < last[2] else 0
        ids = [job.id for _, job in b.cls.jobs[told : told + budget]]
        budget -= len(ids)
        _set_reasons(ids, *said)
        told += len(ids)
        cache.explained[shape] = (said, now, len(b.cls), told)


def _set_reasons(ids: list[int], reason: str, message: str) -> None:
    with connection.cursor() as cursor:
        if is_postgresql():
            cursor.execute(
                """
                UPDATE scheduling_job SET reason = %s, reason_message = %s
                WHERE id = ANY(%s::bigint[]) AND state = %s AND (reason, reason_message) IS DISTINCT FROM (%s, %s)
                """,
                [reason, message, pg_array(ids), JobState.PENDING, reason, message],
            )
        else:
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                cursor.execute(
                    f"UPDATE scheduling_job SET reason = %s, reason_message = %s WHERE state = %s "
                    f"AND id IN ({','.join(['%s'] * len(chunk))})",
                    [reason, message, JobState.PENDING, *chunk],
                )
