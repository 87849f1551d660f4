"""Phase 5 of a cycle: tell waiting jobs why they wait.

Pending reasons are written only when a class's reason changed (its counts in the sentence at
most every ``EXPLAIN_EVERY_S``), and at most ``ORRERY_SCHEDULER_EXPLAIN_BUDGET`` jobs a cycle,
so a large blocked class costs a few writes, not one per job per cycle.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from django.conf import settings
from django.db import connection

from foundation.sql import is_postgresql, pg_array
from scheduling.choices import JobState, PendingReason
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle.decide import Blocked

EXPLAIN_EVERY_S = 10.0
ESTIMATE_MOVE_S = 30.0  # an estimate is rewritten when it moves by more than this (or 10 %)


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


def estimates(cache: SchedulerCache, found: dict[int, tuple[float, str, bool]], now: float) -> int:
    """Write predicted starts that changed — moved by more than 30 s or 10 % of the wait,
    another place, gained or lost a reservation — and clear those of jobs that no longer have
    one; at most ``ORRERY_SCHEDULER_ESTIMATE_BUDGET`` jobs a cycle. Returns how many rows."""
    budget = settings.ORRERY_SCHEDULER_ESTIMATE_BUDGET
    said = cache.estimated
    rows: list[tuple[int, float | None, str, bool]] = []
    for job_id, (start, where, reserved) in found.items():
        old = said.get(job_id)
        if old is not None and old[1:] == (where, reserved):
            tolerance = max(ESTIMATE_MOVE_S, 0.1 * max(start - now, 0.0))
            if abs(old[0] - start) <= tolerance:
                continue
        rows.append((job_id, start, where, reserved))
    pending = cache.queue.jobs
    rows += [(job_id, None, "", False) for job_id in said if job_id not in found and job_id in pending]
    for job_id in [j for j in said if j not in pending]:
        del said[job_id]  # placed or gone: its estimate no longer matters
    rows = rows[:budget]
    if not rows:
        return 0
    _set_estimates(rows)
    for job_id, start, where, reserved in rows:
        if start is None:
            said.pop(job_id, None)
        else:
            said[job_id] = (start, where, reserved)
    return len(rows)


def _set_estimates(rows: list[tuple[int, float | None, str, bool]]) -> None:
    values = [
        (
            job_id,
            datetime.fromtimestamp(start, UTC) if start is not None and start < 1e11 else None,
            where[:255],
            reserved,
        )
        for job_id, start, where, reserved in rows
    ]
    with connection.cursor() as cursor:
        if is_postgresql():
            cursor.execute(
                """
                UPDATE scheduling_job j SET estimated_start_at = v.at, estimated_where = v.at_where,
                    reserved = v.reserved
                FROM unnest(%s::bigint[], %s::timestamptz[], %s::text[], %s::boolean[])
                    AS v(id, at, at_where, reserved)
                WHERE j.id = v.id AND j.state = %s
                """,
                [
                    [v[0] for v in values],
                    [v[1] for v in values],
                    [v[2] for v in values],
                    [v[3] for v in values],
                    JobState.PENDING,
                ],
            )
        else:
            cursor.executemany(
                "UPDATE scheduling_job SET estimated_start_at = %s, estimated_where = %s, reserved = %s "
                "WHERE id = %s AND state = %s",
                [(at, where, reserved, job_id, JobState.PENDING) for job_id, at, where, reserved in values],
            )
