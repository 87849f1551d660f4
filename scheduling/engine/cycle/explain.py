"""Phase 5 of a cycle: tell waiting jobs why they wait.

Pending reasons are written only when a class's reason changed (its counts in the sentence at
most every ``EXPLAIN_EVERY_S``), and at most ``ORRERY_SCHEDULER_EXPLAIN_BUDGET`` jobs a cycle,
so a large blocked class costs a few writes, not one per job per cycle.
"""

from __future__ import annotations

import time

from django.conf import settings
from django.db import connection

from foundation.sql import is_postgresql, pg_array
from scheduling.choices import JobState, PendingReason
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle.decide import Blocked

EXPLAIN_EVERY_S = 10.0


def explain(cache: SchedulerCache, blocked: list[Blocked]) -> None:
    """Tell waiting jobs why, in as few writes as possible: only when a class's reason changed
    (its counts at most every 10 s), and at most ``ORRERY_SCHEDULER_EXPLAIN_BUDGET`` jobs a
    cycle — a class too large for one cycle is told in slices, in the cycles that follow."""
    now = time.monotonic()
    budget = settings.ORRERY_SCHEDULER_EXPLAIN_BUDGET
    for b in blocked:
        if budget <= 0:
            break
        shape = b.cls.shape
        said = ((b.status.reason or PendingReason.RESOURCES), b.status.message[:512])
        last = cache.explained.get(shape)  # (what was said, when it was finished, jobs, told so far)
        if (
            last is not None
            and last[3] >= len(b.cls)
            and now - last[1] < EXPLAIN_EVERY_S
            and last[0][0] == said[0]
        ):
            continue  # told, and the reason is the same (counts in the sentence may have moved)
        told = last[3] if last is not None and last[0] == said and last[3] < last[2] else 0
        ids = [job.id for _, job in b.cls.jobs[told : told + budget]]
        budget -= len(ids)
        _set_reasons(ids, *said)
        told += len(ids)
        cache.explained[shape] = (said, now, len(b.cls), told)


def _set_reasons(ids: list[int], reason: str, message: str) -> None:
    with connection.cursor() as cursor:
        if is_postgresql():
            cursor.execute(
                """
                UPDATE scheduling_job SET reason = %s, reason_message = %s
                WHERE id = ANY(%s::bigint[]) AND state = %s AND (reason, reason_message) IS DISTINCT FROM (%s, %s)
                """,
                [reason, message, pg_array(ids), JobState.PENDING, reason, message],
            )
        else:
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                cursor.execute(
                    f"UPDATE scheduling_job SET reason = %s, reason_message = %s WHERE state = %s "
                    f"AND id IN ({','.join(['%s'] * len(chunk))})",
                    [reason, message, JobState.PENDING, *chunk],
                )
