"""Queues, jobs, attempts, allocations and the append-only job history.

The invariants that must never break are enforced by the database, not by the code above it:

* ``alloc_one_active_per_gpu`` — no GPU has two active allocations (partial unique index);
* ``attempt_one_active_per_job`` — a job has at most one active attempt (partial unique index);
* ``job_unique_idempotency_key`` — ``(owner, idempotency_key)`` is unique;
* check constraints keep every capacity, quota and request non-negative.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q

from clusters.models import Cluster, GpuDevice, GpuModel, MigInstance, Node, slug_validator
from scheduling.choices import (
    SHORT_CODES,
    TERMINAL_STATES,
    AttemptState,
    BudgetOverrun,
    DeliveryState,
    DependencyKind,
    DependencyState,
    EventKind,
    FailoverPolicy,
    JobState,
    NotificationChannel,
    NotificationEvent,
    PendingReason,
    PreemptWithinQueue,
    ReclaimWithinCohort,
)


class Queue(models.Model):
    """A project's queue: its priority, fair-share weight, per-GPU-model quota (``QueueQuota``),
    an optional cohort whose members may borrow each other's idle quota, and per-user limits."""

    project = models.ForeignKey("portal.Project", on_delete=models.CASCADE, related_name="queues")
    name = models.CharField(max_length=63, validators=[slug_validator])
    priority = models.IntegerField(default=0, help_text="Higher runs first across queues.")
    fair_share_weight = models.FloatField(default=1.0, validators=[MinValueValidator(0.0)])
    cohort = models.CharField(
        max_length=63, blank=True, help_text="Queues of one cohort lend each other idle quota."
    )
    max_running_jobs_per_user = models.PositiveIntegerField(null=True, blank=True)
    max_gpus_per_user = models.PositiveIntegerField(null=True, blank=True)
    max_pending_jobs = models.PositiveIntegerField(
        null=True, blank=True, help_text="Submissions beyond this many pending jobs are refused."
    )
    max_pending_jobs_per_user = models.PositiveIntegerField(
        null=True, blank=True, help_text="Per user: submissions beyond this many waiting jobs are refused."
    )
    max_member_priority = models.IntegerField(
        default=100,
        help_text="The highest priority a member may ask for; managers and operators may go higher.",
    )
    max_time_limit_s = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="The longest time limit a job may ask for, in seconds; also the limit of jobs that "
        "give none.",
    )
    preempt_within_queue = models.CharField(
        max_length=16,
        choices=PreemptWithinQueue.choices,
        default=PreemptWithinQueue.NEVER,
        help_text="May a pending job preempt running jobs of lower priority in this queue?",
    )
    reclaim_within_cohort = models.CharField(
        max_length=16,
        choices=ReclaimWithinCohort.choices,
        default=ReclaimWithinCohort.NEVER,
        help_text="May a pending job within this queue's nominal quota preempt jobs of other queues "
        "of the cohort that run on quota this queue lent them?",
    )
    preemption_grace_s = models.PositiveIntegerField(
        default=30,
        help_text="Seconds a preempted job has between its signal and SIGKILL; also the most a job "
        "may ask for.",
    )
    gpu_model_preference = models.JSONField(
        default=list,
        blank=True,
        help_text="GPU model slugs, best first, that a job asking for any model tries in order "
        "(empty: the models the queue has quota for, then every other).",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["project_id", "name"]
        constraints = [
            models.UniqueConstraint(fields=["project", "name"], name="queue_unique_name_per_project"),
            models.CheckConstraint(
                condition=Q(fair_share_weight__gte=0),
                name="queue_weight_nonneg",
                violation_error_message="The fair-share weight cannot be negative.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.project.name}/{self.name}"


class QueueQuota(models.Model):
    """How many GPUs of one model a queue may hold at once (its nominal quota), and how many more
    it may borrow from idle quota of its cohort (``borrowing_limit``; null = no limit)."""

    queue = models.ForeignKey(Queue, on_delete=models.CASCADE, related_name="quotas")
    gpu_model = models.ForeignKey(GpuModel, on_delete=models.PROTECT, related_name="quotas")
    gpus = models.IntegerField(help_text="Nominal quota in GPUs.")
    borrowing_limit = models.IntegerField(null=True, blank=True)

    class Meta:
        ordering = ["queue_id", "gpu_model_id"]
        constraints = [
            models.UniqueConstraint(fields=["queue", "gpu_model"], name="quota_unique_per_queue_model"),
            models.CheckConstraint(
                condition=Q(gpus__gte=0) & (Q(borrowing_limit__isnull=True) | Q(borrowing_limit__gte=0)),
                name="quota_nonneg",
                violation_error_message="Quotas and borrowing limits cannot be negative.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.queue}: {self.gpus} × {self.gpu_model.slug}"


class Job(models.Model):
    """The user's request. It outlives its executions (``JobAttempt``); ``state`` changes only
    through ``scheduling.services.transitions.transition_job``."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs")
    project = models.ForeignKey("portal.Project", on_delete=models.PROTECT, related_name="jobs")
    queue = models.ForeignKey(Queue, on_delete=models.PROTECT, related_name="jobs")
    name = models.CharField(max_length=128)
    labels = models.JSONField(default=dict, blank=True)

    state = models.CharField(max_length=12, choices=JobState.choices, default=JobState.PENDING)
    reason = models.CharField(
        max_length=24, choices=PendingReason.choices, default=PendingReason.NONE, blank=True
    )
    reason_message = models.CharField(max_length=512, blank=True)
    version = models.PositiveIntegerField(default=0, help_text="Bumped by every transition.")

    priority = models.IntegerField(default=0)
    nodes = models.PositiveIntegerField(default=1, help_text="Nodes; more than one makes a gang.")
    gpu_model = models.ForeignKey(GpuModel, on_delete=models.PROTECT, null=True, blank=True)
    gpus_per_node = models.PositiveIntegerField(default=0)
    # A GPU smaller than a whole one (``docs/scheduling-policies.md``, fine-grained GPUs): a MIG
    # instance of this profile (``gpus_per_node`` of them), or one fraction of a GPU an operator
    # marked shareable, by memory or by share of the whole.
    gpu_slice = models.CharField(
        max_length=32, blank=True, default="", db_default="", help_text='A MIG profile, e.g. "1g.10gb".'
    )
    gpu_memory_mb = models.PositiveIntegerField(
        default=0, db_default=0, help_text="A shared GPU's memory for this job (MiB); 0: not shared."
    )
    gpu_share = models.FloatField(
        null=True, blank=True, help_text="A shared GPU's fraction for this job (0–1); empty: not shared."
    )
    cpu_millicores_per_node = models.BigIntegerField(default=0)
    memory_bytes_per_node = models.BigIntegerField(default=0)
    time_limit_s = models.PositiveIntegerField(null=True, blank=True)
    preemptible = models.BooleanField(default=True, db_default=True, help_text="False: never preempted.")
    checkpointed_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When the job last saved its work (less to lose if preempted).",
    )
    estimated_start_at = models.DateTimeField(
        null=True, blank=True, help_text="When the scheduler expects a pending job to start."
    )
    estimated_where = models.CharField(
        max_length=255,
        blank=True,
        default="",
        db_default="",
        help_text="The cluster and nodes it expects the job to start on.",
    )
    reserved = models.BooleanField(
        default=False,
        db_default=False,
        help_text="The estimate is a reservation: jobs behind it may not delay it.",
    )
    command = models.TextField(blank=True)
    spec = models.JSONField(default=dict, blank=True, help_text="The normalised job spec as accepted.")
    placement = models.JSONField(default=dict, blank=True, help_text="Cluster and label constraints.")
    retries = models.PositiveIntegerField(default=0)
    failover_policy = models.CharField(
        max_length=8, choices=FailoverPolicy.choices, default=FailoverPolicy.HOLD
    )
    secret_env = models.TextField(
        blank=True, help_text="The job's secret environment, sealed (foundation.sealing); never shown."
    )

    # An array: every member carries the array's id (its first member's job id, as in Slurm) and
    # its index; ``array_throttle`` (Slurm's ``%``) caps how many members run at once.
    array_id = models.BigIntegerField(null=True, blank=True)
    array_index = models.PositiveIntegerField(null=True, blank=True)
    array_throttle = models.PositiveIntegerField(null=True, blank=True)
    dependency_pending = models.BooleanField(
        default=False,
        db_default=False,
        help_text="Waits for other jobs (JobDependency): the scheduler does not consider it yet.",
    )
    # Accounting, written when the job ends: GPU-seconds over all its attempts and the cluster of
    # its last attempt.
    gpu_seconds = models.BigIntegerField(default=0, db_default=0)
    ran_on = models.CharField(max_length=63, blank=True, default="", db_default="")

    idempotency_key = models.CharField(max_length=128, null=True, blank=True)
    request_digest = models.CharField(max_length=64, blank=True, help_text="Hash of the submitted body.")

    submitted_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    attempt_count = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["owner", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="job_unique_idempotency_key",
            ),
            models.CheckConstraint(
                condition=Q(nodes__gte=1)
                & Q(gpus_per_node__gte=0)
                & Q(cpu_millicores_per_node__gte=0)
                & Q(memory_bytes_per_node__gte=0),
                name="job_request_nonneg",
                violation_error_message="A job asks for at least one node and no negative resources.",
            ),
            models.CheckConstraint(
                condition=Q(gpus_per_node=0)
                | Q(gpu_model__isnull=False)
                | Q(state__in=[JobState.PENDING, JobState.HELD, JobState.CANCELLED, JobState.FAILED]),
                name="job_placed_gpus_have_model",
                violation_error_message="A job placed on GPUs records their model (a waiting job may ask "
                "for any model).",
            ),
            models.CheckConstraint(condition=Q(state__in=JobState.values), name="job_state_valid"),
            models.CheckConstraint(
                condition=Q(gpu_share__isnull=True) | (Q(gpu_share__gt=0) & Q(gpu_share__lte=1)),
                name="job_gpu_share_fraction",
                violation_error_message="A GPU share is a fraction above 0 and at most 1.",
            ),
        ]
        indexes = [
            models.Index(fields=["state", "queue"], name="job_state_queue_idx"),
            models.Index(fields=["project", "-submitted_at"], name="job_project_recent_idx"),
            models.Index(
                fields=["priority", "submitted_at"],
                condition=Q(state="PENDING"),
                name="job_pending_order_idx",
            ),
            models.Index(
                fields=["array_id", "array_index"],
                condition=Q(array_id__isnull=False),
                name="job_array_idx",
            ),
            # accounting: finished jobs by time, by owner, by project
            models.Index(
                fields=["-finished_at"], condition=Q(finished_at__isnull=False), name="job_finished_idx"
            ),
            models.Index(
                fields=["owner", "-finished_at"],
                condition=Q(finished_at__isnull=False),
                name="job_owner_finished_idx",
            ),
            models.Index(
                fields=["project", "-finished_at"],
                condition=Q(finished_at__isnull=False),
                name="job_project_finished_idx",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.id} {self.name}"

    @property
    def ref(self) -> str:
        """The id users see: ``74`` for a job, ``74_3`` for member 3 of array 74."""
        return f"{self.array_id}_{self.array_index}" if self.array_id is not None else str(self.pk)

    @property
    def short_state(self) -> str:
        return SHORT_CODES[self.state]

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


class JobAttempt(models.Model):
    """One execution of a job. A requeue makes a new attempt of the same job. The id names the
    remote job (a Slurm job name, a Kubernetes Job) so a retried dispatch finds what it created;
    ``epoch`` is the scheduling cycle that made it, the fencing token for dispatch and reports."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField(help_text="1 for the first execution, then 2, 3, …")
    cluster = models.ForeignKey(Cluster, on_delete=models.PROTECT, related_name="attempts")
    state = models.CharField(max_length=12, choices=AttemptState.choices, default=AttemptState.SCHEDULED)
    active = models.BooleanField(default=True)
    epoch = models.BigIntegerField(default=0)
    remote_id = models.CharField(max_length=128, blank=True, help_text="The cluster's own job id.")
    reason = models.CharField(max_length=255, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    # A preemption: when the attempt was asked to stop, with which signal and grace period, and
    # when a polled cluster's job was sent the signal (agents get it with their desired work).
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    stop_signal = models.CharField(max_length=8, blank=True, default="", db_default="")
    stop_grace_s = models.PositiveIntegerField(null=True, blank=True)
    signalled_at = models.DateTimeField(null=True, blank=True)
    master_port = models.PositiveIntegerField(
        null=True, blank=True, help_text="The port a gang's head listens on (MASTER_PORT)."
    )
    # Energy, integrated by the meter from its GPUs' power telemetry while the attempt holds them
    # (``scheduling.services.energy``), with its cost and CO₂ at the cluster's price and intensity
    # of the moment; ``energy_at`` is the meter's last reading.
    energy_wh = models.FloatField(default=0.0, db_default=0.0)
    energy_cost = models.FloatField(default=0.0, db_default=0.0)
    co2_g = models.FloatField(default=0.0, db_default=0.0)
    energy_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job_id", "number"]
        constraints = [
            models.UniqueConstraint(
                fields=["job"], condition=Q(active=True), name="attempt_one_active_per_job"
            ),
            models.UniqueConstraint(fields=["job", "number"], name="attempt_unique_number"),
            models.CheckConstraint(condition=Q(number__gte=1), name="attempt_number_positive"),
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} attempt {self.number}"


class Allocation(models.Model):
    """What an attempt holds on one node: one row per GPU (``gpu`` set) and one node-level row
    (``gpu`` null) carrying its cpu and memory. Rows are released, never deleted, so history
    stays; ``active`` is what the partial unique indexes look at."""

    # The scheduling cycle writes tens of thousands of these rows per second, and each database
    # foreign key costs a lookup and a row lock at commit. The attempt keeps its database key;
    # job (copied from the attempt), node and GPU are guarded by the ORM (PROTECT) and by the
    # index that matters: one active allocation per GPU.
    attempt = models.ForeignKey(JobAttempt, on_delete=models.CASCADE, related_name="allocations")
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="allocations", db_constraint=False)
    node = models.ForeignKey(
        Node, on_delete=models.PROTECT, related_name="allocations", db_constraint=False, db_index=False
    )
    gpu = models.ForeignKey(
        GpuDevice,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="allocations",
        db_constraint=False,
        db_index=False,
    )
    # A MIG instance of ``gpu`` (then ``gpu`` is its parent), or a fraction of a shared ``gpu``
    # (``gpu_memory_mb`` > 0); neither: the whole GPU.
    mig_instance = models.ForeignKey(
        MigInstance,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="allocations",
        db_constraint=False,
        db_index=False,
    )
    gpu_memory_mb = models.PositiveIntegerField(default=0, db_default=0)
    cpu_millicores = models.BigIntegerField(default=0)
    memory_bytes = models.BigIntegerField(default=0)
    active = models.BooleanField(default=True)
    allocated_at = models.DateTimeField(auto_now_add=True)
    released_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["attempt_id", "node_id", "gpu_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["gpu"],
                condition=Q(active=True)
                & Q(gpu__isnull=False)
                & Q(mig_instance__isnull=True)
                & Q(gpu_memory_mb=0),
                name="alloc_one_active_per_gpu",
            ),
            models.UniqueConstraint(
                fields=["mig_instance"],
                condition=Q(active=True) & Q(mig_instance__isnull=False),
                name="alloc_one_active_per_mig_instance",
            ),
            models.CheckConstraint(
                condition=(Q(mig_instance__isnull=True) & Q(gpu_memory_mb=0)) | Q(gpu__isnull=False),
                name="alloc_fraction_names_its_gpu",
            ),
            models.UniqueConstraint(
                fields=["attempt", "node"],
                condition=Q(gpu__isnull=True),
                name="alloc_one_node_row_per_attempt",
            ),
            models.CheckConstraint(
                condition=Q(cpu_millicores__gte=0) & Q(memory_bytes__gte=0),
                name="alloc_resources_nonneg",
            ),
            models.CheckConstraint(
                condition=Q(active=True, released_at__isnull=True)
                | Q(active=False, released_at__isnull=False),
                name="alloc_release_consistent",
            ),
        ]
        indexes = [models.Index(fields=["node"], condition=Q(active=True), name="alloc_active_node_idx")]

    def __str__(self) -> str:
        target = f"gpu {self.gpu_id}" if self.gpu_id else "cpu/memory"
        return f"{self.attempt} on {self.node_id}: {target}"


class JobEvent(models.Model):
    """The append-only history of a job. Rows are inserted, never updated (a database trigger
    refuses UPDATE); every page and the API show a job's life from these."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    attempt = models.ForeignKey(
        JobAttempt, on_delete=models.CASCADE, null=True, blank=True, db_constraint=False, db_index=False
    )
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    kind = models.CharField(max_length=16, choices=EventKind.choices)
    from_state = models.CharField(max_length=12, choices=JobState.choices, blank=True)
    to_state = models.CharField(max_length=12, choices=JobState.choices, blank=True)
    reason = models.CharField(max_length=24, blank=True)
    message = models.TextField(blank=True)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)

    class Meta:
        ordering = ["job_id", "id"]

    def __str__(self) -> str:
        if self.kind == EventKind.TRANSITION:
            return f"{self.from_state} → {self.to_state}"
        return self.get_kind_display()


class SchedulerState(models.Model):
    """One row: the scheduling cycle's epoch, the fencing token every attempt carries. It is
    bumped inside the cycle's transaction, which holds the scheduling lock, so epochs are
    strictly increasing and a cycle that never commits leaves no epoch behind."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    epoch = models.BigIntegerField(default=0)
    last_cycle_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.CheckConstraint(condition=Q(id=1), name="scheduler_state_singleton")]

    def __str__(self) -> str:
        return f"epoch {self.epoch}"


class DispatchOutbox(models.Model):
    """The transactional outbox: a row per decision to act on a cluster (start or stop an
    attempt), written in the same transaction as the decision. Dispatchers deliver rows and mark
    them; a retried delivery finds the remote job by the attempt id instead of creating another."""

    class Kind(models.TextChoices):
        START = "start", "Start"
        STOP = "stop", "Stop"

    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        SENT = "sent", "Sent"
        FAILED = "failed", "Failed"

    attempt = models.ForeignKey(JobAttempt, on_delete=models.CASCADE, related_name="outbox")
    # the attempt's cluster, copied for the dispatchers' index (no key of its own: hot path)
    cluster = models.ForeignKey(
        Cluster, on_delete=models.CASCADE, related_name="outbox", db_constraint=False, db_index=False
    )
    kind = models.CharField(max_length=8, choices=Kind.choices, default=Kind.START)
    state = models.CharField(max_length=8, choices=State.choices, default=State.PENDING)
    epoch = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    tries = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)

    class Meta:
        ordering = ["id"]
        indexes = [
            models.Index(fields=["cluster", "id"], condition=Q(state="pending"), name="outbox_pending_idx")
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.attempt_id} on {self.cluster_id}: {self.state}"


class JobLog(models.Model):
    """The output of one attempt on one node, as its agent shipped it: the newest
    ``MAX_BYTES`` are kept (older output is dropped from the front), with the offset of the
    first byte kept so a resent chunk is recognised and not stored twice."""

    MAX_BYTES = 1 << 20

    attempt = models.ForeignKey(JobAttempt, on_delete=models.CASCADE, related_name="logs")
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="logs", db_constraint=False)
    node = models.CharField(max_length=120)
    start = models.BigIntegerField(default=0, help_text="Offset in the stream of the first byte kept.")
    end = models.BigIntegerField(default=0, help_text="Offset just past the last byte received.")
    text = models.TextField(blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["attempt", "node"], name="joblog_one_per_attempt_node")
        ]

    def __str__(self) -> str:
        return f"log of {self.attempt_id} on {self.node}"


class JobDependency(models.Model):
    """One edge of a dependency: ``job`` may start only when ``target`` has ended as ``kind``
    asks. ``state`` turns ``met`` or ``never`` when the target ends; a job with an edge that can
    never be met is cancelled."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="dependencies")
    target = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="dependents")
    kind = models.CharField(max_length=12, choices=DependencyKind.choices)
    state = models.CharField(max_length=8, choices=DependencyState.choices, default=DependencyState.WAITING)

    class Meta:
        ordering = ["job_id", "target_id"]
        constraints = [
            models.UniqueConstraint(fields=["job", "target", "kind"], name="dependency_unique_edge"),
            models.CheckConstraint(condition=~Q(job=models.F("target")), name="dependency_not_self"),
        ]
        indexes = [
            models.Index(fields=["target"], condition=Q(state="waiting"), name="dependency_waiting_idx")
        ]

    def __str__(self) -> str:
        return f"{self.job_id} {self.kind}:{self.target_id} ({self.state})"


class UsageRollup(models.Model):
    """What the accounting roll-ups share: the key (besides the period and the user) and the
    measures, added to in the transaction that ends each job."""

    project = models.ForeignKey("portal.Project", on_delete=models.CASCADE, related_name="+")
    queue = models.ForeignKey(Queue, on_delete=models.CASCADE, related_name="+", db_constraint=False)
    gpu_model = models.CharField(max_length=63, blank=True, default="")
    cluster = models.CharField(max_length=63, blank=True, default="")
    state = models.CharField(max_length=12, choices=JobState.choices)
    jobs = models.BigIntegerField(default=0)
    gpu_seconds = models.BigIntegerField(default=0)
    elapsed_seconds = models.BigIntegerField(default=0)
    energy_wh = models.FloatField(default=0.0, db_default=0.0)
    energy_cost = models.FloatField(default=0.0, db_default=0.0)
    co2_g = models.FloatField(default=0.0, db_default=0.0)

    class Meta:
        abstract = True


class UsageDay(UsageRollup):
    """The accounting roll-up: finished jobs and their GPU-seconds per day and per project,
    queue, owner, GPU model, cluster and end state, added to in the transaction that ends each
    job. Usage reports read these rows, never the millions of jobs."""

    day = models.DateField()
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+", db_constraint=False
    )

    class Meta:
        ordering = ["day", "project_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["day", "project", "queue", "owner", "gpu_model", "cluster", "state"],
                name="usage_day_unique_key",
            )
        ]

    def __str__(self) -> str:
        return f"{self.day} {self.project_id}/{self.queue_id} {self.gpu_seconds} GPU-s"


class UsageProjectDay(UsageRollup):
    """``UsageDay`` without the owner: finished jobs per day and per project, queue, GPU model,
    cluster and end state, added to by the same upsert in the same transaction. Fleet-wide and
    per-project reports over days (neither grouped nor filtered by user) read these rows: a
    project's day holds one row where ``UsageDay`` holds one per user who ran in it."""

    day = models.DateField()

    class Meta:
        ordering = ["day", "project_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["day", "project", "queue", "gpu_model", "cluster", "state"],
                name="usage_project_day_unique_key",
            )
        ]

    def __str__(self) -> str:
        return f"{self.day} {self.project_id}/{self.queue_id} {self.gpu_seconds} GPU-s"


class UsageMonth(UsageRollup):
    """``UsageDay`` summed by calendar month (``month`` is its first day), added to by the same
    upsert in the same transaction. A report over whole months reads these rows: a month holds
    about a thirtieth of the rows its days do, which keeps a quarter's report per user fast."""

    month = models.DateField()
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+", db_constraint=False
    )

    class Meta:
        ordering = ["month", "project_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["month", "project", "queue", "owner", "gpu_model", "cluster", "state"],
                name="usage_month_unique_key",
            ),
            models.CheckConstraint(condition=Q(month__day=1), name="usage_month_first_day"),
        ]

    def __str__(self) -> str:
        return f"{self.month:%Y-%m} {self.project_id}/{self.queue_id} {self.gpu_seconds} GPU-s"


class Budget(models.Model):
    """GPU-hours a project (or one of its queues) may use between ``starts_at`` and ``ends_at``.
    Admission reserves each job's requested GPU-hours (GPUs × time limit) with a compare-and-set
    that never lets ``used + reserved`` pass the limit; when the job ends, its reservation is
    replaced by what it actually used (``BudgetCharge``)."""

    project = models.ForeignKey("portal.Project", on_delete=models.CASCADE, related_name="budgets")
    queue = models.ForeignKey(Queue, on_delete=models.CASCADE, null=True, blank=True, related_name="budgets")
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField()
    gpu_hours = models.PositiveIntegerField(help_text="The limit, in GPU-hours.")
    used_gpu_seconds = models.BigIntegerField(default=0, help_text="Charged by jobs that ended.")
    reserved_gpu_seconds = models.BigIntegerField(
        default=0, help_text="Requested by admitted jobs that have not ended."
    )
    on_overrun = models.CharField(max_length=8, choices=BudgetOverrun.choices, default=BudgetOverrun.REFUSE)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["project_id", "-starts_at"]
        constraints = [
            models.CheckConstraint(
                condition=Q(ends_at__gt=models.F("starts_at")), name="budget_window_valid"
            ),
            models.CheckConstraint(
                condition=Q(used_gpu_seconds__gte=0) & Q(reserved_gpu_seconds__gte=0),
                name="budget_amounts_nonneg",
            ),
            models.UniqueConstraint(
                fields=["project", "starts_at"],
                condition=Q(queue__isnull=True),
                name="budget_unique_project_window",
            ),
            models.UniqueConstraint(
                fields=["project", "queue", "starts_at"],
                condition=Q(queue__isnull=False),
                name="budget_unique_queue_window",
            ),
        ]

    def __str__(self) -> str:
        where = f"{self.project}/{self.queue.name}" if self.queue_id else str(self.project)
        return f"{where}: {self.gpu_hours} GPU-h from {self.starts_at:%Y-%m-%d}"


class BudgetCharge(models.Model):
    """What one job holds of one budget: its reservation while it waits or runs, its actual
    GPU-seconds once it has ended (``settled``)."""

    budget = models.ForeignKey(Budget, on_delete=models.CASCADE, related_name="charges")
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="budget_charges")
    reserved_gpu_seconds = models.BigIntegerField(default=0)
    charged_gpu_seconds = models.BigIntegerField(default=0)
    settled = models.BooleanField(default=False)

    class Meta:
        ordering = ["budget_id", "job_id"]
        constraints = [models.UniqueConstraint(fields=["budget", "job"], name="charge_unique_per_job")]
        indexes = [models.Index(fields=["job"], condition=Q(settled=False), name="charge_open_idx")]

    def __str__(self) -> str:
        return f"job {self.job_id} on budget {self.budget_id}"


class NotificationSetting(models.Model):
    """A user's notifications: by email and/or to a webhook, for the events they chose."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notifications"
    )
    email = models.BooleanField(default=False, help_text="Send an email to the user's address.")
    webhook_url = models.URLField(max_length=500, blank=True)
    webhook_secret = models.TextField(blank=True, help_text="Signs webhook bodies; sealed, never shown.")
    events = models.JSONField(default=list, blank=True, help_text="NotificationEvent values.")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"notifications of {self.user}"


class Notification(models.Model):
    """The notification outbox: a row per message to deliver, written in the transaction that
    moved the job, so none is lost; delivered (and retried with backoff) afterwards."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="notifications", db_constraint=False)
    event = models.CharField(max_length=12, choices=NotificationEvent.choices)
    channel = models.CharField(max_length=8, choices=NotificationChannel.choices)
    state = models.CharField(max_length=8, choices=DeliveryState.choices, default=DeliveryState.PENDING)
    payload = models.JSONField(default=dict)
    tries = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField()
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]
        indexes = [
            models.Index(
                fields=["next_attempt_at"], condition=Q(state="pending"), name="notification_due_idx"
            )
        ]

    def __str__(self) -> str:
        return f"{self.channel} to {self.user_id}: job {self.job_id} {self.event} ({self.state})"
