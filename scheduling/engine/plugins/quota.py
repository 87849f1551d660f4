from __future__ import annotations

from scheduling.choices import PendingReason
from scheduling.engine.framework import OK, Code, CycleState, JobView, Placement, Status
from scheduling.engine.snapshot import QuotaBook, Snapshot


class Quota:
    """PreFilter + Reserve + PostFilter: the job's GPUs fit its queue's quota of that model,
    counting what the queue may borrow from idle quota of its cohort (``QuotaBook.headroom``);
    placing the job charges the queue at once, so later jobs of the same cycle see it.

    Lent quota comes back before anyone borrows more: a job that cannot be placed while its
    queue is within its nominal quota *claims* what it needs (``post_filter``), and until it is
    placed no job of another queue of the cohort may borrow that part — in this cycle and the
    next ones, whatever order the queues sort in."""

    name = "quota"

    def pre_filter(self, state: CycleState, snap: Snapshot, job: JobView) -> Status:
        if not job.total_gpus or job.model < 0:
            return OK
        book = snap.quota
        headroom = book.headroom(job.queue_id, job.model)
        key = (job.queue_id, job.model)
        if book.used.get(key, 0) + job.total_gpus > book.nominal.get(key, 0):  # it would borrow
            headroom -= _claimed_by_others(state, book, job)
        if headroom >= job.total_gpus:
            return OK
        queue = snap.queue_names.get(job.queue_id, str(job.queue_id))
        words = book.describe(queue, job.queue_id, job.model, snap.model_names[job.model])
        return Status(
            Code.UNSCHEDULABLE, PendingReason.QUOTA_EXCEEDED, f"{words}; this job needs {job.total_gpus}"
        )

    def reserve(self, state: CycleState, snap: Snapshot, placement: Placement) -> Status:
        return OK  # the cache charges the queue when it assumes the placement

    def unreserve(self, state: CycleState, snap: Snapshot, placement: Placement) -> None:
        return None

    def post_filter(self, state: CycleState, snap: Snapshot, job: JobView) -> Status:
        book = snap.quota
        if not job.total_gpus or job.model < 0 or not book.cohort_of.get(job.queue_id):
            return OK
        key = (job.queue_id, job.model)
        if job.queue_id in book.limited and book.used.get(key, 0) + job.total_gpus <= book.nominal.get(
            key, 0
        ):
            state.data["claims"][job.id] = (job.queue_id, job.model, job.total_gpus)
        return OK


def _claimed_by_others(state: CycleState, book: QuotaBook, job: JobView) -> int:
    cohort = book.cohort_of.get(job.queue_id)
    if not cohort:
        return 0
    return sum(
        gpus
        for queue, model, gpus in state.data.get("claims", {}).values()
        if queue != job.queue_id and model == job.model and book.cohort_of.get(queue) == cohort
    )
