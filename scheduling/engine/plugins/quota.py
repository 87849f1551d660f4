from __future__ import annotations

from scheduling.choices import PendingReason
from scheduling.engine.framework import OK, Code, CycleState, JobView, Placement, Status
from scheduling.engine.snapshot import Snapshot


class Quota:
    """PreFilter + Reserve: the job's GPUs fit its queue's quota of that model, counting what the
    queue may borrow from idle quota of its cohort (``QuotaBook.headroom``); placing the job
    charges the queue at once, so later jobs of the same cycle see it."""

    name = "quota"

    def pre_filter(self, state: CycleState, snap: Snapshot, job: JobView) -> Status:
        if not job.total_gpus or job.model < 0:
            return OK
        if snap.quota.headroom(job.queue_id, job.model) >= job.total_gpus:
            return OK
        queue = snap.queue_names.get(job.queue_id, str(job.queue_id))
        words = snap.quota.describe(queue, job.queue_id, job.model, snap.model_names[job.model])
        return Status(
            Code.UNSCHEDULABLE, PendingReason.QUOTA_EXCEEDED, f"{words}; this job needs {job.total_gpus}"
        )

    def reserve(self, state: CycleState, snap: Snapshot, placement: Placement) -> Status:
        return OK  # the cache charges the queue when it assumes the placement

    def unreserve(self, state: CycleState, snap: Snapshot, placement: Placement) -> None:
        return None
