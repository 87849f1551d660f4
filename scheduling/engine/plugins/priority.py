from __future__ import annotations

from typing import Any

from scheduling.engine.framework import CycleState, JobView
from scheduling.engine.snapshot import Snapshot


class Priority:
    """QueueSort: the queue's priority first, then the job's own (higher first)."""

    name = "priority"

    def sort_key(self, state: CycleState, snap: Snapshot, job: JobView) -> tuple[Any, ...]:
        return (-state.data["queue_priority"].get(job.queue_id, 0), -job.priority)
