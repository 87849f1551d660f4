"""Pending jobs, grouped into equivalence classes.

Jobs with the same shape (queue, nodes, GPUs and model, cpu, memory, placement constraints) are
interchangeable to every filter, so they form one class: the cycle evaluates a class's filters
once, walks its jobs in order, and gives up on the whole class at the first job that does not fit
(capacity only shrinks within a cycle). Within a class, jobs go by priority, then age.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

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

    def load(self, jobs: Iterable[JobView]) -> None:
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
        self.jobs[job.id] = job
        cls = self.classes.get(job.shape())
        if cls is None:
            cls = self.classes[job.shape()] = JobClass(job.shape())
        insort(cls.jobs, (_order(job), job), key=lambda m: m[0])

    def remove(self, job_id: int) -> None:
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
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
        _, job = cls.jobs.pop(0)
        self.jobs.pop(job.id, None)
        if not cls.jobs:
            self.classes.pop(cls.shape, None)
        return job

    def __len__(self) -> int:
        return len(self.jobs)

    def __iter__(self) -> Iterator[JobClass]:
        return iter(list(self.classes.values()))
