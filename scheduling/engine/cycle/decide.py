"""Phase 3 of a cycle: decide placements in memory, writing nothing.

Equivalence classes go in queue-sort order; for each class's head job: PreFilter (quota, gang),
the class's Filter mask (computed once per class, then re-checked only on rows that changed),
Score, select nodes and exact GPU indices, Reserve, and assume the placement into the cache. A
class that does not fit is given up for the rest of the cycle (capacity only shrinks within a
cycle), with a sentence built from the filter masks saying why.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduling.choices import PendingReason
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.framework import (
    Code,
    CycleState,
    JobView,
    NodeChoice,
    Placement,
    ReservePlugin,
    Shape,
    Status,
)
from scheduling.engine.policies import Profile
from scheduling.engine.queue import JobClass
from scheduling.engine.snapshot import Snapshot
from scheduling.models import Queue


@dataclass
class Blocked:
    """A class given up for the rest of the cycle, and why (phase 5 tells its jobs)."""

    cls: JobClass
    status: Status


def decide(
    profile: Profile,
    cache: SchedulerCache,
    snap: Snapshot,
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
    masks: dict[Shape, tuple[np.ndarray, int]] = {}
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


def _reserve(profile: Profile, state: CycleState, snap: Snapshot, placement: Placement) -> Status | None:
    """Run every Reserve plugin; if one refuses, undo the ones before it and say why."""
    done: list[ReservePlugin] = []
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
    snap: Snapshot,
    job: JobView,
    masks: dict[Shape, tuple[np.ndarray, int]],
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
    profile: Profile, state: CycleState, snap: Snapshot, job: JobView, mask: np.ndarray
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


def _why(profile: Profile, state: CycleState, snap: Snapshot, job: JobView) -> Status:
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
