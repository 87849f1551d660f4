"""Job states, pending reasons, attempt states and policies.

Job states keep the upper-case names Slurm users know (``PENDING``, ``RUNNING``): they are shown
verbatim by the API, the CLI and the portal, so the stored value is the displayed one.
"""

from django.db import models


class JobState(models.TextChoices):
    PENDING = "PENDING", "Pending"
    HELD = "HELD", "Held"
    SCHEDULED = "SCHEDULED", "Scheduled"
    STARTING = "STARTING", "Starting"
    RUNNING = "RUNNING", "Running"
    COMPLETING = "COMPLETING", "Completing"
    SUCCEEDED = "SUCCEEDED", "Succeeded"
    FAILED = "FAILED", "Failed"
    TIMEOUT = "TIMEOUT", "Timed out"
    CANCELLED = "CANCELLED", "Cancelled"
    PREEMPTED = "PREEMPTED", "Preempted"


# Slurm's short codes, for CLI tables (squeue's %t).
SHORT_CODES: dict[str, str] = {
    JobState.PENDING: "PD",
    JobState.HELD: "PD",
    JobState.SCHEDULED: "CF",
    JobState.STARTING: "CF",
    JobState.RUNNING: "R",
    JobState.COMPLETING: "CG",
    JobState.SUCCEEDED: "CD",
    JobState.FAILED: "F",
    JobState.TIMEOUT: "TO",
    JobState.CANCELLED: "CA",
    JobState.PREEMPTED: "PR",
}

TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.TIMEOUT, JobState.CANCELLED})
WAITING_STATES = frozenset({JobState.PENDING, JobState.HELD})
# States in which a job holds an active attempt and its allocations. PREEMPTED is one of them:
# a preempted job keeps its GPUs while it drains (its signal, then its grace period), then it is
# requeued — PENDING again, same id, a new attempt next time it is placed.
ACTIVE_STATES = frozenset(
    {JobState.SCHEDULED, JobState.STARTING, JobState.RUNNING, JobState.COMPLETING, JobState.PREEMPTED}
)


class PendingReason(models.TextChoices):
    """Why a job waits, with Slurm's reason names where Slurm has one."""

    NONE = "None", "Not yet considered"
    RESOURCES = "Resources", "Not enough free resources"
    PRIORITY = "Priority", "Higher-priority jobs go first"
    QUOTA_EXCEEDED = "QuotaExceeded", "The queue's quota is used up"
    CLUSTER_UNAVAILABLE = "ClusterUnavailable", "No eligible cluster is available"
    HELD = "Held", "Held by its owner or a project manager"
    HELD_BY_OPERATOR = "JobHeldAdmin", "Held by an operator"
    DEPENDENCY = "Dependency", "Waiting for another job"
    REQUEUED = "Requeued", "Requeued; waiting to be placed again"
    NODE_LOST = "NodeLost", "Its node was lost"
    PREEMPTED = "Preempted", "Preempted by a job with a better claim; requeued"
    DEPENDENCY_NEVER = "DependencyNeverSatisfied", "Its dependency can never be met"
    MAX_JOBS_PER_USER = "QOSMaxJobsPerUserLimit", "Its owner runs as many jobs as the queue allows"
    MAX_GPUS_PER_USER = "QOSMaxGRESPerUser", "Its owner holds as many GPUs as the queue allows"
    ARRAY_TASK_LIMIT = "JobArrayTaskLimit", "Its array runs as many tasks as its throttle allows"
    BUDGET_EXHAUSTED = "BudgetExhausted", "Its project's GPU-hour budget is used up"


class PreemptWithinQueue(models.TextChoices):
    """Whether a queue's pending job may preempt running jobs of the same queue."""

    NEVER = "never", "Never"
    LOWER_PRIORITY = "lower_priority", "Jobs of lower priority"


class ReclaimWithinCohort(models.TextChoices):
    """Whether a queue's pending job may preempt jobs of other queues of its cohort that run on
    quota it lent them (only while the queue is within its own nominal quota)."""

    NEVER = "never", "Never"
    LOWER_PRIORITY = "lower_priority", "Borrowing jobs of lower priority"
    ANY = "any", "Borrowing jobs of any priority up to its own"


class AttemptState(models.TextChoices):
    SCHEDULED = "scheduled", "Scheduled"
    STARTING = "starting", "Starting"
    RUNNING = "running", "Running"
    COMPLETING = "completing", "Completing"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    TIMEOUT = "timeout", "Timed out"
    CANCELLED = "cancelled", "Cancelled"
    PREEMPTED = "preempted", "Preempted"
    REQUEUED = "requeued", "Requeued"
    NODE_FAIL = "node_fail", "Node failed"


# The attempt state a job state carries its active attempt to.
ATTEMPT_STATE_FOR: dict[str, str] = {
    JobState.SCHEDULED: AttemptState.SCHEDULED,
    JobState.STARTING: AttemptState.STARTING,
    JobState.RUNNING: AttemptState.RUNNING,
    JobState.COMPLETING: AttemptState.COMPLETING,
    JobState.SUCCEEDED: AttemptState.SUCCEEDED,
    JobState.FAILED: AttemptState.FAILED,
    JobState.TIMEOUT: AttemptState.TIMEOUT,
    JobState.CANCELLED: AttemptState.CANCELLED,
    JobState.PREEMPTED: AttemptState.PREEMPTED,
    JobState.PENDING: AttemptState.REQUEUED,
    JobState.HELD: AttemptState.REQUEUED,
}


class FailoverPolicy(models.TextChoices):
    """What happens to a job whose node is lost."""

    REQUEUE = "requeue", "Requeue on another node"
    HOLD = "hold", "Hold for an operator"
    FAIL = "fail", "Fail the job"


class EventKind(models.TextChoices):
    SUBMITTED = "submitted", "Submitted"
    TRANSITION = "transition", "State changed"
    NOTE = "note", "Note"
    UPDATED = "updated", "Changed by a user"


class DependencyKind(models.TextChoices):
    """Slurm's dependency types (``singleton`` is stored as ``afterany`` on the earlier jobs of
    the same name and owner)."""

    AFTEROK = "afterok", "After it succeeds"
    AFTERANY = "afterany", "After it ends"
    AFTERNOTOK = "afternotok", "After it fails, times out or is cancelled"


class DependencyState(models.TextChoices):
    WAITING = "waiting", "Waiting"
    MET = "met", "Met"
    NEVER = "never", "Can never be met"


class BudgetOverrun(models.TextChoices):
    """What admission does with a job whose requested GPU-hours exceed what is left."""

    REFUSE = "refuse", "Refuse the submission"
    HOLD = "hold", "Accept it held until the budget is raised"


class NotificationEvent(models.TextChoices):
    ENDED = "ended", "Ended (any way)"
    FAILED = "failed", "Failed"
    TIMEOUT = "timeout", "Timed out"
    PREEMPTED = "preempted", "Preempted"
    TEST = "test", "A test message the user asked for"


# What a user may subscribe to (a test message is sent only when asked for).
SUBSCRIBABLE_EVENTS: list[tuple[str, str]] = [
    (value, label) for value, label in NotificationEvent.choices if value != NotificationEvent.TEST
]


class NotificationChannel(models.TextChoices):
    EMAIL = "email", "Email"
    WEBHOOK = "webhook", "Webhook"


class DeliveryState(models.TextChoices):
    PENDING = "pending", "Pending"
    SENT = "sent", "Sent"
    FAILED = "failed", "Failed"
