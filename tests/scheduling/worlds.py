"""In-memory worlds for the scheduler's decision phase: a snapshot, a cache with jobs running on
it (each a ``Run`` with its start and time limit, counted with ``cache.assume``) and jobs waiting,
decided at ``NOW`` with queue rules given, so no database is touched.

    world = world_of(snapshot(node(gpus=8)), running=[(view(1000, 4, limit=600), NOW - 60)],
                     pending=[view(1, 8)], policies={1: WITHIN_QUEUE})
    decided = world.decide()
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scheduling.choices import PreemptWithinQueue, ReclaimWithinCohort
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle.decide import Decided, decide
from scheduling.engine.framework import ANY_MODEL, NEVER, JobView, NodeChoice
from scheduling.engine.policies import DEFAULT_PROFILE, Profile, build_profile
from scheduling.engine.queue import PendingQueue
from scheduling.engine.snapshot import Snapshot

PROFILE = build_profile(DEFAULT_PROFILE)
NOW = 100_000.0
QUEUES = {1: (0, 1.0, 1), 2: (0, 1.0, 2), 3: (0, 1.0, 3)}  # queue → (priority, weight, project)
COHORT = {1: "c", 2: "c"}  # queue 3 has no cohort and no quota
NEVER_PREEMPT = (PreemptWithinQueue.NEVER, ReclaimWithinCohort.NEVER, 30)
WITHIN_QUEUE = (PreemptWithinQueue.LOWER_PRIORITY, ReclaimWithinCohort.NEVER, 30)


def view(
    job_id: int,
    gpus: int,
    *,
    queue: int = 1,
    priority: int = 0,
    limit: float = NEVER,
    nodes: int = 1,
    model: int = 0,
    models: tuple[int, ...] = (),
    preemptible: bool = True,
    submitted: float | None = None,
) -> JobView:
    return JobView(
        id=job_id,
        queue_id=queue,
        project_id=queue,
        priority=priority,
        submitted_at=float(job_id) if submitted is None else submitted,
        nodes=nodes,
        gpus=gpus,
        model=ANY_MODEL if models else model,
        models=models,
        cpu=0,
        memory=0,
        time_limit=limit,
        preemptible=preemptible,
    )


@dataclass
class World:
    snap: Snapshot
    cache: SchedulerCache
    pending: dict[int, JobView]
    running: dict[int, JobView]
    policies: dict[int, tuple[str, str, int]]
    draining: set[int] = field(default_factory=set)  # running jobs already preempted before the cycle
    told: str = ""  # the world as it was generated, before any cycle

    def describe(self) -> str:
        """The fleet, the quotas, the running jobs and the waiting ones (how a failing example reads)."""
        snap, quota = self.snap, self.snap.quota
        lines = [
            f"row {r}: cluster {snap.cluster[r]}, model {snap.model[r]}, {snap.gpu_total[r]} GPUs"
            for r in range(len(snap))
        ]
        lines.append(f"quota {quota.nominal}, borrowing limits {quota.borrowing_limit}, used {quota.used}")
        lines.append(f"policies {self.policies}")
        for job_id in self.running:
            run = self.cache.runs[job_id]
            lines.append(
                f"running {job_id}: queue {run.queue}, priority {run.priority}, model {run.model}, "
                f"rows {run.rows}, started {run.start - NOW:+.0f} s, limit {run.limit}, "
                f"preemptible {run.preemptible}, checkpoint {run.checkpoint or None}, "
                f"draining {run.draining_until}"
            )
        for v in self.pending.values():
            lines.append(
                f"pending {v.id}: queue {v.queue_id}, priority {v.priority}, {v.nodes}×{v.gpus} GPUs of "
                f"{v.models or v.model}, limit {v.time_limit}"
            )
        return "\n".join(lines)

    def decide(self, profile: Profile = PROFILE, now: float = NOW) -> Decided:
        return decide(
            profile, self.cache, self.snap, 1, 10_000, queues=QUEUES, now=now, policies=self.policies
        )

    def submit(self, *views: JobView) -> None:
        for v in views:
            self.pending[v.id] = v
            self.cache.queue.upsert(v)

    def start(self, job: JobView, at: float, rows: Iterable[int] | None = None) -> None:
        """``job`` running since ``at`` on ``rows`` (default: where it first fits)."""
        snap = self.snap
        rows = first_fit(snap, job) if rows is None else list(rows)
        assert rows is not None, f"job {job.id} fits nowhere"
        self.cache.assume(
            job, [NodeChoice(r, snap.choose_gpus(r, job.gpus)) for r in rows], job.queue_id, now=at
        )
        self.running[job.id] = job

    def stop(self, *job_ids: int) -> None:
        """These jobs ended: their GPUs come back."""
        for job_id in job_ids:
            self.cache._release(job_id)


def world_of(
    snap: Snapshot,
    running: list[tuple[JobView, float]] = (),
    pending: list[JobView] = (),
    policies: dict[int, tuple[str, str, int]] | None = None,
) -> World:
    """A cache over ``snap`` with ``running`` jobs (view, start) placed where they fit (first rows
    of the first cluster with enough free GPUs of their model) and ``pending`` jobs waiting."""
    cache = SchedulerCache()
    cache.snap = snap
    cache.queue = PendingQueue()
    cache.queue.load(pending)
    world = World(snap, cache, {v.id: v for v in pending}, {}, policies or {})
    for v, start in running:
        if first_fit(snap, v) is not None:
            world.start(v, start)
    return world


def first_fit(snap: Snapshot, v: JobView) -> list[int] | None:
    ok = (snap.model == v.model) & (snap.gpu_free >= v.gpus) & snap.ready
    for cluster in range(len(snap.cluster_ids)):
        rows = np.flatnonzero(ok & (snap.cluster == cluster))
        if len(rows) >= v.nodes:
            return [int(r) for r in rows[: v.nodes]]
    return None


def end_of(run: Any) -> float:
    """When a job gives its GPUs back at the latest: its time limit, or its grace period's end."""
    return min(run.start + run.limit, NEVER if run.draining_until is None else run.draining_until)


def free_at(world: World, row: int, when: float) -> int:
    """GPUs free on ``row`` at ``when``: free now, plus what every job holding GPUs (those running
    before the cycle and those it placed) has given back by then."""
    released = sum(
        g for run in world.cache.runs.values() if end_of(run) <= when for r, g in run.rows if r == row
    )
    return int(world.snap.gpu_free[row]) + released
