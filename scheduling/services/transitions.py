"""The job state machine: one table, one function.

::

                 ┌──────── hold ────────┐
                 ▼                      │
    submit → PENDING ──── place ───► SCHEDULED ─► STARTING ─► RUNNING ─► COMPLETING
               ▲  │ ▲                    │            │           │            │
               │  │ └──── requeue ───────┴────────────┴───────────┘            │
               │  ▼                                                             ▼
              HELD ── cancel ─► CANCELLED     SUCCEEDED · FAILED · TIMEOUT · CANCELLED
                                              (terminal: no way out)

    SCHEDULED · STARTING · RUNNING ── preempt ─► PREEMPTED ── drained ─► PENDING (requeued)

PREEMPTED is active: the job keeps its GPUs while it gets its signal and grace period, then
its attempt ends (state ``preempted``) and the job waits again under the same id.

``TRANSITIONS`` below is the authority; the picture is a guide. An active state (SCHEDULED …
COMPLETING) may jump straight to any end state, because a cluster can finish a job between two
polls. Node loss takes an active job to PENDING (requeue) or HELD (hold) per its policy.

``transition_job`` is a compare-and-set: it reads the job's state and version, then runs
``UPDATE … WHERE id = :id AND state IN (:allowed) AND version = :seen``. Zero rows means another
writer moved the job first: it raises ``TransitionConflict`` and changes nothing — callers decide
again from the new state, they never retry blindly. The JobEvent is written in the same
transaction, and the live event is published only after commit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import Case, CharField, F, Value, When
from django.utils import timezone

from clusters.services.nodes import settle_draining_nodes
from foundation import audit
from foundation.live import publish_on_commit
from scheduling.choices import (
    ACTIVE_STATES,
    ATTEMPT_STATE_FOR,
    TERMINAL_STATES,
    WAITING_STATES,
    AttemptState,
    EventKind,
    JobState,
    PendingReason,
)
from scheduling.dispatch.desired import forget_desired
from scheduling.events import JobsChanged, JobStateChanged, job_groups
from scheduling.models import Allocation, Job, JobAttempt, JobEvent
from scheduling.services.followups import after_moves
from scheduling.wakeup import request_cycle

S = JobState
_END = frozenset({S.SUCCEEDED, S.FAILED, S.TIMEOUT, S.CANCELLED})

TRANSITIONS: dict[str, frozenset[str]] = {
    S.PENDING: frozenset({S.HELD, S.SCHEDULED, S.CANCELLED, S.FAILED}),
    S.HELD: frozenset({S.PENDING, S.CANCELLED}),
    S.SCHEDULED: frozenset({S.STARTING, S.RUNNING, S.PENDING, S.HELD, S.PREEMPTED}) | _END,
    S.STARTING: frozenset({S.RUNNING, S.PENDING, S.HELD, S.PREEMPTED}) | _END,
    S.RUNNING: frozenset({S.COMPLETING, S.PENDING, S.HELD, S.PREEMPTED}) | _END,
    S.COMPLETING: frozenset({S.SUCCEEDED, S.FAILED, S.TIMEOUT, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.TIMEOUT: frozenset(),
    S.CANCELLED: frozenset(),
    S.PREEMPTED: frozenset({S.PENDING, S.HELD, S.FAILED, S.CANCELLED}),
}
assert set(TRANSITIONS) == set(JobState.values)
assert all(not TRANSITIONS[s] for s in TERMINAL_STATES)


def allowed_sources(to: str) -> frozenset[str]:
    """Every state from which ``to`` may be reached."""
    return frozenset(src for src, targets in TRANSITIONS.items() if to in targets)


class InvalidTransition(Exception):
    """The job's current state has no edge to the requested one; nothing was changed."""

    def __init__(self, job_id: int, current: str, to: str) -> None:
        self.job_id, self.current, self.to = job_id, current, to
        why = f"{current} is a final state" if current in TERMINAL_STATES else f"{current} cannot become {to}"
        super().__init__(f"job {job_id}: {why}.")


class TransitionConflict(Exception):
    """Another writer changed the job between our read and our compare-and-set."""


def transition_job(
    job_id: int,
    to: str,
    *,
    actor: AbstractBaseUser | None = None,
    reason: str = "",
    message: str = "",
    only_from: Iterable[str] | None = None,
    exit_code: int | None = None,
    audit_as: str | None = None,
) -> Job:
    """Move job ``job_id`` to state ``to`` and return the updated job.

    ``only_from`` narrows the allowed sources further (an action such as *hold* applies to
    jobs not yet running only, even though the table has other edges into HELD). ``reason`` is the pending
    reason when ``to`` is PENDING or HELD. Raises ``Job.DoesNotExist``, ``InvalidTransition``
    or ``TransitionConflict``; in each case nothing is written. ``audit_as`` (an ``AuditAction``)
    records the move in the audit log, in the same transaction: for moves someone asked for.
    """
    to = JobState(to)
    allowed = allowed_sources(to)
    if only_from is not None:
        allowed &= frozenset(only_from)
    with transaction.atomic():
        current, version = Job.objects.values_list("state", "version").get(pk=job_id)
        if current not in allowed:
            raise InvalidTransition(job_id, current, to)
        now = timezone.now()
        changes = _job_changes(to, now, reason=reason, message=message, exit_code=exit_code)
        updated = Job.objects.filter(pk=job_id, state__in=allowed, version=version).update(**changes)
        if updated != 1:
            raise TransitionConflict(f"job {job_id} changed while moving {current} → {to}; decide again.")

        attempt = _follow_attempt(job_id, current, to, now, exit_code=exit_code, reason=message or reason)
        JobEvent.objects.create(
            job_id=job_id,
            attempt=attempt,
            kind=EventKind.TRANSITION,
            from_state=current,
            to_state=to,
            reason=str(changes["reason"] or reason),
            message=message,
            actor=actor,
        )
        if audit_as:
            audit.record(
                audit_as, actor=actor, target=f"job:{job_id}", details=_audit_details(current, to, message)
            )
        cancel_doomed(after_moves([job_id], current, to, now))
        job = Job.objects.get(pk=job_id)
        publish_on_commit(
            job_groups(job.pk, job.project_id),
            JobStateChanged(job.pk, job.project_id, current, to, job.reason, now.isoformat()),
        )
    return job


def _audit_details(current: str, to: str, message: str) -> dict[str, Any]:
    return {"from": current, "to": to} | ({"message": message[:200]} if message else {})


def _job_changes(to: str, now: Any, *, reason: str, message: str, exit_code: int | None) -> dict[str, Any]:
    """The columns a move to ``to`` sets: state and version, the pending reason (only while
    waiting), start and finish times, the exit code."""
    changes: dict[str, Any] = {"state": to, "version": F("version") + 1}
    if to in WAITING_STATES or to == S.PREEMPTED:
        default = {S.HELD: PendingReason.HELD, S.PREEMPTED: PendingReason.PREEMPTED}.get(
            to, PendingReason.NONE
        )
        changes["reason"] = reason or default
        changes["reason_message"] = message[:512]
    else:
        changes["reason"], changes["reason_message"] = "", ""
    if to == S.RUNNING:
        changes["started_at"] = now
    if to in TERMINAL_STATES:
        changes["finished_at"] = now
    if exit_code is not None:
        changes["exit_code"] = exit_code
    return changes


def _follow_attempt(
    job_id: int, current: str, to: str, now: Any, *, exit_code: int | None, reason: str
) -> JobAttempt | None:
    """Carry the job's active attempt along: same state while the job is active; ended, with its
    allocations released, when the job leaves the active states (finished or requeued)."""
    if current not in ACTIVE_STATES and to not in ACTIVE_STATES:
        return None
    attempt = JobAttempt.objects.filter(job_id=job_id, active=True).first()
    if attempt is None or current not in ACTIVE_STATES:
        return attempt  # just placed: the attempt was created in its first state
    attempt.state = _attempt_state(current, to)
    fields = ["state"]
    if to == S.RUNNING and attempt.started_at is None:
        attempt.started_at = now
        fields.append("started_at")
    if to not in ACTIVE_STATES:
        attempt.active, attempt.finished_at, attempt.exit_code = False, now, exit_code
        attempt.reason = reason[:255]
        fields += ["active", "finished_at", "exit_code", "reason"]
        release_allocations(attempt.pk, now)
    attempt.save(update_fields=fields)
    return attempt


def _attempt_state(current: str, to: str) -> str:
    """The attempt's state for a job move: a drained preemption ends it as ``preempted``."""
    if current == S.PREEMPTED and to not in ACTIVE_STATES:
        return AttemptState.PREEMPTED if to in WAITING_STATES else ATTEMPT_STATE_FOR[to]
    return ATTEMPT_STATE_FOR[to]


def release_allocations(attempt_id: Any, now: Any) -> list[int]:
    """Release every active allocation of an attempt; returns the ids of the nodes it freed.
    Freed capacity wakes the scheduler."""
    rows = Allocation.objects.filter(attempt_id=attempt_id, active=True)
    node_ids = sorted(set(rows.values_list("node_id", flat=True)))
    rows.update(active=False, released_at=now)
    if node_ids:
        settle_draining_nodes(node_ids)
        request_cycle()
        transaction.on_commit(lambda: forget_desired(node_ids))
    return node_ids


def _per_job(key: str, words: Mapping[int, str], limit: int) -> Case:
    """A column's value per job in one ``UPDATE``: each job's own words, cut to ``limit``."""
    by_words: dict[str, list[int]] = {}
    for pk, said in words.items():
        by_words.setdefault(said[:limit], []).append(pk)
    return Case(
        *(When(**{f"{key}__in": ids}, then=Value(said)) for said, ids in by_words.items()),
        output_field=CharField(),
    )


def cancel_doomed(job_ids: list[int]) -> None:
    """Cancel waiting jobs a dependency of which can never be met (Slurm's
    ``DependencyNeverSatisfied``, with ``kill_invalid_depend``): each cancel may doom others in
    turn, in the same transaction."""
    for state in (S.PENDING, S.HELD) if job_ids else ():
        transition_jobs(
            job_ids,
            S.CANCELLED,
            only_from=state,
            reason=PendingReason.DEPENDENCY_NEVER,
            message="a job it depends on ended in a way that can never satisfy the dependency",
        )


def transition_jobs(
    job_ids: list[int],
    to: str,
    *,
    only_from: str,
    actor: AbstractBaseUser | None = None,
    reason: str = "",
    message: str = "",
    messages: Mapping[int, str] | None = None,
    exit_code: int | None = None,
) -> list[int]:
    """The set-based form of ``transition_job`` for many jobs leaving one state at once (the
    simulated clusters' runner, the failover handler, a cycle's preemptions): same table, same
    compare-and-set, same events and attempt bookkeeping, a few statements in all. ``messages``
    gives some jobs words of their own instead of ``message``. Returns the ids that moved; jobs
    no longer in ``only_from`` are left alone."""
    to = JobState(to)
    if only_from not in allowed_sources(to):
        raise InvalidTransition(0, only_from, to)
    if not job_ids:
        return []
    now = timezone.now()
    with transaction.atomic():
        rows = list(
            Job.objects.select_for_update()
            .filter(pk__in=job_ids, state=only_from)
            .order_by("pk")  # one lock order for every writer: no deadlock with dependency checks
            .values_list("pk", "project_id")
        )
        moved = [pk for pk, _ in rows]
        if not moved:
            return []
        words = {pk: messages.get(pk, message) for pk in moved} if messages else {}
        changes = _job_changes(to, now, reason=reason, message=message, exit_code=exit_code)
        if words and "reason_message" in changes:
            changes["reason_message"] = _per_job("pk", words, 512)
        Job.objects.filter(pk__in=moved, state=only_from).update(**changes)

        attempts = dict(JobAttempt.objects.filter(job_id__in=moved, active=True).values_list("job_id", "pk"))
        attempt_changes: dict[str, Any] = {"state": _attempt_state(only_from, to)}
        if to == S.RUNNING:
            attempt_changes["started_at"] = now
        if to not in ACTIVE_STATES:
            attempt_changes.update(
                active=False,
                finished_at=now,
                exit_code=exit_code,
                reason=_per_job("job_id", {pk: w or reason for pk, w in words.items()}, 255)
                if words
                else (message or reason)[:255],
            )
        if attempts and (only_from in ACTIVE_STATES or to in ACTIVE_STATES):
            JobAttempt.objects.filter(pk__in=list(attempts.values())).update(**attempt_changes)
            if to not in ACTIVE_STATES:
                held = Allocation.objects.filter(attempt_id__in=list(attempts.values()), active=True)
                nodes = sorted(set(held.values_list("node_id", flat=True)))
                held.update(active=False, released_at=now)
                settle_draining_nodes(nodes)
                request_cycle()
                transaction.on_commit(lambda: forget_desired(nodes))
        JobEvent.objects.bulk_create(
            JobEvent(
                job_id=pk,
                attempt_id=attempts.get(pk),
                kind=EventKind.TRANSITION,
                from_state=only_from,
                to_state=to,
                reason=str(changes["reason"] or reason),
                message=words.get(pk, message),
                actor=actor,
            )
            for pk in moved
        )
        cancel_doomed(after_moves(moved, only_from, to, now))
        by_project: dict[int, list[int]] = {}
        for pk, project_id in rows:
            by_project.setdefault(project_id, []).append(pk)
        for project_id, ids in by_project.items():
            publish_on_commit(
                [f"project.{project_id}"], JobsChanged(project_id, ids[:100], len(ids), only_from, to)
            )
    return moved
