"""Phase 3 of a cycle: decide placements in memory, writing nothing.

Equivalence classes go in queue-sort order; for each class's head job: PreFilter (per-user
limits, array throttles, quota, gang), the class's Filter mask (computed once per class, then
re-checked only on rows that changed), Score, select nodes and exact GPU indices, Reserve, and
assume the placement into the cache. A class that does not fit is given up for the rest of the
cycle (capacity only shrinks, and what limits count only grows, within a cycle), with a sentence
built from the filter masks saying why.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scheduling.choices import PendingReason
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.framework import (
    ANY_MODEL,
    TOPOLOGY_REQUIRED,
    Code,
    CycleState,
    JobView,
    NodeChoice,
    Placement,
    ReservePlugin,
    Shape,
    Status,
)
from scheduling.engine.plugins.backfill import TIMELINES
from scheduling.engine.policies import Profile
from scheduling.engine.queue import ClassOrder, JobClass
from scheduling.engine.snapshot import Snapshot
from scheduling.models import Queue


@dataclass
class Blocked:
    """A class given up for the rest of the cycle, and why (phase 5 tells its jobs)."""

    cls: JobClass
    status: Status


@dataclass
class Decided:
    """What phase 3 decided: placements, blocked classes, and what post-filters did — victims
    to preempt, predicted starts (job id → (epoch seconds, where, reserved)), the reservations
    held at the end of the cycle (job id → (rows, GPUs per row, start)), how many jobs hold a
    reservation and how many were backfilled around one. Unpacks as (placements, blocked)."""

    placements: list[Placement]
    blocked: list[Blocked]
    preemptions: list[Any] = field(default_factory=list)
    estimates: dict[int, tuple[float, str, bool]] = field(default_factory=dict)
    reservations: dict[int, tuple[tuple[int, ...], int, float]] = field(default_factory=dict)
    reserved: int = 0
    backfilled: int = 0

    def __iter__(self) -> Iterator[Any]:
        yield self.placements
        yield self.blocked


# Queue id → (preempt within queue, reclaim within cohort, preemption grace seconds).
Policies = dict[int, tuple[str, str, int]]


def decide(
    profile: Profile,
    cache: SchedulerCache,
    snap: Snapshot,
    epoch: int,
    limit: int,
    queues: dict[int, tuple[int, float, int]] | None = None,
    *,
    now: float | None = None,
    policies: Policies | None = None,
) -> Decided:
    """Decide placements in memory (no writes): ``queues`` maps queue id → (priority,
    fair-share weight, project id) and ``policies`` queue id → its preemption rules; both are
    read from the database when not given. ``now`` (epoch seconds) is the cycle's time: the
    replayer runs cycles in virtual time."""
    state = CycleState(epoch=epoch)
    if queues is None:
        queues = {
            pk: (prio, weight, project)
            for pk, prio, weight, project in Queue.objects.values_list(
                "pk", "priority", "fair_share_weight", "project_id"
            )
        }
    if policies is None:
        policies = {
            pk: (within, reclaim, grace)
            for pk, within, reclaim, grace in Queue.objects.values_list(
                "pk", "preempt_within_queue", "reclaim_within_cohort", "preemption_grace_s"
            )
        }
    state.data["queue_priority"] = {q: v[0] for q, v in queues.items()}
    state.data["queue_project"] = {q: v[2] for q, v in queues.items()}
    weights: dict[int, float] = {}
    for _, weight, project in queues.values():
        weights[project] = max(weights.get(project, 0.0), weight)
    state.data["project_weight"] = weights
    _share_cache(state, cache, snap, profile, now if now is not None else time.time(), policies)
    start = _idle_mark(cache, snap, profile, queues, policies)
    idle = cache.idle_cycle
    if idle is not None and idle[0] is snap and idle[1] == start and state.data["now"] < idle[3]:
        return idle[2]  # nothing changed since a cycle in which every class kept its verdict
    reused = True  # every class so far kept its verdict

    def key(cls: JobClass) -> tuple[Any, ...]:
        head = cls.head
        parts: tuple[Any, ...] = ()
        for plugin in profile.queue_sort:
            parts += plugin.sort_key(state, snap, head)
        return (*parts, head.submitted_at, head.id)

    masks: dict[Shape, tuple[np.ndarray, np.ndarray, int, int]] = {}
    decisions: list[Placement] = []
    if cache.nominated and _nominees_first(profile, state, cache, snap, masks, decisions):
        reused = False
    order = _class_order(profile, state, snap, key)
    for cls in cache.queue:
        order.push(cls)
    blocked: list[Blocked] = []
    aside: list[tuple[JobClass, JobView]] = []  # preemptors set aside so their classmates get a turn
    while order and len(decisions) < limit:
        cls = order.pop()
        if not len(cls):
            continue
        job = cls.head
        # A class found not to fit, with nothing changed since (no placement, release, node
        # change, and the same reservations ahead of it): the same verdict, without looking
        # again — and the same reservation and estimate, replayed.
        mark = (len(snap.changed), state.data["signature"], cache.runs_version)
        verdict = cache.verdicts.get(cls.shape)
        if verdict is not None and verdict[0] is snap and verdict[1] == mark:
            for effect in verdict[3]:
                effect(state)
            if verdict[3]:
                state.data["signature"] = hash((state.data["signature"], job.id))
            blocked.append(Blocked(cls, verdict[2]))
            continue
        reused = False
        placement, status, tried = _place(profile, state, snap, job, masks)
        if placement is not None:
            status = _reserve(profile, state, snap, placement)
        if status is not None:
            state.data["why"] = status
            preempting = len(state.data.get("preemptions", ()))
            # A limit is not a shortage: no room is made or held for a job its limits refuse. Nor,
            # yet, for a job taking less than whole GPUs: preemption and reservations count whole
            # GPUs (docs/scheduling-policies.md says so).
            effects = (
                _post_filter(profile, state, snap, tried)
                if status.code != Code.UNRESOLVABLE and not job.fractional
                else []
            )
            if effects:
                state.data["signature"] = hash((state.data["signature"], job.id))
            status = _with_words(status, state.data.pop("post_words", ""))
            preempted = len(state.data.get("preemptions", ())) > preempting
            if len(cls) > 1 and preempted:
                # It preempted: the next job of its class may too (each preempts for itself).
                aside.append((cls, cache.queue.pop_head(cls)))
                if len(cls):
                    order.push(cls)
                continue
            cache.verdicts[cls.shape] = (snap, mark, status, effects)
            blocked.append(Blocked(cls, status))
            continue
        assert placement is not None
        cache.queue.pop_head(cls)
        _assume(cache, state, placement, decisions)
        if len(cls):
            order.push(cls)
    for _, job in aside:  # back in line, for the next cycle
        cache.queue.upsert(job)
    cycle = state.data.get("backfill")
    decided = Decided(
        decisions,
        blocked,
        preemptions=state.data.get("preemptions", []),
        estimates=state.data.get("estimates", {}),
        reservations=(
            {job: (r.rows, r.gpus, r.start) for job, r in cycle.book.by_job.items()}
            if cycle is not None
            else {}
        ),
        reserved=cycle.reserved if cycle is not None else 0,
        backfilled=cycle.backfilled if cycle is not None else 0,
    )
    # A cycle in which every class kept its verdict, placing and preempting nothing, changed
    # nothing it started from: the next one starting from the same would replay the same
    # verdicts in the same order, so it is kept whole and returned as it is (a fleet that is
    # full, or a queue that fits nowhere, costs one comparison a cycle instead of a replay of
    # every class).
    still = reused and not decisions and not aside and not decided.preemptions
    if still and _idle_mark(cache, snap, profile, queues, policies) == start:
        # GPUs held for a preemptor lapse at a time (a cycle that is not kept lets them go); a
        # hold whose start has passed is reported from the cycle that was kept.
        until = min((n.until for n in cache.nominated.values()), default=float("inf"))
        cache.idle_cycle = (snap, start, decided, until)
    else:
        cache.idle_cycle = None
    return decided


def _idle_mark(
    cache: SchedulerCache, snap: Snapshot, profile: Profile, queues: dict[int, Any], policies: Policies
) -> tuple[Any, ...]:
    """What a cycle's verdicts rest on besides the snapshot itself: its changes, the running
    jobs, what is pending, the quota claims, the GPUs held for preemptors, the queues' settings
    and the profile."""
    return (
        len(snap.changed),
        cache.runs_version,
        cache.queue.version,
        len(cache.claims),
        len(cache.verdicts),
        sorted(cache.nominated.items()),
        id(profile),
        sorted(queues.items()),
        sorted(policies.items()),
    )


def _nominees_first(
    profile: Profile,
    state: CycleState,
    cache: SchedulerCache,
    snap: Snapshot,
    masks: dict[Shape, tuple[np.ndarray, np.ndarray, int, int]],
    decisions: list[Placement],
) -> bool:
    """Preemptors whose victims have all stopped are placed before the queue is walked: the GPUs
    held for them are theirs, wherever they sort in their class (a classmate ahead of them is
    kept off those GPUs and would give the class up). Returns whether there were any."""
    ready = [
        cache.queue.jobs[job_id]
        for job_id, nomination in cache.nominated.items()
        if job_id in cache.queue.jobs and not any(v in cache.runs for v in nomination.victims)
    ]
    for job in sorted(ready, key=lambda j: (-j.priority, j.submitted_at, j.id)):
        placement, _, _ = _place(profile, state, snap, job, masks)
        if placement is None or _reserve(profile, state, snap, placement) is not None:
            continue
        cache.queue.remove(job.id)
        _assume(cache, state, placement, decisions)
    return bool(ready)


def _assume(
    cache: SchedulerCache, state: CycleState, placement: Placement, decisions: list[Placement]
) -> None:
    """Count a decision in the cache at once (later decisions of the cycle see it) and keep it."""
    job = placement.job
    cache.assume(job, placement.nodes, job.queue_id, now=state.data["now"])
    state.data["runs_version"] = cache.runs_version
    decisions.append(placement)


def _share_cache(
    state: CycleState, cache: SchedulerCache, snap: Snapshot, profile: Profile, now: float, policies: Policies
) -> None:
    """What plugins may read of the cache, through the cycle state (they never see the cache)."""
    state.data["now"] = now
    state.data["runs"] = cache.runs
    state.data["runs_version"] = cache.runs_version
    state.data["ratios"] = cache.ratios
    state.data["nominated"] = cache.nominated
    state.data["queue_policy"] = policies
    state.data["signature"] = 0
    state.data["changed_rows"] = []
    state.data[TIMELINES] = cache.carry
    pending = cache.queue.jobs
    gone = [j for j in cache.claims if j not in pending]
    for job_id in gone:
        del cache.claims[job_id]
    if gone:  # quota claimed back is free to borrow again: verdicts that refused it no longer hold
        cache.verdicts.clear()
    state.data["claims"] = cache.claims

    def bump() -> None:
        cache.runs_version += 1
        state.data["runs_version"] = cache.runs_version

    state.data["runs_version_bump"] = bump
    state.data["static_mask"] = lambda job: static_mask(profile, state, snap, job)
    state.data["node_masks"] = cache.node_masks(snap)


class _KeyHeap:
    """Classes in the order of ``key(cls)``, one heap, re-keyed lazily: a class whose key went
    stale (a placement raised its project's share) goes back in line if another now comes first.
    For profiles whose queue sort ``ClassOrder`` cannot split."""

    def __init__(self, key: Callable[[JobClass], tuple[Any, ...]]) -> None:
        self._key = key
        self._heap: list[tuple[tuple[Any, ...], int, JobClass]] = []
        self._count = 0

    def push(self, cls: JobClass) -> None:
        self._count += 1
        heapq.heappush(self._heap, (self._key(cls), self._count, cls))

    def pop(self) -> JobClass:
        heap = self._heap
        while True:
            stale, _, cls = heapq.heappop(heap)
            fresh = self._key(cls) if len(cls) else stale
            if not heap or fresh == stale or fresh <= heap[0][0]:
                return cls
            self._count += 1
            heapq.heappush(heap, (fresh, self._count, cls))

    def __bool__(self) -> bool:
        return bool(self._heap)


def _class_order(
    profile: Profile, state: CycleState, snap: Snapshot, key: Callable[[JobClass], tuple[Any, ...]]
) -> ClassOrder | _KeyHeap:
    """Projects first (``ClassOrder``) when the queue sort has fair share (the only part of a key
    that moves within a cycle); one lazily re-keyed heap otherwise."""
    plugins = profile.queue_sort
    at = next((i for i, p in enumerate(plugins) if p.name == "fair_share" and hasattr(p, "share")), None)
    if at is None:
        return _KeyHeap(key)
    before, fair, after = plugins[:at], plugins[at], plugins[at + 1 :]

    def tier(head: JobView) -> tuple[Any, ...]:
        parts: tuple[Any, ...] = ()
        for plugin in before:
            parts += plugin.sort_key(state, snap, head)
        return parts

    def rest(head: JobView) -> tuple[Any, ...]:
        parts: tuple[Any, ...] = ()
        for plugin in after:
            parts += plugin.sort_key(state, snap, head)
        return (*parts, head.submitted_at, head.id)

    return ClassOrder(tier, lambda project: fair.share(state, snap, project), rest)


def _place(
    profile: Profile,
    state: CycleState,
    snap: Snapshot,
    job: JobView,
    masks: dict[Shape, tuple[np.ndarray, np.ndarray, int, int]],
) -> tuple[Placement | None, Status | None, JobView]:
    """Try the job — an any-model job once per model it accepts, best first (Kueue's flavor
    fungibility) — and return (placement, None, the view placed) or (None, why not, the view
    the post-filters should work on: the first model whose quota admits it)."""
    views = [job.as_model(m) for m in job.models] if job.model == ANY_MODEL else [job]
    first: tuple[Status, JobView] | None = None
    for view in views:
        status = next((s for p in profile.pre_filter if not (s := p.pre_filter(state, snap, view)).ok), None)
        if status is None:
            mask = _class_mask(profile, state, snap, view, masks)
            placement = select(profile, state, snap, view, mask)
            if placement is not None:
                return placement, None, view
            status = _why(profile, state, snap, view)
            if first is None or first[0].reason == PendingReason.QUOTA_EXCEEDED:
                first = (status, view)
        elif first is None:
            first = (status, view)
    if first is None:
        return None, Status(Code.UNSCHEDULABLE, PendingReason.RESOURCES, "it accepts no GPU model here"), job
    return None, first[0], first[1]


def _post_filter(profile: Profile, state: CycleState, snap: Snapshot, job: JobView) -> list[Any]:
    """Run the post-filters (preemption, backfill's reservations) for a job that cannot be
    placed now; returns what they did as effects a later cycle may replay."""
    state.data["effects"] = []
    state.data["blocked_by"] = getattr(state.data.get("why"), "reason", "")
    words = []
    for plugin in profile.post_filter:
        status = plugin.post_filter(state, snap, job)
        if status.message:
            words.append(status.message)
    state.data["post_words"] = "; ".join(words)
    return state.data.pop("effects")


def _with_words(status: Status, words: str) -> Status:
    if not words:
        return status
    return Status(status.code, status.reason, f"{status.message}; {words}"[:500])


def static_mask(profile: Profile, state: CycleState, snap: Snapshot, job: JobView) -> np.ndarray:
    """The rows that could take ``job`` once enough of their GPUs are free: every filter that
    does not depend on free capacity, and enough healthy GPUs in all."""
    rows = snap.all_rows
    if job.slice >= 0:
        mask = snap.mig_total[:, job.slice] >= job.gpus
    elif job.shared:
        mask = snap.share_cap >= snap.share_need(job, rows)
    else:
        mask = snap.gpu_total >= job.gpus
    mask &= node_mask(profile, state, snap, job)
    return mask


def node_mask(profile: Profile, state: CycleState, snap: Snapshot, job: JobView) -> np.ndarray:
    """The class's mask of the filters that depend only on what a node is (not ``capacity``),
    kept between cycles for the snapshot: only rows changed since it was last checked (readiness,
    health, MIG layout — and placements, which these filters ignore but the log does not tell
    apart) are checked again. Read it, never write it."""
    store = state.data.get("node_masks")
    if store is None:  # a cycle state not made by decide (a plugin's own test)
        store = state.data["node_masks"] = {}
    node_filters, _ = _filters(profile, state)
    shape = job.shape()
    kept = store.get(shape)
    if kept is None or kept[0] is not profile:
        mask = _passing(node_filters, state, snap, job, snap.all_rows)
    else:
        _, mask, seen = kept
        if seen < len(snap.changed):
            rows = _distinct(_tail(state, "snapshot", snap.changed, seen))
            mask[rows] = _passing(node_filters, state, snap, job, rows)
    store[shape] = (profile, mask, len(snap.changed))
    return mask


def _tail(state: CycleState, name: str, log: list[int], start: int) -> np.ndarray:
    """``log[start:]`` as an array (a view: never write it). A change log only grows, and every
    class reads its own tail of it about once a placement; converting that tail from Python
    each time cost more than the check it feeds. Entries are converted once a cycle, into a
    buffer kept in the cycle's state under ``name`` that covers the log from the earliest start
    asked (a new log object, or an earlier start, makes a new buffer)."""
    key = f"log:{name}"
    kept = state.data.get(key)
    if kept is None or kept[0] is not log or start < kept[2]:
        kept = (log, np.empty(max(256, 2 * (len(log) - start)), dtype=np.int64), start, start)
    _, buffer, base, filled = kept
    if filled < len(log):
        if len(log) - base > len(buffer):
            grown = np.empty(2 * (len(log) - base), dtype=np.int64)
            grown[: filled - base] = buffer[: filled - base]
            buffer = grown
        buffer[filled - base : len(log) - base] = log[filled:]
        filled = len(log)
    state.data[key] = (log, buffer, base, filled)
    return buffer[start - base : filled - base]


def _distinct(rows: np.ndarray) -> np.ndarray:
    """The distinct rows of a change log's stretch, ascending (a new array). Sorted and compared
    with the neighbour: 3–4× faster than ``np.unique`` (which hashes) on the hundreds of rows a
    class finds changed since it last came up, and this runs about once a placement."""
    if len(rows) < 2:
        return rows.copy()
    out = np.sort(rows)
    keep = np.empty(len(out), dtype=bool)
    keep[0] = True
    np.not_equal(out[1:], out[:-1], out=keep[1:])
    return out[keep]


def _filters(profile: Profile, state: CycleState) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The profile's filters split once a cycle: (node filters, ``capacity`` filters)."""
    split = state.data.get("filters")
    if split is None or split[0] is not profile:
        capacity = tuple(p for p in profile.filter if getattr(p, "capacity", False))
        node = tuple(p for p in profile.filter if not getattr(p, "capacity", False))
        split = state.data["filters"] = (profile, node, capacity)
    return split[1], split[2]


def _passing(
    filters: tuple[Any, ...], state: CycleState, snap: Snapshot, job: JobView, rows: np.ndarray
) -> np.ndarray:
    """True over ``rows`` where every one of ``filters`` lets the job in."""
    ok = np.ones(len(rows), dtype=bool)
    for plugin in filters:
        ok &= plugin.filter(state, snap, job, rows)
    return ok


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
    masks: dict[Shape, tuple[np.ndarray, np.ndarray, int, int]],
) -> np.ndarray:
    """The class's filter mask over all rows: its node mask (kept between cycles) and, on the rows
    that pass it, the ``capacity`` filters — computed once a cycle, then checked again only on
    rows changed since (by placements of this cycle, or by reservations). Within a cycle nothing
    but capacity changes, so the node filters are not asked again."""
    shape = job.shape()
    cached = masks.get(shape)
    extra: list[int] = state.data["changed_rows"]
    _, capacity = _filters(profile, state)
    if cached is None:
        static = node_mask(profile, state, snap, job)
        mask = static.copy()
        if capacity:
            rows = np.flatnonzero(static)
            mask[rows] = _passing(capacity, state, snap, job, rows)
    else:
        mask, static, seen, seen_extra = cached
        if capacity and (seen < len(snap.changed) or seen_extra < len(extra)):
            rows = _distinct(
                np.concatenate(
                    (
                        _tail(state, "snapshot", snap.changed, seen),
                        _tail(state, "reserved", extra, seen_extra),
                    )
                )
            )
            rows = rows[static[rows]]
            if len(rows):
                mask[rows] = _passing(capacity, state, snap, job, rows)
    masks[shape] = (mask, static, len(snap.changed), len(extra))
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
        chosen = _gang(snap, job, rows, scores)
        if not chosen:
            return None
    nodes = tuple(_choose(snap, job, row) for row in chosen)
    return Placement(job, int(snap.cluster[chosen[0]]), nodes)


def _gang(snap: Snapshot, job: JobView, rows: np.ndarray, scores: np.ndarray) -> list[int]:
    """The best ``job.nodes`` rows of one cluster, by total score — under one switch or rack
    when the job asks for topology and some block holds enough (``required``: only then)."""
    groups = snap.cluster[rows].astype(np.int64)
    if job.topology:
        blocks = snap.block[rows].astype(np.int64)
        in_block = blocks >= 0
        found = _best_group(
            groups[in_block] * (len(snap.block_names) + 1) + blocks[in_block], job.nodes, scores[in_block]
        )
        if found:
            return [int(r) for r in rows[in_block][found]]
        if job.topology == TOPOLOGY_REQUIRED:
            return []
    found = _best_group(groups, job.nodes, scores)
    return [int(r) for r in rows[found]] if found else []


def _best_group(groups: np.ndarray, size: int, scores: np.ndarray) -> list[int]:
    """Positions of the ``size`` best-scoring members of the group whose best ``size`` score
    highest in total; [] when no group has ``size`` members."""
    best: list[int] = []
    best_total = -np.inf
    for group in np.unique(groups):
        members = np.flatnonzero(groups == group)
        if len(members) < size:
            continue
        top = members[np.argsort(-scores[members], kind="stable")[:size]]
        total = float(scores[top].sum())
        if total > best_total:
            best_total, best = total, [int(t) for t in top]
    return best


def _choose(snap: Snapshot, job: JobView, row: int) -> NodeChoice:
    """What the job takes on one chosen node: exact GPU indices, MIG instances or a fraction."""
    if job.slice >= 0:
        picked = snap.choose_instances(row, job.slice, job.gpus)
        return NodeChoice(row, tuple(gpu for _, gpu in picked), tuple(inst for inst, _ in picked))
    if job.shared:
        need = int(snap.share_need(job, np.array([row]))[0])
        index = snap.choose_share(row, need)
        assert index is not None  # the filter saw it fit
        return NodeChoice(row, (index,), share_mb=need)
    return NodeChoice(row, snap.choose_gpus(row, job.gpus))


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
    per_cluster = np.bincount(snap.cluster[remaining], minlength=1) if fit else np.zeros(1)
    if fit and job.nodes > 1 and job.topology == TOPOLOGY_REQUIRED and per_cluster.max() >= job.nodes:
        message = (
            f"{fit:,}/{len(rows):,} nodes fit, not {job.nodes} under one switch or rack "
            "(it waits for topology: placement.topology is required)"
        )
    elif fit and job.nodes > 1:
        message = f"{fit:,}/{len(rows):,} nodes fit, not {job.nodes} in one cluster"
    else:
        message = f"{fit:,}/{len(rows):,} nodes fit" + (": " + ", ".join(parts) if parts else "")
    reason = PendingReason.RESOURCES
    if stopped_by and set(stopped_by) <= {"node_state", "cluster_affinity"}:
        reason = PendingReason.CLUSTER_UNAVAILABLE
    return Status(Code.UNSCHEDULABLE, reason, message)
