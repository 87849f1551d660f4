"""Preemption (PostFilter): when a job cannot be placed, the cheapest set of running jobs whose
GPUs would let it fit — on any cluster it may use, so preemption works across clusters.

Who may be preempted is the preemptor's queue's rule (``Queue.preempt_within_queue`` and
``Queue.reclaim_within_cohort``, as Kueue's ``withinClusterQueue`` / ``reclaimWithinCohort``):

* within its queue, jobs of *strictly lower* priority (``lower_priority``);
* across its cohort, to reclaim quota it lent — only while the preemptor's queue is within its
  own nominal quota of that model — jobs of queues that are borrowing it: of lower priority
  (``lower_priority``) or of any priority up to the preemptor's own (``any``).

Never a job of higher priority than the preemptor, never one marked non-preemptible, never one
already draining. Gangs go whole: a victim is a job, and all its nodes come free.

Victims are chosen per node by least lost work (GPU-seconds run since their last checkpoint, or
their start), then lowest priority, then newest; a node's cost is the lost work of the fewest
cheapest victims that free enough GPUs on it, and the preemptor takes the cheapest node (a gang:
the cheapest nodes of one cluster). Then the preemptor's quota is checked with the victims
gone, adding cheapest quota-holding victims until it fits. The arrays are per (victim, node it
holds); nothing loops over the fleet's nodes in Python.

The victims are written in the cycle's commit (``preempt_jobs``): each gets its signal and
grace period and is requeued when it has stopped; the preemptor is **nominated** for the GPUs
they free, and backfill's reservations keep those GPUs for it while they drain.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from scheduling.choices import PreemptWithinQueue, ReclaimWithinCohort
from scheduling.engine.framework import NEVER, OK, Code, CycleState, JobView, Status
from scheduling.engine.snapshot import QuotaBook, Snapshot
from scheduling.engine.timeline import lowest_in_one_cluster

NOMINATION_SLACK_S = 120.0  # a nomination lapses this long after its victims should have stopped


@dataclass(frozen=True)
class Nomination:
    """GPUs held for a preemptor while its victims drain."""

    rows: tuple[int, ...]
    gpus: int  # per row
    start: float  # when the last victim's grace period ends
    until: float  # when the hold lapses if the preemptor has still not been placed
    cluster: int
    victims: tuple[int, ...]
    limit: float = NEVER  # the preemptor's time limit: how long it will hold them


@dataclass(frozen=True)
class Decision:
    """Victims chosen for a preemptor, with the words each victim's history will show."""

    preemptor: int
    victims: tuple[int, ...]
    reason: str  # "within_queue" or "reclaim"
    message: str


class Preemption:
    """PostFilter: preempt the cheapest running jobs the preemptor's queue rules allow (see the
    module docstring)."""

    name = "preemption"

    def __init__(self, max_per_cycle: int = 16) -> None:
        if not isinstance(max_per_cycle, int) or max_per_cycle < 0:
            raise TypeError("max_per_cycle is an integer ≥ 0")
        self.max_per_cycle = max_per_cycle

    def post_filter(self, state: CycleState, snap: Snapshot, job: JobView) -> Status:
        if not job.gpus or job.model < 0:
            return OK
        nominated = state.data["nominated"].get(job.id)
        runs = state.data["runs"]
        if nominated is not None:
            draining = [v for v in nominated.victims if v in runs]
            if draining:
                return Status(Code.UNSCHEDULABLE, "", f"waiting for {len(draining)} preempted job(s) to stop")
        within, reclaim, _ = state.data["queue_policy"].get(job.queue_id, ("never", "never", 30))
        if within == PreemptWithinQueue.NEVER and reclaim == ReclaimWithinCohort.NEVER:
            return OK
        decisions: list[Decision] = state.data.setdefault("preemptions", [])
        if len(decisions) >= self.max_per_cycle:
            return OK
        found = self._choose(state, snap, job, within, reclaim)
        if found is None:
            return OK
        victims, reason, rows, cluster = found
        now = state.data["now"]
        policy = state.data["queue_policy"]
        ends = []
        drained = state.data.setdefault("drained", [])  # (run before, run now): for backfill's timelines
        for v in victims:
            run = runs[v]
            before = replace(run)
            run.draining_until = now + policy.get(run.queue, ("", "", 30))[2]
            drained.append((before, run))
            ends.append(run.draining_until)
        state.data["runs_version_bump"]()
        start = max(ends)
        state.data["nominated"][job.id] = Nomination(
            tuple(rows), job.gpus, start, start + NOMINATION_SLACK_S, cluster, tuple(victims), job.time_limit
        )
        queue = snap.queue_names.get(job.queue_id, str(job.queue_id))
        why = (
            "a higher-priority job of its queue needs its GPUs"
            if reason == "within_queue"
            else f"queue {queue} reclaims GPU quota it lent"
        )
        message = f"preempted by job {job.id} ({queue}, priority {job.priority}): {why}"
        decisions.append(Decision(job.id, tuple(victims), reason, message))
        return Status(Code.UNSCHEDULABLE, "", f"preempting {len(victims)} job(s) to make room")

    # --- choosing -------------------------------------------------------------------------------
    def _choose(
        self, state: CycleState, snap: Snapshot, job: JobView, within: str, reclaim: str
    ) -> tuple[list[int], str, list[int], int] | None:
        runs = state.data["runs"]
        book = snap.quota
        model = job.model
        parts: list[_Runs] = []
        if within == PreemptWithinQueue.LOWER_PRIORITY:
            parts.append(
                _ordered(state, runs, job.queue_id, model).allowed(job.priority, strictly_lower=True)
            )
        cohort = book.cohort_of.get(job.queue_id)
        if reclaim != ReclaimWithinCohort.NEVER and cohort and _within_nominal(book, job):
            strictly = reclaim == ReclaimWithinCohort.LOWER_PRIORITY
            for queue in book.members.get(cohort, ()):
                if queue == job.queue_id or not _borrowing(book, queue, model):
                    continue
                parts.append(
                    _ordered(state, runs, queue, model).allowed(job.priority, strictly_lower=strictly)
                )
        # Cheapest first: least lost work, then lowest priority, then newest (ties in the order found).
        order = _Runs.merged(parts).ids.tolist()
        if not order:
            return None
        picked = _capacity(state, snap, job, order, runs)
        if picked is None:
            return None
        victims, rows, cluster = picked
        victims = _with_quota(book, job, victims, order, runs)
        if not victims:
            return None  # none would help (it waits on something preemption cannot free)
        reasons = {"within_queue" if runs[v].queue == job.queue_id else "reclaim" for v in victims}
        return victims, ("within_queue" if reasons == {"within_queue"} else "reclaim"), rows, cluster


def _within_nominal(book: QuotaBook, job: JobView) -> bool:
    key = (job.queue_id, job.model)
    return book.used.get(key, 0) + job.total_gpus <= book.nominal.get(key, 0)


def _borrowing(book: QuotaBook, queue: int, model: int) -> bool:
    key = (queue, model)
    return queue in book.limited and book.used.get(key, 0) > book.nominal.get(key, 0)


@dataclass
class _Runs:
    """Running jobs as columns, cheapest to preempt first: ids, lost work, priority, the negated
    start (the sort key, in that order) and whether each may be preempted at all (preemptible and
    not already draining)."""

    ids: np.ndarray
    lost: np.ndarray
    priority: np.ndarray
    newest: np.ndarray
    free: np.ndarray

    def allowed(self, priority: int, *, strictly_lower: bool) -> _Runs:
        """Those a job of ``priority`` may preempt."""
        keep = self.free & ((self.priority < priority) if strictly_lower else (self.priority <= priority))
        return _Runs(self.ids[keep], self.lost[keep], self.priority[keep], self.newest[keep], self.free[keep])

    @staticmethod
    def merged(parts: list[_Runs]) -> _Runs:
        """One ordering of several, by the sort key; stable, so ties keep the order of ``parts``."""
        if len(parts) == 1:
            return parts[0]
        if not parts:
            empty = np.zeros(0)
            return _Runs(empty.astype(np.int64), empty, empty.astype(np.int64), empty, empty.astype(bool))
        cols = [
            np.concatenate([getattr(p, name) for p in parts])
            for name in ("ids", "lost", "priority", "newest", "free")
        ]
        order = np.lexsort((cols[3], cols[2], cols[1]))
        return _Runs(*(c[order] for c in cols))


def _ordered(state: CycleState, runs: dict[int, Any], queue: int, model: int) -> _Runs:
    """The running jobs of (queue, model) as ``_Runs``, sorted once per cycle; which may be
    preempted is re-read after each preemption decided (its victims start draining)."""
    index = state.data.get("preemption.by_queue")
    if index is None:
        index = {}
        for job_id, run in runs.items():
            index.setdefault((run.queue, run.model), []).append(job_id)
        state.data["preemption.by_queue"] = index
        state.data["preemption.ordered"] = {}
    drained = len(state.data.get("drained", ()))
    cached = state.data["preemption.ordered"].get((queue, model))
    if cached is not None and cached[0] == drained:
        return cached[1]
    if cached is not None:  # victims started draining since: only who may be preempted changed
        found = cached[1]
        found.free = np.fromiter(
            (runs[v].preemptible and runs[v].draining_until is None for v in found.ids.tolist()),
            dtype=bool,
            count=len(found.ids),
        )
    else:
        now = state.data["now"]
        members = [runs[v] for v in index.get((queue, model), ())]
        ids = np.fromiter(index.get((queue, model), ()), dtype=np.int64, count=len(members))
        lost = np.fromiter((r.lost_work(now) for r in members), dtype=float, count=len(members))
        priority = np.fromiter((r.priority for r in members), dtype=np.int64, count=len(members))
        newest = np.fromiter((-r.start for r in members), dtype=float, count=len(members))
        free = np.fromiter(
            (r.preemptible and r.draining_until is None for r in members), dtype=bool, count=len(members)
        )
        order = np.lexsort((newest, priority, lost))
        found = _Runs(ids[order], lost[order], priority[order], newest[order], free[order])
    state.data["preemption.ordered"][(queue, model)] = (drained, found)
    return found


def _capacity(
    state: CycleState, snap: Snapshot, job: JobView, order: list[int], runs: dict[int, Any]
) -> tuple[list[int], list[int], int] | None:
    """The cheapest victims (a prefix of ``order`` per node) that free enough GPUs on enough
    nodes; returns (victims, rows, cluster)."""
    now = state.data["now"]
    allowed = state.data["static_mask"](job)
    need = job.gpus - snap.gpu_free.astype(np.int64)
    row_l, gpus_l, cost_l, rank_l = [], [], [], []
    for rank, v in enumerate(order):
        run = runs[v]
        cost = run.lost_work(now)
        for row, gpus in run.rows:
            if gpus and allowed[row] and need[row] > 0:
                row_l.append(row)
                gpus_l.append(gpus)
                cost_l.append(cost)
                rank_l.append(rank)
    cost_row = np.full(len(snap), NEVER)
    cost_row[allowed & (need <= 0)] = 0.0  # fits already (the job waits on quota, not GPUs)
    prefix_end: dict[int, int] = {}
    starts: dict[int, int] = {}
    ranks = np.zeros(0, dtype=np.int64)
    if row_l:
        rows = np.asarray(row_l, dtype=np.int64)
        ranks = np.asarray(rank_l, dtype=np.int64)
        gpus = np.asarray(gpus_l, dtype=np.int64)
        costs = np.asarray(cost_l)
        sort = np.lexsort((ranks, rows))
        rows, ranks, gpus, costs = rows[sort], ranks[sort], gpus[sort], costs[sort]
        first = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
        size = np.diff(np.r_[first, len(rows)])
        cum = np.cumsum(gpus)
        cum = cum - np.repeat(cum[first] - gpus[first], size)
        cum_cost = np.cumsum(costs)
        cum_cost = cum_cost - np.repeat(cum_cost[first] - costs[first], size)
        hit = np.flatnonzero(cum >= need[rows])
        if len(hit):
            found, at = np.unique(rows[hit], return_index=True)
            cost_row[found] = cum_cost[hit[at]]
            starts = dict(zip(rows[first].tolist(), first.tolist(), strict=True))
            for row, end in zip(found.tolist(), hit[at].tolist(), strict=True):
                prefix_end[row] = end
    feasible = np.flatnonzero(cost_row < NEVER)
    if len(feasible) < job.nodes:
        return None
    if job.nodes == 1:
        chosen = [int(feasible[int(np.argmin(cost_row[feasible]))])]
    else:
        found = lowest_in_one_cluster(snap, cost_row, job.nodes, np.sum)
        if found is None:
            return None
        chosen = list(found[1])
    victims: list[int] = []
    for row in chosen:
        if row in prefix_end:
            for k in range(starts[row], prefix_end[row] + 1):
                victim = order[int(ranks[k])]
                if victim not in victims:
                    victims.append(victim)
    return victims, chosen, int(snap.cluster[chosen[0]])


def _with_quota(
    book: QuotaBook, job: JobView, victims: list[int], order: list[int], runs: dict[int, Any]
) -> list[int] | None:
    """``victims``, plus the cheapest further candidates needed for the preemptor's quota to
    fit once they are gone; None when even all candidates would not free enough."""
    if job.queue_id not in book.limited:
        return victims
    trial = replace(book, used=dict(book.used))
    for v in victims:
        run = runs[v]
        trial.add(run.queue, run.model, -run.gpus)
    chosen = list(victims)
    for v in order:
        if trial.headroom(job.queue_id, job.model) >= job.total_gpus:
            return chosen
        if v in chosen:
            continue
        run = runs[v]
        trial.add(run.queue, run.model, -run.gpus)
        chosen.append(v)
    return chosen if trial.headroom(job.queue_id, job.model) >= job.total_gpus else None
