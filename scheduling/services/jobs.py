"""Writes on jobs that users and operators ask for: submit, cancel, hold, release, requeue.

The API, the CLI and the admin all call these; none of them changes a job any other way.
Permission checks happen before, in ``portal.access``; these functions trust their caller.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction

from clusters.live import publish_on_commit
from clusters.models import GpuModel
from scheduling.choices import ACTIVE_STATES, EventKind, FailoverPolicy, JobState, PendingReason
from scheduling.events import JobStateChanged, job_groups
from scheduling.models import Job, JobEvent, Queue
from scheduling.services.transitions import transition_job


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
    retries: int = 0
    failover_policy: str = FailoverPolicy.HOLD
    spec: dict[str, Any] = field(default_factory=dict)

    def digest(self) -> str:
        """A stable hash of what was asked, to tell a retry from a different request."""
        body = asdict(self) | {"queue": self.queue.pk, "gpu_model": self.gpu_model and self.gpu_model.slug}
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


class IdempotencyConflict(Exception):
    """The idempotency key was used before for a different request."""

    def __init__(self, job: Job) -> None:
        self.job = job
        super().__init__(f"idempotency key already used for a different request (job {job.pk}).")


def submit_job(
    request: JobRequest, *, actor: AbstractBaseUser, idempotency_key: str | None = None
) -> tuple[Job, bool]:
    """Create a PENDING job; returns ``(job, created)``.

    With an ``idempotency_key``, a retry of the same request returns the job made the first time
    (``created`` False) and creates nothing; the same key with a different request raises
    ``IdempotencyConflict``. The unique constraint on ``(owner, idempotency_key)`` settles races
    between concurrent retries.
    """
    digest = request.digest()
    if idempotency_key:
        existing = Job.objects.filter(owner=actor, idempotency_key=idempotency_key).first()
        if existing is not None:
            return _same_request(existing, digest), False
    try:
        with transaction.atomic():
            job = Job.objects.create(
                owner=actor,
                project_id=request.queue.project_id,
                queue=request.queue,
                name=request.name,
                labels=request.labels,
                priority=request.priority,
                nodes=request.nodes,
                gpu_model=request.gpu_model,
                gpus_per_node=request.gpus_per_node,
                cpu_millicores_per_node=request.cpu_millicores_per_node,
                memory_bytes_per_node=request.memory_bytes_per_node,
                time_limit_s=request.time_limit_s,
                command=request.command,
                spec=request.spec,
                placement=request.placement,
                retries=request.retries,
                failover_policy=request.failover_policy,
                idempotency_key=idempotency_key or None,
                request_digest=digest,
                state=JobState.PENDING,
                reason=PendingReason.NONE,
            )
            JobEvent.objects.create(
                job=job,
                kind=EventKind.SUBMITTED,
                to_state=JobState.PENDING,
                actor=actor,
                message=f"submitted to {request.queue}",
            )
            publish_on_commit(
                job_groups(job.pk, job.project_id),
                JobStateChanged(
                    job.pk, job.project_id, "", JobState.PENDING, job.reason, job.submitted_at.isoformat()
                ),
            )
    except IntegrityError:
        if not idempotency_key:
            raise
        # A concurrent retry with the same key committed first: answer with its job.
        existing = Job.objects.get(owner=actor, idempotency_key=idempotency_key)
        return _same_request(existing, digest), False
    return job, True


def _same_request(job: Job, digest: str) -> Job:
    if job.request_digest != digest:
        raise IdempotencyConflict(job)
    return job


def explain_pending(job_id: int, reason: str, message: str) -> bool:
    """Record why a pending job waits (the scheduler's verdict). Not a transition, so no event;
    touches the job only while it is PENDING. Returns whether it did."""
    updated = Job.objects.filter(pk=job_id, state=JobState.PENDING).update(
        reason=PendingReason(reason), reason_message=message[:512]
    )
    return updated == 1


def cancel_job(job: Job, *, actor: AbstractBaseUser | None, message: str = "") -> Job:
    """Cancel a job in any non-final state; its attempt ends and its GPUs are released."""
    return transition_job(job.pk, JobState.CANCELLED, actor=actor, message=message or _by(actor, "cancelled"))


def hold_job(job: Job, *, actor: AbstractBaseUser | None, message: str = "") -> Job:
    """Keep a pending job from being scheduled until it is released."""
    return transition_job(
        job.pk,
        JobState.HELD,
        actor=actor,
        reason=PendingReason.HELD,
        message=message or _by(actor, "held"),
        only_from=[JobState.PENDING],
    )


def release_job(job: Job, *, actor: AbstractBaseUser | None, message: str = "") -> Job:
    """Return a held job to the queue."""
    return transition_job(
        job.pk,
        JobState.PENDING,
        actor=actor,
        reason=PendingReason.NONE,
        message=message or _by(actor, "released"),
        only_from=[JobState.HELD],
    )


def requeue_job(job: Job, *, actor: AbstractBaseUser | None, message: str = "") -> Job:
    """Stop the job's current attempt and put the job back in the queue; the next placement is
    a new attempt of the same job."""
    return transition_job(
        job.pk,
        JobState.PENDING,
        actor=actor,
        reason=PendingReason.REQUEUED,
        message=message or _by(actor, "requeued"),
        only_from=ACTIVE_STATES,
    )


def _by(actor: AbstractBaseUser | None, verb: str) -> str:
    return f"{verb} by {actor.get_username()}" if actor is not None else verb
