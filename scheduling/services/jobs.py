"""Writes on jobs that users and operators ask for: submit, cancel, hold, release, requeue, and
the checkpoint stamp a running job sets when it has saved its work.

The API, the CLI and the admin all call these; none of them changes a job any other way.
Permission checks happen before, in ``portal.access``; these functions trust their caller.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from clusters.models import GpuModel
from foundation import audit
from foundation.choices import AuditAction
from foundation.live import publish_on_commit
from foundation.sealing import seal
from foundation.sql import copy_create, is_postgresql, new_instances
from scheduling.choices import (
    ACTIVE_STATES,
    WAITING_STATES,
    EventKind,
    FailoverPolicy,
    JobState,
    PendingReason,
)
from scheduling.events import JobsSubmitted
from scheduling.models import Job, JobEvent, Queue
from scheduling.services import arrays, budgets, dependencies
from scheduling.services.transitions import allowed_sources, transition_job, transition_jobs
from scheduling.wakeup import request_cycle


@dataclass(frozen=True)
class JobRequest:
    """A validated, normalised job request: units in base units, GPU model resolved."""

    name: str
    queue: Queue
    gpu_model: GpuModel | None = None
    gpus_per_node: int = 0
    nodes: int = 1
    cpu_millicores_per_node: int = 0
    memory_bytes_per_node: int = 0
    time_limit_s: int | None = None
    command: str = ""
    priority: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    placement: dict[str, Any] = field(default_factory=dict)
    preemptible: bool = True
    retries: int = 0
    failover_policy: str = FailoverPolicy.HOLD
    spec: dict[str, Any] = field(default_factory=dict)
    secret_env: dict[str, str] = field(default_factory=dict, repr=False)
    array_index: int | None = None  # a member of an array: its index (the array id is set at insert)
    array_throttle: int | None = None
    array_first: bool = False  # the first member of an array: those after it, up to the next, are its
    dependency: tuple[tuple[str, str], ...] = ()  # as in JobSpec.dependency, unresolved
    gpu_slice: str = ""  # a MIG profile (``gpus_per_node`` instances of it)
    gpu_memory_mb: int = 0  # a fraction of a shareable GPU, by memory …
    gpu_share: float | None = None  # … or by share

    def digest(self) -> str:
        """A stable hash of what was asked, to tell a retry from a different request. Secret
        values enter only through a keyed hash, so the stored digest cannot be used to guess them."""
        # A shallow copy: ``asdict``'s deep copy of the spec was most of a batch's digest time,
        # and no field holds a dataclass, so the JSON (and the digest) is the same.
        body = {f.name: getattr(self, f.name) for f in fields(self)} | {
            "queue": self.queue.pk,
            "gpu_model": self.gpu_model and self.gpu_model.slug,
            "secret_env": _secret_digest(self.secret_env),
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _secret_digest(secret_env: dict[str, str]) -> str:
    """The keyed hash of a request's secret environment; that of none, nearly every request's,
    is made once per process and key."""
    if not secret_env:
        return _no_secret_digest(settings.SECRET_KEY)
    body = json.dumps(secret_env, sort_keys=True).encode()
    return hmac.new(settings.SECRET_KEY.encode(), body, "sha256").hexdigest()


@functools.lru_cache(maxsize=4)
def _no_secret_digest(key: str) -> str:
    return hmac.new(key.encode(), b"{}", "sha256").hexdigest()


class IdempotencyConflict(Exception):
    """The idempotency key was used before for a different request."""

    def __init__(self, job: Job) -> None:
        self.job = job
        super().__init__(f"idempotency key already used for a different request (job {job.pk}).")


class TooManyPending(Exception):
    """Accepting the jobs would take a project, a queue or a user past a cap on waiting jobs."""


class OperatorsOnly(Exception):
    """The action is reserved to operators (releasing an operator's or a failover hold)."""


class NotActive(Exception):
    """The job holds no placement (it waits, or it has ended): there is no work to stamp."""


def submit_job(
    request: JobRequest, *, actor: AbstractBaseUser, idempotency_key: str | None = None
) -> tuple[Job, bool]:
    """Create one PENDING job; returns ``(job, created)``. See ``submit_jobs``."""
    jobs, created = submit_jobs([request], actor=actor, idempotency_key=idempotency_key)
    return jobs[0], created


def submit_jobs(
    requests: Sequence[JobRequest],
    *,
    actor: AbstractBaseUser,
    idempotency_key: str | None = None,
    batch: bool = False,
) -> tuple[list[Job], bool]:
    """Create PENDING jobs, all or none, in one transaction; returns ``(jobs, created)``.

    With an ``idempotency_key``, a retry of the same request returns the jobs made the first time
    (``created`` False) and creates nothing; the same key with a different request raises
    ``IdempotencyConflict``. A batch (``batch=True``, whatever its size) stores ``KEY#0``,
    ``KEY#1``… on its jobs, and a key is never reused across shapes: a single submission's
    ``KEY`` and a batch's ``KEY#i`` conflict with each other. The unique
    constraint on ``(owner, idempotency_key)`` settles races between concurrent retries.
    Raises ``TooManyPending`` when a cap on waiting jobs would be passed.
    """
    if not requests:
        raise ValueError("nothing to submit")
    keys: list[str | None] = [None] * len(requests)
    if idempotency_key:
        keys = [f"{idempotency_key}#{i}" for i in range(len(requests))] if batch else [idempotency_key]
    # A digest tells a retry from a different request under one key: without a key, none is kept.
    digests = [r.digest() for r in requests] if idempotency_key else [""] * len(requests)
    if idempotency_key and (existing := _earlier_submission(actor, idempotency_key, keys, digests)):
        return existing, False
    sealed: dict[int, str] = {}  # the tasks of an array share one secret environment: seal it once
    try:
        with transaction.atomic():
            _check_waiting_caps(requests, actor)
            rows = [
                _new_job(r, actor=actor, key=key, digest=d, sealed=sealed)
                for r, key, d in zip(requests, keys, digests, strict=True)
            ]
            jobs = copy_create(Job, new_instances(Job, rows))
            events = [
                {
                    "job": job,
                    "kind": EventKind.SUBMITTED,
                    "to_state": JobState.PENDING,
                    "actor": actor,
                    "message": f"submitted to {job.queue}",
                }
                for job in jobs
            ]
            copy_create(JobEvent, new_instances(JobEvent, events))
            arrays.number(jobs, requests)
            dependencies.attach(jobs, requests, actor)
            for message, ids in budgets.reserve(jobs).items():  # jobs the budget admits held
                transition_jobs(
                    ids,
                    JobState.HELD,
                    only_from=JobState.PENDING,
                    reason=PendingReason.BUDGET_EXHAUSTED,
                    message=message,
                )
                held = set(ids)  # the caller shows these jobs: say held, as their rows now do
                for job in (job for job in jobs if job.pk in held):
                    job.state, job.reason, job.reason_message = (
                        JobState.HELD,
                        PendingReason.BUDGET_EXHAUSTED,
                        message,
                    )
            for project_id, ids in _ids_by_project(jobs).items():
                publish_on_commit([f"project.{project_id}"], JobsSubmitted(project_id, ids[:100], len(ids)))
            audit.record(
                AuditAction.JOB_SUBMIT, actor=actor, target=_jobs_target(jobs), details=_submitted(jobs)
            )
            request_cycle()
    except IntegrityError:
        if not idempotency_key:
            raise
        # A concurrent retry with the same key committed first: answer with its jobs.
        existing = _earlier_submission(actor, idempotency_key, keys, digests)
        if not existing:
            raise
        return existing, False
    return jobs, True


def _new_job(
    request: JobRequest, *, actor: AbstractBaseUser, key: str | None, digest: str, sealed: dict[int, str]
) -> dict[str, Any]:
    """The fields of a new job (``new_instances`` makes it)."""
    if request.secret_env and id(request.secret_env) not in sealed:
        sealed[id(request.secret_env)] = seal(request.secret_env)
    return dict(
        owner=actor,
        project=request.queue.project,
        queue=request.queue,
        name=request.name,
        labels=request.labels,
        priority=request.priority,
        nodes=request.nodes,
        gpu_model=request.gpu_model,
        gpus_per_node=request.gpus_per_node,
        gpu_slice=request.gpu_slice,
        gpu_memory_mb=request.gpu_memory_mb,
        gpu_share=request.gpu_share,
        cpu_millicores_per_node=request.cpu_millicores_per_node,
        memory_bytes_per_node=request.memory_bytes_per_node,
        time_limit_s=request.time_limit_s,
        command=request.command,
        spec=request.spec,
        placement=request.placement,
        preemptible=request.preemptible,
        retries=request.retries,
        failover_policy=request.failover_policy,
        secret_env=sealed.get(id(request.secret_env), "") if request.secret_env else "",
        array_index=request.array_index,
        array_throttle=request.array_throttle,
        idempotency_key=key,
        request_digest=digest,
        state=JobState.PENDING,
        reason=PendingReason.NONE,
    )


def _earlier_submission(
    actor: AbstractBaseUser, key: str, keys: list[str | None], digests: list[str]
) -> list[Job]:
    """The jobs an earlier submission with this key made, in order; [] if there was none.
    Any job under ``KEY`` or ``KEY#…`` that does not line up with this request is a conflict."""
    earlier = Job.objects.filter(owner=actor).filter(
        Q(idempotency_key=key) | Q(idempotency_key__startswith=f"{key}#")
    )
    found = {j.idempotency_key: j for j in earlier}
    if not found:
        return []
    jobs = [found.get(k) for k in keys]
    mismatch = len(found) != len(keys) or any(
        job is None or job.request_digest != d for job, d in zip(jobs, digests, strict=True)
    )
    if mismatch:
        raise IdempotencyConflict(next(iter(found.values())))
    return jobs  # type: ignore[return-value]


def _check_waiting_caps(requests: Sequence[JobRequest], actor: AbstractBaseUser) -> None:
    """Refuse jobs that would take a project, a queue, or the submitting user in either, past a
    cap on waiting jobs. Per-user caps keep one member's backlog from locking the rest of the
    project out of a queue or project cap.

    The queues of the projects involved are locked first (in id order, so two batches cannot
    deadlock): concurrent submissions to one project then count one after the other, and the
    caps hold exactly."""
    per_queue = Counter(r.queue.pk for r in requests)
    per_project = Counter(r.queue.project_id for r in requests)
    named = {r.queue.pk: r.queue for r in requests}
    caps = _lock_queues(sorted(per_project))
    cap, user_cap = settings.ORRERY_MAX_WAITING_JOBS_PER_PROJECT, settings.ORRERY_MAX_WAITING_JOBS_PER_USER
    for project_id, adding in per_project.items():
        waiting, mine = _waiting(actor, "project_id", project_id)
        _refuse_past(waiting, adding, cap, "the project has")
        _refuse_past(mine, adding, user_cap, "you have", " in this project")
    for queue_id, adding in per_queue.items():
        queue_cap, queue_user_cap = caps[queue_id]
        if queue_cap is None and queue_user_cap is None:
            continue
        queue = named[queue_id]
        waiting, mine = _waiting(actor, "queue_id", queue_id)
        _refuse_past(waiting, adding, queue_cap, f"queue {queue} has")
        _refuse_past(mine, adding, queue_user_cap, "you have", f" in queue {queue}")


def _lock_queues(project_ids: list[int]) -> dict[int, tuple[int | None, int | None]]:
    """Lock the queues of the projects in id order; their caps on waiting jobs (all, per user)."""
    if not is_postgresql():
        rows = Queue.objects.select_for_update().filter(project_id__in=project_ids).order_by("pk")
        caps = rows.values_list("pk", "max_pending_jobs", "max_pending_jobs_per_user")
        return {pk: (a, b) for pk, a, b in caps}
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id, max_pending_jobs, max_pending_jobs_per_user FROM {Queue._meta.db_table} "
            "WHERE project_id = ANY(%s) ORDER BY id FOR UPDATE",
            [project_ids],
        )
        return {pk: (a, b) for pk, a, b in cursor.fetchall()}


_WAITING = sorted(WAITING_STATES)


def _waiting(actor: AbstractBaseUser, column: str, value: int) -> tuple[int, int]:
    """Jobs waiting where ``column`` (``project_id``, ``queue_id``) is ``value``: all, and the
    actor's. Written out: the ORM's aggregate took longer to build than to count."""
    states = ", ".join(["%s"] * len(_WAITING))
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT COUNT(*), COUNT(*) FILTER (WHERE owner_id = %s) FROM {Job._meta.db_table} "
            f"WHERE {column} = %s AND state IN ({states})",
            [actor.pk, value, *_WAITING],
        )
        waiting, mine = cursor.fetchone()
    return waiting, mine


def _refuse_past(now: int, adding: int, cap: int | None, who: str, where: str = "") -> None:
    if cap is not None and now + adding > cap:
        raise TooManyPending(
            f"{who} {now} waiting jobs{where} and may have at most {cap}; {adding} more would pass "
            "the cap — wait for some to start or cancel some"
        )


def _jobs_target(jobs: list[Job]) -> str:
    return f"job:{jobs[0].pk}" if len(jobs) == 1 else f"jobs:{jobs[0].pk}-{jobs[-1].pk}"


def _submitted(jobs: list[Job]) -> dict[str, Any]:
    """One audit entry per submission, however many jobs it made: the count, the ids (capped)
    and the queues."""
    queues = sorted({str(job.queue) for job in jobs})
    return audit.capped([job.pk for job in jobs]) | {"queues": queues[:20]}


def _ids_by_project(jobs: list[Job]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for job in jobs:
        out.setdefault(job.project_id, []).append(job.pk)
    return out


def explain_pending(job_id: int, reason: str, message: str) -> bool:
    """Record why a pending job waits (the scheduler's verdict). Not a transition, so no event;
    touches the job only while it is PENDING. Returns whether it did."""
    updated = Job.objects.filter(pk=job_id, state=JobState.PENDING).update(
        reason=PendingReason(reason), reason_message=message[:512]
    )
    return updated == 1


# The states each user action applies to: the services below enforce them, and pages offer
# only the actions a job's state allows.
ACTION_SOURCES: dict[str, frozenset[str]] = {
    "cancel": allowed_sources(JobState.CANCELLED),
    "hold": frozenset({JobState.PENDING, JobState.SCHEDULED}),
    "release": frozenset({JobState.HELD}),
    "requeue": frozenset(ACTIVE_STATES),
}


def cancel_job(job: Job, *, actor: AbstractBaseUser | None, message: str = "") -> Job:
    """Cancel a job in any non-final state; its attempt ends and its GPUs are released."""
    return transition_job(
        job.pk,
        JobState.CANCELLED,
        actor=actor,
        message=message or _by(actor, "cancelled"),
        audit_as=AuditAction.JOB_CANCEL,
    )


def hold_job(job: Job, *, actor: AbstractBaseUser | None, message: str = "") -> Job:
    """Keep a job that has not started from being scheduled until it is released. A job already
    placed but not yet running (SCHEDULED) gives its placement back: its attempt ends and the
    cluster withdraws it (the agent drops it, a Slurm job is cancelled). An operator's hold
    (Slurm's ``JobHeldAdmin``) is released only by an operator."""
    by_operator = actor is not None and actor.is_staff
    return transition_job(
        job.pk,
        JobState.HELD,
        actor=actor,
        reason=PendingReason.HELD_BY_OPERATOR if by_operator else PendingReason.HELD,
        message=message or _by(actor, "held"),
        audit_as=AuditAction.JOB_HOLD,
        only_from=ACTION_SOURCES["hold"],
    )


# Holds that only an operator may release: an operator's own, and a failover hold (the job's
# node was lost; someone with the fleet's view decides whether it may run again).
OPERATOR_HOLDS = frozenset({PendingReason.HELD_BY_OPERATOR, PendingReason.NODE_LOST})


def release_job(job: Job, *, actor: AbstractBaseUser | None, message: str = "") -> Job:
    """Return a held job to the queue. Raises ``OperatorsOnly`` when a user who is not an
    operator tries to release an operator's or a failover hold; the job's row is locked while
    this is decided, so a hold placed concurrently is never released by mistake."""
    with transaction.atomic():
        reason, waits = (
            Job.objects.select_for_update().values_list("reason", "dependency_pending").get(pk=job.pk)
        )
        if reason in OPERATOR_HOLDS and not (actor is None or actor.is_staff):
            who = (
                "an operator" if reason == PendingReason.HELD_BY_OPERATOR else "failover (its node was lost)"
            )
            raise OperatorsOnly(f"job {job.ref} was held by {who}; only an operator may release it")
        if reason == PendingReason.BUDGET_EXHAUSTED:  # reserve its ask now, or stay held (409)
            budgets.reserve_released(job.pk)
        return transition_job(
            job.pk,
            JobState.PENDING,
            actor=actor,
            reason=PendingReason.DEPENDENCY if waits else PendingReason.NONE,  # still not schedulable
            message=message or _by(actor, "released"),
            audit_as=AuditAction.JOB_RELEASE,
            only_from=ACTION_SOURCES["release"],
        )


@dataclass(frozen=True)
class ActionOutcome:
    """What an action on many jobs did: the ids it moved, and how many it left as they were
    (their state did not allow it, or an operator's hold a user may not release)."""

    moved: list[int]
    unchanged: int


_DONE = {"cancel": "cancelled", "hold": "held", "release": "released", "requeue": "requeued"}
# Where each action takes a job, and the pending reason it leaves (hold: by whom).
_ACTION_TARGETS = {
    "cancel": (JobState.CANCELLED, PendingReason.NONE, AuditAction.JOB_CANCEL),
    "hold": (JobState.HELD, PendingReason.HELD, AuditAction.JOB_HOLD),
    "release": (JobState.PENDING, PendingReason.NONE, AuditAction.JOB_RELEASE),
    "requeue": (JobState.PENDING, PendingReason.REQUEUED, AuditAction.JOB_REQUEUE),
}


def act_on_jobs(verb: str, job_ids: Sequence[int], *, actor: AbstractBaseUser, target: str) -> ActionOutcome:
    """Cancel, hold, release or requeue many jobs at once — the members of an array, or a range
    of them (``scancel 74``, ``scancel 74_[1-5]``) — in one transaction, set-based: one move per
    source state (``transition_jobs``: the same table, compare-and-set and events as one job's
    move). Jobs whose state the action does not apply to are left alone and counted; so are
    operators' holds when a user who is not an operator releases. One audit entry names
    ``target`` (``array:74``, ``jobs:74_[1-5]``). Permission is the caller's."""
    to, reason, audit_as = _ACTION_TARGETS[verb]
    if verb == "hold" and actor.is_staff:
        reason = PendingReason.HELD_BY_OPERATOR
    ids = list(job_ids)
    with transaction.atomic():
        if verb == "release" and not actor.is_staff:
            ids = list(
                Job.objects.filter(pk__in=ids).exclude(reason__in=OPERATOR_HOLDS).values_list("pk", flat=True)
            )
        moved: list[int] = []
        for state in sorted(ACTION_SOURCES[verb] & allowed_sources(to)):
            moved += transition_jobs(
                ids,
                to,
                only_from=state,
                actor=actor,
                reason=reason,
                message=_by(actor, _DONE[verb]),
            )
        if moved:
            audit.record(audit_as, actor=actor, target=target[:255], details=audit.capped(sorted(moved)))
    return ActionOutcome(moved=sorted(moved), unchanged=len(job_ids) - len(moved))


def requeue_job(job: Job, *, actor: AbstractBaseUser | None, message: str = "") -> Job:
    """Stop the job's current attempt and put the job back in the queue; the next placement is
    a new attempt of the same job."""
    return transition_job(
        job.pk,
        JobState.PENDING,
        actor=actor,
        reason=PendingReason.REQUEUED,
        message=message or _by(actor, "requeued"),
        audit_as=AuditAction.JOB_REQUEUE,
        only_from=ACTION_SOURCES["requeue"],
    )


def checkpoint_job(job: Job, *, actor: AbstractBaseUser | None) -> Job:
    """Record that the job has just saved its work: ``checkpointed_at`` = now. The scheduler
    counts the work a preemption would lose from this stamp (or from the attempt's start, if
    later), so a job that checkpoints often is the cheaper victim. Only while the job is active
    (placed, running, or draining after a preemption — when a job checkpoints most); raises
    ``NotActive`` otherwise. Not a transition: no event and no audit entry, as a job may stamp
    every few minutes. Returns the job with the new stamp."""
    now = timezone.now()
    if not Job.objects.filter(pk=job.pk, state__in=ACTIVE_STATES).update(checkpointed_at=now):
        state = Job.objects.values_list("state", flat=True).get(pk=job.pk)
        raise NotActive(f"job {job.ref} is {state}: only a placed or running job can record a checkpoint")
    job.checkpointed_at = now
    return job


def _by(actor: AbstractBaseUser | None, verb: str) -> str:
    return f"{verb} by {actor.get_username()}" if actor is not None else verb
