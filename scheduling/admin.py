"""Operations console for queues and jobs. Job state changes only through the actions, which
call the same services as the API; a job's history, attempts and allocations are read-only, and
so are the scheduler's estimates and a job's checkpoint stamp."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from clusters.selectors import resolve_gpu_model
from foundation.console import ReadOnlyAdminMixin, ReadOnlyInline, service_action
from scheduling.models import Allocation, Budget, Job, JobAttempt, JobEvent, Queue, QueueQuota
from scheduling.services.budget_holds import create_budget, release_fitting, update_budget
from scheduling.services.budgets import BudgetExhausted, hours, left_gpu_seconds
from scheduling.services.jobs import cancel_job, hold_job, release_job, requeue_job
from scheduling.services.transitions import InvalidTransition, TransitionConflict
from scheduling.spec import MAX_GPU_MODELS, MAX_PREEMPTION_GRACE_S

_REFUSALS = (InvalidTransition, TransitionConflict, BudgetExhausted)


class QueueQuotaInline(admin.TabularInline):
    model = QueueQuota
    extra = 1


class GpuModelListField(forms.CharField):
    """GPU models typed comma-separated, best first (``h100, a100-80g``); a list of names to
    the form's ``clean`` (the model's JSON list)."""

    def prepare_value(self, value: Any) -> Any:
        return ", ".join(map(str, value)) if isinstance(value, list) else value

    def to_python(self, value: Any) -> list[str]:
        text = super().to_python(value)
        return [part.strip() for part in text.split(",") if part.strip()]


class QueueForm(forms.ModelForm):
    """A queue, with its preemption settings checked: a grace period an operator would accept
    (0 to 1 hour, the most a job may ask for) and GPU models that exist (aliases become slugs)."""

    preemption_grace_s = forms.IntegerField(
        min_value=0,
        max_value=MAX_PREEMPTION_GRACE_S,
        initial=30,
        label="Preemption grace (s)",
        help_text="Seconds a preempted job has between its signal and SIGKILL; also the most a job "
        "may ask for (0–3600).",
    )
    gpu_model_preference = GpuModelListField(
        required=False,
        max_length=2000,
        label="GPU model preference",
        help_text="GPU models, best first, comma-separated (h100-80g, a100-80g), that a job asking "
        "for any model tries in order; empty: the models the queue has quota for, then every other.",
    )

    class Meta:
        model = Queue
        fields = [
            "project",
            "name",
            "priority",
            "fair_share_weight",
            "cohort",
            "max_running_jobs_per_user",
            "max_gpus_per_user",
            "max_pending_jobs",
            "max_pending_jobs_per_user",
            "max_member_priority",
            "max_time_limit_s",
            "preempt_within_queue",
            "reclaim_within_cohort",
            "preemption_grace_s",
            "gpu_model_preference",
        ]
        help_texts = {
            "max_running_jobs_per_user": "Jobs one user may run in this queue at once (placed, running or "
            "draining); the next waits with QOSMaxJobsPerUserLimit. Empty: no limit.",
            "max_gpus_per_user": "GPUs one user's jobs may hold in this queue at once; a job that would "
            "pass it waits with QOSMaxGRESPerUser. Empty: no limit.",
        }

    def clean_gpu_model_preference(self) -> list[str]:
        names = self.cleaned_data["gpu_model_preference"]
        if len(names) > MAX_GPU_MODELS:
            raise forms.ValidationError(f"List at most {MAX_GPU_MODELS} GPU models.")
        slugs: list[str] = []
        for name in names:
            model = resolve_gpu_model(name[:120])
            if model is None:
                raise forms.ValidationError(f"Unknown GPU model '{name[:120]}'.")
            if model.slug in slugs:
                raise forms.ValidationError(f"'{name[:120]}' is {model.slug}, listed already.")
            slugs.append(model.slug)
        return slugs


@admin.register(Queue)
class QueueAdmin(admin.ModelAdmin):
    form = QueueForm
    list_display = [
        "__str__",
        "project",
        "priority",
        "fair_share_weight",
        "cohort",
        "quota_summary",
        "preempt_within_queue",
        "reclaim_within_cohort",
        "preemption_grace_s",
    ]
    list_filter = ["project", "cohort"]
    list_select_related = ["project"]
    search_fields = ["name", "project__name", "cohort"]
    inlines = [QueueQuotaInline]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Queue]:
        return super().get_queryset(request).prefetch_related("quotas__gpu_model")

    @admin.display(description="Quota")
    def quota_summary(self, obj: Queue) -> str:
        return ", ".join(f"{q.gpus} {q.gpu_model.slug}" for q in obj.quotas.all()) or "—"


class JobEventInline(ReadOnlyInline):
    model = JobEvent
    fields = ["at", "kind", "from_state", "to_state", "reason", "message", "actor"]
    readonly_fields = fields


class JobAttemptInline(ReadOnlyInline):
    model = JobAttempt
    fields = [
        "number",
        "id",
        "cluster",
        "state",
        "active",
        "epoch",
        "remote_id",
        "exit_code",
        "created_at",
        "started_at",
        "finished_at",
        "stop_requested_at",
        "stop_signal",
        "stop_grace_s",
        "signalled_at",
    ]
    readonly_fields = fields


class AllocationInline(ReadOnlyInline):
    model = Allocation
    fields = [
        "attempt",
        "node",
        "gpu",
        "cpu_millicores",
        "memory_bytes",
        "active",
        "allocated_at",
        "released_at",
    ]
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Allocation]:
        return super().get_queryset(request).select_related("attempt", "node__cluster", "gpu__node__cluster")


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "name",
        "owner",
        "project",
        "queue",
        "state",
        "reason",
        "gpu_request",
        "submitted_at",
        "finished_at",
    ]
    list_filter = ["state", "reason", "project", "queue", "gpu_model", "preemptible", "reserved"]
    list_select_related = ["owner", "project", "queue__project", "gpu_model"]
    search_fields = ["=id", "name", "owner__username", "project__name"]
    date_hierarchy = "submitted_at"
    inlines = [JobEventInline, JobAttemptInline, AllocationInline]
    actions = [
        service_action(cancel_job, name="cancel", description="Cancel selected jobs", refusals=_REFUSALS),
        service_action(hold_job, name="hold", description="Hold selected jobs", refusals=_REFUSALS),
        service_action(release_job, name="release", description="Release selected jobs", refusals=_REFUSALS),
        service_action(requeue_job, name="requeue", description="Requeue selected jobs", refusals=_REFUSALS),
    ]
    fields = [
        "name",
        "owner",
        "project",
        "queue",
        "state",
        "reason",
        "reason_message",
        "priority",
        "nodes",
        "gpu_model",
        "gpus_per_node",
        "cpu_millicores_per_node",
        "memory_bytes_per_node",
        "time_limit_s",
        "preemptible",
        "checkpointed_at",
        "estimated_start_at",
        "estimated_where",
        "reserved",
        "command",
        "labels",
        "placement",
        "spec",
        "retries",
        "failover_policy",
        "idempotency_key",
        "submitted_at",
        "started_at",
        "finished_at",
        "exit_code",
        "attempt_count",
    ]
    # Only the priority is edited in place; everything else is the user's request or the
    # scheduler's record, and changes through services.
    readonly_fields = [f for f in fields if f != "priority"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # jobs are submitted through the API, the CLI or the portal

    def has_delete_permission(self, request: HttpRequest, obj: Job | None = None) -> bool:
        return False  # job history is append-only: a job ends (cancel), it is never erased

    @admin.display(description="GPUs")
    def gpu_request(self, obj: Job) -> str:
        if not obj.gpus_per_node:
            return "—"
        models = (obj.placement or {}).get("gpuModels") or []
        model = obj.gpu_model.slug if obj.gpu_model else "|".join(map(str, models)) or "any model"
        per_node = f"{obj.gpus_per_node}×{model}"
        return per_node if obj.nodes == 1 else f"{obj.nodes} nodes × {per_node}"


@admin.register(JobAttempt)
class JobAttemptAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["id", "job", "number", "cluster", "state", "active", "epoch", "created_at"]
    list_filter = ["state", "active", "cluster"]
    list_select_related = ["job", "cluster"]
    search_fields = ["=id", "=job__id", "remote_id"]


@admin.register(Allocation)
class AllocationAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["id", "job", "node", "gpu", "cpu_millicores", "memory_bytes", "active", "allocated_at"]
    list_filter = ["active", "node__cluster"]
    list_select_related = ["job", "node__cluster", "gpu__node__cluster"]
    search_fields = ["=job__id", "node__name"]


@admin.register(JobEvent)
class JobEventAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["at", "job", "kind", "from_state", "to_state", "reason", "actor"]
    list_filter = ["kind", "to_state"]
    list_select_related = ["job", "actor"]
    search_fields = ["=job__id", "message"]


# --- GPU-hour budgets ---------------------------------------------------------------------------


class BudgetForm(forms.ModelForm):
    """A budget as operators set it: a queue, if given, must be one of the project's."""

    class Meta:
        model = Budget
        fields = ["project", "queue", "starts_at", "ends_at", "gpu_hours", "on_overrun"]

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        project, queue = data.get("project"), data.get("queue")
        if queue is not None and project is not None and queue.project_id != project.pk:
            self.add_error("queue", f"queue {queue} is not one of project {project}'s")
        return data


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin):
    """Operators create budgets and raise (or lower) them here. Saving goes through
    ``budget_holds``: only the limit, the window's end and the overrun policy are written —
    never ``used``/``reserved``, which admissions keep moving — and held jobs that now fit are
    released. A budget is never deleted (its charges are the period's record): end its window."""

    form = BudgetForm
    list_display = [
        "__str__",
        "project",
        "queue",
        "starts_at",
        "ends_at",
        "gpu_hours",
        "used_hours",
        "reserved_hours",
        "left_hours",
        "percent_used",
        "on_overrun",
    ]
    list_filter = ["project", "on_overrun"]
    list_select_related = ["project", "queue__project"]
    search_fields = ["project__name", "queue__name"]
    date_hierarchy = "starts_at"
    readonly_fields = ["used_hours", "reserved_hours", "left_hours", "percent_used"]
    actions = [
        service_action(
            lambda budget, actor: release_fitting(
                [budget.project_id], actor=actor, message=f"released: budget {budget} has room"
            ),
            name="release_held",
            description="Release held jobs that fit now",
            refusals=(),
        )
    ]

    def get_fields(self, request: HttpRequest, obj: Budget | None = None) -> list[str]:
        return [*BudgetForm.Meta.fields, *self.readonly_fields]

    def get_readonly_fields(self, request: HttpRequest, obj: Budget | None = None) -> list[str]:
        fixed = ["project", "queue", "starts_at"] if obj is not None else []  # its charges hang on these
        return [*fixed, *self.readonly_fields]

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: Budget, form: forms.ModelForm, change: bool) -> None:
        data = form.cleaned_data
        if not change:
            created = create_budget(
                project=data["project"],
                queue=data.get("queue"),
                starts_at=data["starts_at"],
                ends_at=data["ends_at"],
                gpu_hours=data["gpu_hours"],
                on_overrun=data["on_overrun"],
                actor=request.user,
            )
            obj.pk, obj.created_at, obj._state.adding = created.pk, created.created_at, False
            return
        changed = {
            name: data[name] for name in ("gpu_hours", "ends_at", "on_overrun") if name in form.changed_data
        }
        released = update_budget(obj, actor=request.user, **changed) if changed else []
        if released:
            self.message_user(
                request, f"{len(released)} held job(s) released: the budget now has room for them."
            )

    @admin.display(description="Used (GPU-h)")
    def used_hours(self, obj: Budget) -> str:
        return hours(obj.used_gpu_seconds)

    @admin.display(description="Reserved (GPU-h)")
    def reserved_hours(self, obj: Budget) -> str:
        return hours(obj.reserved_gpu_seconds)

    @admin.display(description="Left (GPU-h)")
    def left_hours(self, obj: Budget) -> str:
        return hours(left_gpu_seconds(obj))

    @admin.display(description="Used or reserved")
    def percent_used(self, obj: Budget) -> str:
        limit = obj.gpu_hours * 3600
        spent = obj.used_gpu_seconds + obj.reserved_gpu_seconds
        return f"{100 * spent / limit:.1f} %" if limit else "—"
