"""Phase 4 of a cycle: write the decisions, in the cycle's transaction.

First a compare-and-set of every placed job PENDING → SCHEDULED in one statement (a job
cancelled meanwhile loses its placement), then bulk inserts of attempts, allocations, events
and outbox rows (``COPY`` on PostgreSQL). A crash before the transaction commits leaves no
trace; the dispatcher is rung and subscribers told only once it has.
"""

from __future__ import annotations

import uuid
from collections import Counter, defaultdict
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from foundation.live import publish_on_commit
from foundation.sql import NULL, TRUE, bulk_insert, copy_escape, is_postgresql, pg_array
from foundation.units import memory_text
from scheduling.choices import AttemptState, EventKind, JobState
from scheduling.dispatch.desired import forget_desired
from scheduling.engine.framework import JobView, NodeChoice, Placement
from scheduling.engine.snapshot import Snapshot
from scheduling.events import JobsScheduled
from scheduling.metrics import PREEMPTIONS
from scheduling.models import DispatchOutbox
from scheduling.services.preemption import Victim, preempt_jobs
from scheduling.wakeup import ring_dispatch


def commit(
    decisions: list[Placement], snap: Snapshot, epoch: int
) -> tuple[list[Placement], list[JobView], list[uuid.UUID]]:
    """Write every decision in the current transaction; returns (placed, jobs that lost a race,
    the new attempts' ids). Each attempt gets the id chosen with its decision (``Placement.attempt``)."""
    if not decisions:
        return [], [], []
    won = _claim(
        [d.job for d in decisions],
        [snap.model_ids[d.job.model] if d.job.model >= 0 else None for d in decisions],
    )
    placed = [d for d in decisions if d.job.id in won]
    lost = [d.job for d in decisions if d.job.id not in won]
    if not placed:
        return [], lost, []
    now = timezone.now()
    # Rows are built text-ready for COPY (one string per timestamp and attempt id, "t" for
    # true, NULL as \N); ``bulk_insert`` turns them back into values for SQLite.
    at, yes, null = now.isoformat(), TRUE, NULL
    attempts, allocations, events, outbox = [], [], [], []
    for d in placed:
        job = d.job
        attempt = str(d.attempt)
        cluster_id = snap.cluster_ids[d.cluster]
        attempts.append(
            (attempt, job.id, job.attempts + 1, cluster_id, AttemptState.SCHEDULED, yes, epoch, "", "", at)
        )
        where = []
        for choice in d.nodes:
            node_id = int(snap.node_id[choice.row])
            allocations.append((attempt, job.id, node_id, null, null, 0, job.cpu, job.memory, yes, at))
            gpu_ids = snap.gpu_ids[choice.row]
            if choice.instances:  # MIG instances, each under its parent GPU
                for i, instance in zip(choice.gpu_indices, choice.instances, strict=True):
                    allocations.append((attempt, job.id, node_id, gpu_ids[i], instance, 0, 0, 0, yes, at))
            elif choice.share_mb:  # a fraction of a shared GPU
                i = choice.gpu_indices[0]
                allocations.append(
                    (attempt, job.id, node_id, gpu_ids[i], null, choice.share_mb, 0, 0, yes, at)
                )
            else:
                for i in choice.gpu_indices:
                    allocations.append((attempt, job.id, node_id, gpu_ids[i], null, 0, 0, 0, yes, at))
            where.append(f"{snap.names[choice.row]}[{_held_text(snap, d.job, choice)}]")
        message = copy_escape(f"placed on {snap.cluster_names[d.cluster]}: {' '.join(where)} (epoch {epoch})")
        events.append(
            (job.id, attempt, at, EventKind.TRANSITION, JobState.PENDING, JobState.SCHEDULED, "", message)
        )
        outbox.append(
            (attempt, cluster_id, DispatchOutbox.Kind.START, DispatchOutbox.State.PENDING, epoch, at, 0, "")
        )
    # COPY runs on psycopg's own cursor, outside Django's error translation: translate here, so
    # a placement that meets another scheduler's rows (the one-active-allocation-per-GPU index)
    # is an IntegrityError that the cycle handles, not a raw driver error.
    with connection.wrap_database_errors:
        bulk_insert(
            "scheduling_jobattempt",
            [
                "id",
                "job_id",
                "number",
                "cluster_id",
                "state",
                "active",
                "epoch",
                "remote_id",
                "reason",
                "created_at",
            ],
            attempts,
        )
        bulk_insert(
            "scheduling_allocation",
            [
                "attempt_id",
                "job_id",
                "node_id",
                "gpu_id",
                "mig_instance_id",
                "gpu_memory_mb",
                "cpu_millicores",
                "memory_bytes",
                "active",
                "allocated_at",
            ],
            allocations,
        )
        bulk_insert(
            "scheduling_jobevent",
            ["job_id", "attempt_id", "at", "kind", "from_state", "to_state", "reason", "message"],
            events,
        )
        bulk_insert(
            "scheduling_dispatchoutbox",
            ["attempt_id", "cluster_id", "kind", "state", "epoch", "created_at", "tries", "last_error"],
            outbox,
        )
    placed_nodes = sorted({int(snap.node_id[c.row]) for d in placed for c in d.nodes})
    transaction.on_commit(lambda: forget_desired(placed_nodes))
    ring_dispatch()
    by_project: dict[int, list[int]] = defaultdict(list)
    for d in placed:
        by_project[d.job.project_id].append(d.job.id)
    for project_id, ids in by_project.items():
        publish_on_commit([f"project.{project_id}"], JobsScheduled(project_id, ids[:100], len(ids), epoch))
    return placed, lost, [uuid.UUID(row[0]) for row in attempts]


def _held_text(snap: Snapshot, job: JobView, choice: NodeChoice) -> str:
    """GPU indices as the event says them: ``0,1``; ``0:1g.10gb,0:1g.10gb`` for MIG
    instances; ``2:20 GiB`` for a fraction of a shared GPU."""
    if choice.instances:
        profile = snap.mig_profiles[job.slice]
        return ",".join(f"{i}:{profile}" for i in choice.gpu_indices)
    if choice.share_mb:
        return f"{choice.gpu_indices[0]}:{memory_text(choice.share_mb * 2**20)}"
    return ",".join(map(str, choice.gpu_indices))


def _claim(jobs: list[JobView], models: list[int | None]) -> set[int]:
    """Compare-and-set PENDING → SCHEDULED for all placed jobs at once, recording the GPU model
    each was placed on (an any-model job's choice); returns the winners."""
    ids = [j.id for j in jobs]
    with connection.cursor() as cursor:
        if is_postgresql():
            cursor.execute(
                """
                UPDATE scheduling_job j SET state = %s, version = j.version + 1, attempt_count = j.attempt_count + 1,
                    reason = '', reason_message = '', estimated_start_at = NULL, estimated_where = '',
                    reserved = false, gpu_model_id = COALESCE(v.model, j.gpu_model_id)
                FROM unnest(%s::bigint[], %s::bigint[]) AS v(id, model)
                WHERE j.id = v.id AND j.state = %s
                RETURNING j.id
                """,
                [JobState.SCHEDULED, pg_array(ids), pg_array(models), JobState.PENDING],
            )
            return {row[0] for row in cursor.fetchall()}
        won = set()
        for job_id, model in zip(ids, models, strict=True):
            cursor.execute(
                "UPDATE scheduling_job SET state = %s, version = version + 1, attempt_count = attempt_count + 1, "
                "reason = '', reason_message = '', estimated_start_at = NULL, estimated_where = '', "
                "reserved = %s, gpu_model_id = COALESCE(%s, gpu_model_id) WHERE id = %s AND state = %s",
                [JobState.SCHEDULED, False, model, job_id, JobState.PENDING],
            )
            if cursor.rowcount == 1:
                won.add(job_id)
        return won


def preempt(decisions: list[Any]) -> int:
    """Preempt the victims the cycle chose, in its transaction, all at once; returns how many
    moved. Each is counted by its decision's reason once it has moved."""
    reasons = {v: decision.reason for decision in decisions for v in decision.victims}
    done = preempt_jobs([Victim(v, decision.message) for decision in decisions for v in decision.victims])
    for reason, count in Counter(reasons[v] for v in done).items():
        PREEMPTIONS.labels(reason).inc(count)
    return len(done)
