"""Events the scheduling app publishes (past tense, frozen)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class JobStateChanged:
    job_id: int
    project_id: int
    from_state: str
    to_state: str
    reason: str
    at: str


@dataclass(frozen=True)
class JobsSubmitted:
    """New jobs in a project: the first hundred ids and how many in all (a batch may be large)."""

    project_id: int
    job_ids: list[int]
    count: int


@dataclass(frozen=True)
class JobsScheduled:
    """Jobs of a project placed by one cycle: the first hundred ids and how many in all."""

    project_id: int
    job_ids: list[int]
    count: int
    epoch: int


@dataclass(frozen=True)
class JobsChanged:
    """Many jobs of a project moved from one state to another at once."""

    project_id: int
    job_ids: list[int]
    count: int
    from_state: str
    to_state: str


def job_groups(job_id: int, project_id: int) -> list[str]:
    """The channel-layer groups that hear about a job: its own page and its project's lists."""
    return [f"job.{job_id}", f"project.{project_id}"]
