from __future__ import annotations

from scheduling.choices import PendingReason
from scheduling.engine.framework import OK, Code, CycleState, JobView, Status
from scheduling.engine.snapshot import Snapshot


class UserLimits:
    """PreFilter: a queue's per-user limits (Slurm's ``MaxJobsPU`` and ``MaxTRESPU=gres/gpu``).
    A job waits while its owner already runs ``Queue.max_running_jobs_per_user`` jobs in its
    queue, or while the GPUs its owner holds there plus its own would pass
    ``Queue.max_gpus_per_user``. Every job holding resources counts (``LimitBook``), the ones
    placed earlier in the same cycle included.

    A limit is not a shortage: the refusal is ``UNRESOLVABLE``, so the job preempts nobody,
    holds no reservation and claims no quota. Jobs of a queue without limits skip the plugin at
    once (``JobView.per_user``)."""

    name = "user_limits"

    def pre_filter(self, state: CycleState, snap: Snapshot, job: JobView) -> Status:
        if not job.per_user:
            return OK
        book = snap.limits
        key = (job.queue_id, job.owner)
        most = book.max_jobs.get(job.queue_id)
        if most is not None and book.jobs.get(key, 0) >= most:
            return Status(
                Code.UNRESOLVABLE,
                PendingReason.MAX_JOBS_PER_USER,
                f"{book.owner_name(job.owner)} has {book.jobs.get(key, 0)}/{most} running jobs "
                f"in {_queue(snap, job)}",
            )
        most = book.max_gpus.get(job.queue_id)
        held = book.gpus.get(key, 0)
        if most is not None and job.total_gpus and held + job.total_gpus > most:
            needs = f"this job needs {job.total_gpus}"
            if job.total_gpus > most:
                needs += ", more than the queue allows one user"
            return Status(
                Code.UNRESOLVABLE,
                PendingReason.MAX_GPUS_PER_USER,
                f"{book.owner_name(job.owner)} holds {held}/{most} GPUs in {_queue(snap, job)}; {needs}",
            )
        return OK


def _queue(snap: Snapshot, job: JobView) -> str:
    return snap.queue_names.get(job.queue_id, str(job.queue_id))
