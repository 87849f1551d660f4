"""Pending jobs, grouped into equivalence classes.

Jobs with the same shape (queue, nodes, GPUs and model, cpu, memory, placement constraints) are
interchangeable to every filter, so they form one class: the cycle evaluates a class's filters
once, walks its jobs in order, and gives up on the whole class at the first job that does not fit
(capacity only shrinks within a cycle). Within a class, jobs go by priority, then age.
"""

from __future__ import annotations

import heapq
from bisect import insort
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from scheduling.engine.framework import JobView, Shape


def _order(job: JobView) -> tuple[int, float, int]:
    return (-job.priority, job.submitted_at, job.id)


@dataclass
class JobClass:
    shape: Shape
    jobs: list[tuple[tuple[int, float, int], JobView]] = field(default_factory=list)

    @property
    def head(self) -> JobView:
        return self.jobs[0][1]

    def __len__(self) -> int:
        return len(self.jobs)


class PendingQueue:
    def __init__(self) -> None:
        self.classes: dict[Shape, JobClass] = {}
        self.jobs: dict[int, JobView] = {}
        self.version = 0  # moves with every change to what is pending (decide keeps idle cycles by it)

    def load(self, jobs: Iterable[JobView]) -> None:
        self.version += 1
        grouped: dict[Shape, list[tuple[tuple[int, float, int], JobView]]] = {}
        for job in jobs:
            self.jobs[job.id] = job
            grouped.setdefault(job.shape(), []).append((_order(job), job))
        for shape, members in grouped.items():
            members.sort(key=lambda m: m[0])
            self.classes[shape] = JobClass(shape, members)

    def upsert(self, job: JobView) -> None:
        old = self.jobs.get(job.id)
        if old is not None:
            if old == job:
                return
            self.remove(job.id)
        self.version += 1
        self.jobs[job.id] = job
        cls = self.classes.get(job.shape())
        if cls is None:
            cls = self.classes[job.shape()] = JobClass(job.shape())
        insort(cls.jobs, (_order(job), job), key=lambda m: m[0])

    def remove(self, job_id: int) -> None:
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
        self.version += 1
        cls = self.classes.get(job.shape())
        if cls is None:
            return
        if cls.jobs[0][1].id == job_id:
            cls.jobs.pop(0)
        else:
            cls.jobs = [m for m in cls.jobs if m[1].id != job_id]
        if not cls.jobs:
            del self.classes[cls.shape]

    def pop_head(self, cls: JobClass) -> JobView:
        self.version += 1
        _, job = cls.jobs.pop(0)
        self.jobs.pop(job.id, None)
        if not cls.jobs:
            self.classes.pop(cls.shape, None)
        return job

    def __len__(self) -> int:
        return len(self.jobs)

    def __iter__(self) -> Iterator[JobClass]:
        return iter(list(self.classes.values()))


class ClassOrder:
    """A cycle's classes in queue-sort order, projects first: ``key(head)`` is ``(*tier, share of
    the head's project, *rest)``, where the tier (priorities) and the rest (age, id) depend on
    the head alone and only the share moves within a cycle — each placement raises its project's.

    One heap holds each (tier, project) keyed by the project's share and its first class's rest;
    under it, a heap of the project's classes of that tier, keyed by the rest. A placement makes
    one entry stale (its project's) instead of every class of the project. Entries are re-keyed
    when they come to the top, which is exact while keys only grow (a share rises, a popped class
    gives way to a later one); a pushed class that comes before its project's first replaces the
    entry with a new one, and the old is dropped when it reaches the top. So the order is the one
    a single heap of fresh keys would give, with about one re-key per placement."""

    def __init__(
        self,
        tier: Callable[[JobView], tuple[Any, ...]],
        share: Callable[[int], float],
        rest: Callable[[JobView], tuple[Any, ...]],
    ) -> None:
        self._tier, self._share, self._rest = tier, share, rest
        # (tier, share, rest of the first class, project); one live entry per (tier, project)
        self._projects: list[tuple[tuple[Any, ...], float, tuple[Any, ...], int]] = []
        self._live: dict[tuple[tuple[Any, ...], int], tuple[float, tuple[Any, ...]]] = {}
        self._classes: dict[tuple[tuple[Any, ...], int], list[tuple[tuple[Any, ...], int, JobClass]]] = {}
        self._count = 0

    def push(self, cls: JobClass) -> None:
        head = cls.head
        tier, project, rest = self._tier(head), head.project_id, self._rest(head)
        group = (tier, project)
        self._count += 1
        classes = self._classes.setdefault(group, [])
        if not classes or rest < classes[0][0]:  # a new first class: a new entry, the old one dead
            key = self._live[group] = (self._share(project), rest)
            heapq.heappush(self._projects, (tier, *key, project))
        heapq.heappush(classes, (rest, self._count, cls))

    def pop(self) -> JobClass:
        """The first class; IndexError when none is left."""
        projects, live, by_project = self._projects, self._live, self._classes
        while True:
            tier, share, rest, project = projects[0]
            group = (tier, project)
            if live.get(group) != (share, rest):
                heapq.heappop(projects)  # dead: replaced by a newer entry, or its classes gone
                continue
            classes = by_project[group]
            fresh = (self._share(project), classes[0][0])
            if fresh == (share, rest):
                break
            live[group] = fresh
            heapq.heapreplace(projects, (tier, *fresh, project))
        cls = heapq.heappop(classes)[2]
        if not classes:
            heapq.heappop(projects)
            del by_project[group], live[group]
        return cls

    def __bool__(self) -> bool:
        return bool(self._classes)
