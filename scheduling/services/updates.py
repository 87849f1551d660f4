"""Changing a waiting job, as Slurm's ``scontrol update``: its time limit, priority, name,
hold, and an array's throttle (``PATCH /api/v1/jobs/{ref}``, ``orrery update``).

Rules, checked for every job changed, each refusal naming its field:

* only waiting jobs (PENDING, HELD) change; a job that has started is refused (``NotWaiting``);
* ``timeLimit`` may only go down for members; a manager of the job's project or an operator
  (``privileged``) may raise it, never above the queue's longest;
* ``priority`` stays within the queue's limit for members (``max_member_priority``);
  the privileged may go up to the spec's bound;
* ``throttle`` belongs to a whole array: it is set on every member, whatever the reference.

Every change is a ``JobEvent`` of kind ``updated`` saying old → new, and the whole update is one
audit entry; hold and release are transitions (``transition_jobs``), with their own events.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import CharField, F, Value
from django.db.models.functions import Cast, Concat

from foundation import audit
from foundation.choices import AuditAction
from scheduling.choices import WAITING_STATES, EventKind, JobState, PendingReason
from scheduling.models import Job, JobEvent
from scheduling.services.jobs import OPERATOR_HOLDS, OperatorsOnly
from scheduling.services.transitions import TransitionConflict, transition_jobs
from scheduling.spec import (
    MAX_TIME_LIMIT_S,
    PRIORITY_RANGE,
    FieldProblems,
    _kind,
    parse_duration,
    parse_priority,
    parse_throttle,
    text_problem,
)
from scheduling.wakeup import request_cycle

FIELDS = ("timeLimit", "priority", "name", "hold", "throttle", "version")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class UpdateRefused(Exception):
    """The update asks for something not allowed; ``errors`` lists ``(field, message)``."""

    def __init__(self, errors: list[tuple[str, str]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{path}: {message}" for path, message in errors))


class NotWaiting(Exception):
    """The job has left the queue (it runs or has ended): it can no longer be changed."""


@dataclass(frozen=True)
class JobChanges:
    """What to change; None: leave as it is. ``throttle`` 0 removes an array's throttle."""

    time_limit_s: int | None = None
    priority: int | None = None
    name: str | None = None
    hold: bool | None = None
    throttle: int | None = None
    version: int | None = None  # compare-and-set: refuse unless the job is still at this version

    @property
    def empty(self) -> bool:
        return all(v is None for k, v in self.__dict__.items() if k != "version")


def parse_changes(document: Any) -> JobChanges:
    """A ``JobChanges`` from a decoded JSON/YAML body; ``UpdateRefused`` lists every problem."""
    if not isinstance(document, dict) or not document:
        raise UpdateRefused([("(body)", f"give at least one of {', '.join(FIELDS[:-1])}")])
    errors = [
        (str(key)[:40], f"unknown field; expected one of {', '.join(FIELDS)}")
        for key in document
        if key not in FIELDS
    ]
    values: dict[str, Any] = {}

    def read(key: str, parse: Any) -> None:
        if document.get(key) is None:
            return
        try:
            values[key] = parse(document[key])
        except FieldProblems as exc:
            errors.extend((key + where, message) for where, message in exc.problems)
        except ValueError as exc:
            errors.append((key, str(exc)))

    read("timeLimit", parse_duration)
    read("priority", parse_priority)
    read("name", _parse_name)
    read("hold", _parse_bool)
    read("throttle", lambda v: parse_throttle(v) or 0)
    read("version", _parse_version)
    limit = values.get("timeLimit")
    if limit is not None and not 0 < limit <= MAX_TIME_LIMIT_S:
        errors.append(("timeLimit", f"must be more than 0 and at most {MAX_TIME_LIMIT_S // 86400} days"))
    if errors:
        raise UpdateRefused(errors)
    changes = JobChanges(
        time_limit_s=limit,
        priority=values.get("priority"),
        name=values.get("name"),
        hold=values.get("hold"),
        throttle=values.get("throttle"),
        version=values.get("version"),
    )
    if changes.empty:
        raise UpdateRefused([("(body)", f"give at least one of {', '.join(FIELDS[:-1])}")])
    return changes


def _parse_name(value: Any) -> str:
    if not isinstance(value, str) or text_problem(value):
        raise ValueError(f"must be a job name, not {_kind(value)}")
    if not _NAME.fullmatch(value):
        raise ValueError(
            "use letters, digits, '.', '_' and '-', starting with a letter or digit (at most 128)"
        )
    return value


def _parse_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true (hold) or false (release), not {_kind(value)}")
    return value


def _parse_version(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        raise ValueError("must be the job's version, as the API shows it")
    return value


@dataclass(frozen=True)
class UpdateOutcome:
    """The ids of the jobs changed, and how many of those asked for were left alone (not
    waiting any more: one member of an array may have started)."""

    changed: list[int]
    unchanged: int


def update_jobs(
    job_ids: Sequence[int],
    changes: JobChanges,
    *,
    actor: AbstractBaseUser,
    privileged: bool,
    target: str,
) -> UpdateOutcome:
    """Apply ``changes`` to the waiting jobs among ``job_ids`` (one job, or members of one
    array), in one transaction with their rows locked. One job that is not waiting raises
    ``NotWaiting``; of many, those not waiting are skipped, and ``NotWaiting`` is raised only
    when none waits. A ``version`` that is not the job's raises ``TransitionConflict``; a value
    the rules refuse, ``UpdateRefused``; releasing an operator's hold as a user, ``OperatorsOnly``.
    Permission to act on the jobs is the caller's; ``privileged`` says whether the actor
    manages their project (or is an operator)."""
    with transaction.atomic():
        # Lock the jobs only (not their queue, which submissions lock), in id order.
        locked = Job.objects.select_for_update(of=("self",)).filter(pk__in=job_ids).order_by("pk")
        rows = list(locked.select_related("queue"))
        if changes.version is not None and (len(rows) != 1 or rows[0].version != changes.version):
            raise TransitionConflict(
                f"job {rows[0].ref if rows else '?'} is at version {rows[0].version if rows else '?'}, "
                f"not {changes.version}: it changed since you read it; read it again"
            )
        waiting = [job for job in rows if job.state in WAITING_STATES]
        if not waiting:
            job = rows[0]
            raise NotWaiting(
                f"job {job.ref} is {job.state}: only a waiting job (PENDING or HELD) can be changed"
                if len(rows) == 1
                else f"none of the {len(rows)} jobs waits (PENDING or HELD): none can be changed"
            )
        _check(waiting, changes, privileged=privileged)
        events = _apply(waiting, changes, actor)
        moved = _hold_or_release(waiting, changes.hold, actor)
        if events or moved:
            details = {"changes": _summary(changes)} | audit.capped(
                sorted({e.job_id for e in events} | set(moved))
            )
            audit.record(AuditAction.JOB_UPDATE, actor=actor, target=target[:255], details=details)
            request_cycle()
        changed = sorted({e.job_id for e in events} | set(moved))
    return UpdateOutcome(changed=changed, unchanged=len(rows) - len(changed))


def _check(jobs: list[Job], changes: JobChanges, *, privileged: bool) -> None:
    errors: dict[str, str] = {}
    for job in jobs:
        queue = job.queue
        limit = changes.time_limit_s
        if limit is not None:
            longest = queue.max_time_limit_s
            if longest is not None and limit > longest:
                errors["timeLimit"] = f"queue {queue} allows at most {_duration(longest)}"
            elif not privileged and job.time_limit_s is not None and limit > job.time_limit_s:
                errors["timeLimit"] = (
                    f"may only be lowered (job {job.ref} has {_duration(job.time_limit_s)}); a manager "
                    "of the project or an operator may raise it"
                )
        if changes.priority is not None and not privileged and changes.priority > queue.max_member_priority:
            errors["priority"] = (
                f"queue {queue} lets members set a priority of at most {queue.max_member_priority}; a "
                "manager of the project or an operator may set a higher one"
            )
        if changes.priority is not None and not PRIORITY_RANGE[0] <= changes.priority <= PRIORITY_RANGE[1]:
            errors["priority"] = f"must be between {PRIORITY_RANGE[0]} and {PRIORITY_RANGE[1]}"
        if changes.throttle is not None and job.array_id is None:
            errors["throttle"] = f"job {job.ref} is not a member of an array"
        if changes.name and job.array_id is not None and len(f"{changes.name}-{job.array_index}") > 128:
            errors["name"] = "is too long for an array: NAME-INDEX must fit in 128 characters"
    if errors:
        raise UpdateRefused(sorted(errors.items()))


def _apply(jobs: list[Job], changes: JobChanges, actor: AbstractBaseUser) -> list[JobEvent]:
    """Set the changed columns, set-based (one UPDATE per field), bumping each job's version so
    a concurrent compare-and-set (a transition, the scheduler's commit) sees the change; one
    event per job and field."""
    events: list[JobEvent] = []

    def note(job: Job, what: str, old: str, new: str) -> None:
        events.append(
            JobEvent(
                job=job,
                kind=EventKind.UPDATED,
                from_state=job.state,
                to_state=job.state,
                message=f"{what} {old} → {new}",
                actor=actor,
            )
        )

    def update(ids: list[int], **columns: Any) -> None:
        if ids:
            Job.objects.filter(pk__in=ids).update(**columns, version=F("version") + 1)

    if (limit := changes.time_limit_s) is not None:
        touched = [job for job in jobs if job.time_limit_s != limit]
        update([job.pk for job in touched], time_limit_s=limit)
        for job in touched:
            note(job, "time limit", _duration(job.time_limit_s), _duration(limit))
    if (priority := changes.priority) is not None:
        touched = [job for job in jobs if job.priority != priority]
        update([job.pk for job in touched], priority=priority)
        for job in touched:
            note(job, "priority", str(job.priority), str(priority))
    if (name := changes.name) is not None:
        # Members of an array are NAME-INDEX, as at submission.
        plain = [job for job in jobs if job.array_id is None and job.name != name]
        members = [
            job for job in jobs if job.array_id is not None and job.name != f"{name}-{job.array_index}"
        ]
        update([job.pk for job in plain], name=name)
        update(
            [job.pk for job in members],
            name=Concat(Value(f"{name}-"), Cast("array_index", CharField()), output_field=CharField()),
        )
        for job in plain:
            note(job, "name", job.name, name)
        for job in members:
            note(job, "name", job.name, f"{name}-{job.array_index}")
    if changes.throttle is not None:
        throttle = changes.throttle or None
        arrays = {job.array_id for job in jobs if job.array_throttle != throttle}
        if arrays:
            Job.objects.filter(array_id__in=arrays).update(array_throttle=throttle)
        for job in jobs:
            if job.array_id in arrays:
                note(job, "array throttle", str(job.array_throttle or "none"), str(throttle or "none"))
    JobEvent.objects.bulk_create(events)
    return events


def _hold_or_release(jobs: list[Job], hold: bool | None, actor: AbstractBaseUser) -> list[int]:
    """Hold the pending ones (``hold``), or release the held ones, as the actions do."""
    if hold is None:
        return []
    by = actor.get_username()
    if hold:
        reason = PendingReason.HELD_BY_OPERATOR if actor.is_staff else PendingReason.HELD
        ids = [job.pk for job in jobs if job.state == JobState.PENDING]
        return transition_jobs(
            ids,
            JobState.HELD,
            only_from=JobState.PENDING,
            actor=actor,
            reason=reason,
            message=f"held by {by}",
        )
    held = [job for job in jobs if job.state == JobState.HELD]
    allowed = [job for job in held if actor.is_staff or job.reason not in OPERATOR_HOLDS]
    if len(jobs) == 1 and held and not allowed:
        raise OperatorsOnly(
            f"job {held[0].ref} was held by an operator or by failover; only an operator may release it"
        )
    return transition_jobs(
        [job.pk for job in allowed],
        JobState.PENDING,
        only_from=JobState.HELD,
        actor=actor,
        reason=PendingReason.NONE,
        message=f"released by {by}",
    )


def _summary(changes: JobChanges) -> dict[str, Any]:
    keys = {
        "time_limit_s": "timeLimit",
        "priority": "priority",
        "name": "name",
        "hold": "hold",
        "throttle": "throttle",
    }
    return {label: getattr(changes, key) for key, label in keys.items() if getattr(changes, key) is not None}


def _duration(seconds: int | None) -> str:
    """``2:00:00``, ``1-00:00:00`` (Slurm's form), or ``none``."""
    if seconds is None:
        return "none"
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}" if days else clock
