from __future__ import annotations

from scheduling.choices import PendingReason
from scheduling.engine.framework import OK, Code, CycleState, JobView, Status
from scheduling.engine.snapshot import Snapshot


class ArrayThrottle:
    """PreFilter: an array's throttle (Slurm's ``--array=0-99%10``). A member waits while
    ``Job.array_throttle`` members of its array hold resources — every active state counts, and
    members placed earlier in the same cycle too (``LimitBook.members``).

    A throttle is not a shortage: the refusal is ``UNRESOLVABLE``, so the member preempts nobody
    and holds no reservation. Jobs of no throttled array skip the plugin at once."""

    name = "array_throttle"

    def pre_filter(self, state: CycleState, snap: Snapshot, job: JobView) -> Status:
        if not job.throttle:
            return OK
        active = snap.limits.members.get(job.array, 0)
        if active < job.throttle:
            return OK
        return Status(
            Code.UNRESOLVABLE,
            PendingReason.ARRAY_TASK_LIMIT,
            f"array {job.array} runs {active}/{job.throttle} tasks (throttle)",
        )
