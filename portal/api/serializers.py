"""What the API shows. Read-only serializers: input goes through the spec parser and services,
so no field a user sends can set state, owner or attempt data (no mass assignment)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.utils import timezone
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from clusters.adapters.slurm.accounts import check_output_dir
from clusters.adapters.slurm.api import SlurmError
from clusters.choices import Identity
from clusters.models import Cluster, GpuModel, Node, NodeEvent, PosixAccount
from portal.choices import Scope
from portal.models import ApiToken
from scheduling.accounting_selectors import job_energy
from scheduling.choices import SHORT_CODES, WAITING_STATES, JobState
from scheduling.models import Job, JobEvent
from scheduling.refs import array_label, format_spans
from scheduling.selectors import job_placement


class JobSerializer(serializers.ModelSerializer):
    """A job. ``id`` is its job id; ``ref`` the id users see (``74``, or ``74_3`` for member 3
    of array 74). With ``arrays=summary``, a row may stand for the waiting members of an array
    in one state: ``arrayTasks`` then says how many and which (``ref`` names them all)."""

    ref = serializers.SerializerMethodField()
    arrayId = serializers.IntegerField(source="array_id", allow_null=True)
    arrayIndex = serializers.IntegerField(source="array_index", allow_null=True)
    arrayThrottle = serializers.IntegerField(source="array_throttle", allow_null=True)
    arrayTasks = serializers.SerializerMethodField()
    project = serializers.CharField(source="project.name")
    queue = serializers.CharField(source="queue.name")
    owner = serializers.CharField(source="owner.username")
    stateCode = serializers.SerializerMethodField()
    reason = serializers.SerializerMethodField()
    reasonMessage = serializers.SerializerMethodField()
    resources = serializers.SerializerMethodField()
    timeLimitSeconds = serializers.IntegerField(source="time_limit_s", allow_null=True)
    submittedAt = serializers.DateTimeField(source="submitted_at")
    startedAt = serializers.DateTimeField(source="started_at", allow_null=True)
    finishedAt = serializers.DateTimeField(source="finished_at", allow_null=True)
    exitCode = serializers.IntegerField(source="exit_code", allow_null=True)
    attempts = serializers.IntegerField(source="attempt_count")
    placement = serializers.SerializerMethodField()
    energy = serializers.SerializerMethodField()
    preemptible = serializers.BooleanField()
    gpuModel = serializers.SerializerMethodField()
    gpuModels = serializers.SerializerMethodField()
    checkpointedAt = serializers.DateTimeField(source="checkpointed_at", allow_null=True)
    estimatedStart = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = [
            "id",
            "ref",
            "arrayId",
            "arrayIndex",
            "arrayThrottle",
            "arrayTasks",
            "version",
            "name",
            "project",
            "queue",
            "owner",
            "state",
            "stateCode",
            "reason",
            "reasonMessage",
            "priority",
            "labels",
            "resources",
            "timeLimitSeconds",
            "submittedAt",
            "startedAt",
            "finishedAt",
            "exitCode",
            "attempts",
            "placement",
            "energy",
            "preemptible",
            "gpuModel",
            "gpuModels",
            "checkpointedAt",
            "estimatedStart",
        ]
        read_only_fields = fields

    def get_ref(self, job: Job) -> str:
        row = self.context.get("array_rows", {}).get(job.pk)
        if row is not None and not row.elided and row.count > 1:
            return array_label(job.array_id, row.spans)
        return job.ref

    @extend_schema_field(
        {
            "type": "object",
            "nullable": True,
            "properties": {
                "count": {"type": "integer"},
                "indices": {"type": "string"},
                "label": {"type": "string"},
            },
        }
    )
    def get_arrayTasks(self, job: Job) -> dict[str, Any] | None:
        """The waiting members this row stands for (``arrays=summary``): how many, their
        indices (``4-99``; ``…`` when too many ranges to show) and squeue's label
        (``74_[4-99%10]``); null for a row that stands for itself."""
        row = self.context.get("array_rows", {}).get(job.pk)
        if row is None:
            return None
        indices = format_spans(row.spans) + (",…" if row.elided else "")
        label = array_label(job.array_id, row.spans, job.array_throttle)
        if row.elided:
            label = f"{job.array_id}_[{indices}" + (f"%{job.array_throttle}]" if job.array_throttle else "]")
        return {"count": row.count, "indices": indices, "label": label}

    def get_stateCode(self, job: Job) -> str:
        return SHORT_CODES[job.state]

    @extend_schema_field({"type": "string", "nullable": True})
    def get_reason(self, job: Job) -> str | None:
        return job.reason if job.state in _EXPLAINED_STATES else None

    @extend_schema_field({"type": "string", "nullable": True})
    def get_reasonMessage(self, job: Job) -> str | None:
        return reason_sentence(job)

    @extend_schema_field({"type": "object"})
    def get_resources(self, job: Job) -> dict[str, Any]:
        """Per node; smaller than whole GPUs, ``gpus.mig`` (a MIG profile) or ``gpuMemoryMiB`` /
        ``gpuShare`` (a fraction of a shareable GPU) say so."""
        gpus: dict[str, Any] = {
            "model": job.gpu_model.slug if job.gpu_model else None,
            "count": job.gpus_per_node,
        }
        if job.gpu_slice:
            gpus["mig"] = job.gpu_slice
        resources = {
            "nodes": job.nodes,
            "gpus": gpus,
            "cpuMillicores": job.cpu_millicores_per_node,
            "memoryBytes": job.memory_bytes_per_node,
        }
        if job.gpu_memory_mb:
            resources["gpuMemoryMiB"] = job.gpu_memory_mb
        if job.gpu_share is not None:
            resources["gpuShare"] = job.gpu_share
        return resources

    @extend_schema_field({"type": "string", "nullable": True})
    def get_gpuModel(self, job: Job) -> str | None:
        """The model of the job's GPUs: the one it named, or for an any-model job the one the
        scheduler chose when it placed it (null while it waits)."""
        return job.gpu_model.slug if job.gpu_model else None

    @extend_schema_field({"type": "array", "items": {"type": "string"}, "nullable": True})
    def get_gpuModels(self, job: Job) -> list[str] | None:
        """An any-model request's models, best first (empty: any model); null for a job that
        named its model or asked for no GPUs."""
        models = (job.placement or {}).get("gpuModels")
        return list(models) if isinstance(models, list) else None

    @extend_schema_field(
        {
            "type": "object",
            "nullable": True,
            "properties": {
                "at": {"type": "string", "format": "date-time"},
                "where": {"type": "string"},
                "reserved": {"type": "boolean"},
            },
        }
    )
    def get_estimatedStart(self, job: Job) -> dict[str, Any] | None:
        """When and where the scheduler expects a waiting job to start, and whether that is a
        reservation (jobs behind it may not delay it); null when it has no estimate."""
        if job.state not in WAITING_STATES or job.estimated_start_at is None:
            return None
        return {
            "at": serializers.DateTimeField().to_representation(job.estimated_start_at),
            "where": job.estimated_where,
            "reserved": job.reserved,
        }

    @extend_schema_field({"type": "object", "nullable": True})
    def get_placement(self, job: Job) -> dict[str, Any] | None:
        """Where the latest attempt runs or ran: cluster, and per node the GPU indices."""
        placement = job_placement(job)  # prefetched by the views (jobs_with_placement)
        if placement is None:
            return None
        attempt = placement.attempt
        return {
            "attempt": attempt.number,
            "attemptId": str(attempt.pk),
            "cluster": attempt.cluster.name,
            "active": attempt.active,
            "nodes": [{"node": name, "gpus": gpus} for name, gpus in placement.nodes.items()],
        }

    @extend_schema_field(
        {
            "type": "object",
            "properties": {
                "kwh": {"type": "number"},
                "cost": {"type": "number"},
                "co2Kg": {"type": "number"},
            },
        }
    )
    def get_energy(self, job: Job) -> dict[str, float]:
        """What the job's GPUs drew over all its attempts, as the energy meter read them: kWh,
        its cost at its clusters' price and CO₂ in kg (0 before it holds GPUs). Reads the
        attempts ``get_placement`` prefetched."""
        return job_energy(job)


def job_rows(jobs: Iterable[Job], context: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """``JobSerializer(jobs, many=True, context=context).data``, written out: the same rows
    without DRF's field machinery (a field object, a source lookup and a conversion per field per
    job were half of a 500-job answer's time). The method fields are the serializer's own; the
    jobs carry their owner, project and queue (as the views' querysets and a submission's jobs
    do). ``tests/portal/api/test_job_rows.py`` checks every field against the serializer."""
    methods = JobSerializer(context=context or {})
    # The field as the serializer has it, with the current time zone looked up once, not per value.
    zone = timezone.get_current_timezone() if settings.USE_TZ else None
    when = serializers.DateTimeField(default_timezone=zone).to_representation
    rows = []
    for job in jobs:
        rows.append(
            {
                "id": job.pk,
                "ref": methods.get_ref(job),
                "arrayId": _int(job.array_id),
                "arrayIndex": _int(job.array_index),
                "arrayThrottle": _int(job.array_throttle),
                "arrayTasks": methods.get_arrayTasks(job),
                "version": int(job.version),
                "name": str(job.name),
                "project": str(job.project.name),
                "queue": str(job.queue.name),
                "owner": str(job.owner.username),
                "state": str(job.state),
                "stateCode": SHORT_CODES[job.state],
                "reason": methods.get_reason(job),
                "reasonMessage": reason_sentence(job),
                "priority": int(job.priority),
                "labels": job.labels,
                "resources": methods.get_resources(job),
                "timeLimitSeconds": _int(job.time_limit_s),
                "submittedAt": _when(when, job.submitted_at),
                "startedAt": _when(when, job.started_at),
                "finishedAt": _when(when, job.finished_at),
                "exitCode": _int(job.exit_code),
                "attempts": int(job.attempt_count),
                "placement": methods.get_placement(job),
                "energy": job_energy(job),
                "preemptible": bool(job.preemptible),
                "gpuModel": methods.get_gpuModel(job),
                "gpuModels": methods.get_gpuModels(job),
                "checkpointedAt": _when(when, job.checkpointed_at),
                "estimatedStart": methods.get_estimatedStart(job),
            }
        )
    return rows


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _when(represent: Any, value: Any) -> str | None:
    return None if value is None else represent(value)


# States whose reason is shown: waiting, and draining after a preemption (who preempted it).
_EXPLAINED_STATES = WAITING_STATES | {JobState.PREEMPTED}


def reason_sentence(job: Job) -> str | None:
    """Why a job waits (or was preempted), in the scheduler's words (``None`` once it is placed)."""
    if job.state not in _EXPLAINED_STATES:
        return job.reason_message or None if job.state == "SCHEDULED" else None
    return job.reason_message or _REASON_SENTENCES.get(job.reason, "")


_REASON_SENTENCES = {
    "None": "Waiting for the scheduler's next cycle.",
    "Held": "Held; release it to let it be scheduled.",
    "Requeued": "Requeued; waiting to be placed again.",
    "Preempted": "Preempted by a job with a better claim; requeued.",
}


class ArrayActionSerializer(serializers.Serializer):
    """The answer to an action or an update on many jobs at once (an array, a range of
    members): how many the reference matched, how many changed (the first 1000 of them by
    ``ref``), how many were left as they were (their state did not allow it)."""

    ref = serializers.CharField()
    arrayId = serializers.IntegerField(allow_null=True)
    matched = serializers.IntegerField()
    changed = serializers.IntegerField()
    unchanged = serializers.IntegerField()
    changedRefs = serializers.ListField(child=serializers.CharField())


class ArraySerializer(serializers.Serializer):
    """An array as a whole (``GET arrays/{id}``): its id, name, owner, queue, throttle, how many
    members, their lowest and highest index, and how many are in each state."""

    arrayId = serializers.IntegerField()
    name = serializers.CharField()
    owner = serializers.CharField()
    project = serializers.CharField()
    queue = serializers.CharField()
    throttle = serializers.IntegerField(allow_null=True)
    tasks = serializers.IntegerField()
    indices = serializers.CharField()
    states = serializers.DictField(child=serializers.IntegerField())


class JobDetailSerializer(JobSerializer):
    spec = serializers.JSONField()
    dependency = serializers.SerializerMethodField()

    class Meta(JobSerializer.Meta):
        fields = [*JobSerializer.Meta.fields, "spec", "dependency"]
        read_only_fields = fields

    @extend_schema_field({"type": "array", "items": {"type": "object"}})
    def get_dependency(self, job: Job) -> list[dict[str, str]]:
        """What the job waits (or waited) for: one entry per job, ``{kind, job, state}`` with the
        job as users name it (``74``, ``74_3``) and the state ``waiting``, ``met`` or ``never``;
        at most 1000 entries."""
        rows = job.dependencies.values_list(
            "kind", "target_id", "target__array_id", "target__array_index", "state"
        )[:1000]
        return [
            {"kind": kind, "job": str(pk) if array is None else f"{array}_{index}", "state": state}
            for kind, pk, array, index, state in rows
        ]


class JobEventSerializer(serializers.ModelSerializer):
    fromState = serializers.CharField(source="from_state")
    toState = serializers.CharField(source="to_state")
    actor = serializers.SerializerMethodField()
    attempt = serializers.SerializerMethodField()

    class Meta:
        model = JobEvent
        fields = ["id", "at", "kind", "fromState", "toState", "reason", "message", "actor", "attempt"]
        read_only_fields = fields

    @extend_schema_field({"type": "string", "nullable": True})
    def get_actor(self, event: JobEvent) -> str | None:
        return event.actor.username if event.actor else None

    @extend_schema_field({"type": "integer", "nullable": True})
    def get_attempt(self, event: JobEvent) -> int | None:
        return event.attempt.number if event.attempt else None


class GpuModelSerializer(serializers.ModelSerializer):
    aliases = serializers.SerializerMethodField()
    memoryMb = serializers.IntegerField(source="memory_mb")
    tdpWatts = serializers.IntegerField(source="tdp_watts")
    relativeThroughput = serializers.FloatField(source="relative_throughput")

    class Meta:
        model = GpuModel
        fields = ["slug", "name", "vendor", "memoryMb", "tdpWatts", "relativeThroughput", "aliases"]
        read_only_fields = fields

    @extend_schema_field({"type": "array", "items": {"type": "string"}})
    def get_aliases(self, model: GpuModel) -> list[str]:
        return sorted(a.name for a in model.aliases.all())


class ClusterSerializer(serializers.ModelSerializer):
    """A cluster with its capacity. ``config`` and secrets are never shown here."""

    displayName = serializers.CharField(source="display_name")
    stateReason = serializers.CharField(source="state_reason")
    stateChangedAt = serializers.DateTimeField(source="state_changed_at")
    nodes = serializers.SerializerMethodField()
    gpus = serializers.SerializerMethodField()

    class Meta:
        model = Cluster
        fields = [
            "name",
            "displayName",
            "kind",
            "identity",
            "state",
            "stateReason",
            "stateChangedAt",
            "labels",
            "nodes",
            "gpus",
        ]
        read_only_fields = fields

    @extend_schema_field({"type": "object"})
    def get_nodes(self, cluster: Cluster) -> dict[str, int]:
        return self.context["capacity"].nodes.get(cluster.pk, {"total": 0, "ready": 0})

    @extend_schema_field({"type": "array", "items": {"type": "object"}})
    def get_gpus(self, cluster: Cluster) -> list[dict[str, Any]]:
        return self.context["capacity"].gpus.get(cluster.pk, [])


class ClusterOnboardSerializer(serializers.Serializer):
    """``POST clusters``: add (or re-key) a Slurm or Kubernetes cluster after a connection test.

    Slurm: ``url`` (slurmrestd) and ``token`` (a JWT). Kubernetes: ``kubeconfig``, or ``url``
    (the API server, https), ``token`` (a bearer token) and ``caCert``; ``namespace`` (default
    orrery), and who pods run as (``runAsUser``/``runAsGroup``, or ``uids`` per account)."""

    name = serializers.SlugField(max_length=64)
    kind = serializers.ChoiceField(choices=["slurm", "kubernetes"])
    url = serializers.URLField(
        max_length=512,
        required=False,
        help_text="slurmrestd (http://slurm-head:6820) or the Kubernetes API server (https://…:6443)",
    )
    token = serializers.CharField(
        max_length=8192,
        required=False,
        write_only=True,
        help_text="A JWT or a bearer token; never shown back.",
    )
    kubeconfig = serializers.CharField(
        max_length=65536,
        required=False,
        write_only=True,
        trim_whitespace=False,
        help_text="Kubernetes: a whole kubeconfig, credentials inline (no exec plugins, no file paths).",
    )
    caCert = serializers.CharField(
        max_length=65536,
        default="",
        allow_blank=True,
        write_only=True,
        help_text="Kubernetes: the PEM bundle that signs the API server's certificate.",
    )
    namespace = serializers.CharField(
        max_length=63, default="orrery", help_text="Kubernetes: the namespace Orrery owns (it must exist)."
    )
    runAsUser = serializers.IntegerField(
        min_value=1,
        max_value=2**31 - 1,
        required=False,
        help_text="Kubernetes: the uid pods run as (shared).",
    )
    runAsGroup = serializers.IntegerField(min_value=1, max_value=2**31 - 1, required=False)
    uids = serializers.DictField(
        child=serializers.IntegerField(min_value=1, max_value=2**31 - 1),
        required=False,
        help_text="Kubernetes, identity accounts or same_name: each POSIX account name's uid.",
    )
    user = serializers.CharField(max_length=64, default="root", help_text="The Slurm user Orrery acts as.")
    slurmConf = serializers.CharField(
        max_length=1024, default="", allow_blank=True, help_text="slurm.conf for the sbatch client."
    )
    identity = serializers.ChoiceField(
        choices=Identity.choices,
        required=False,
        help_text="Whose POSIX account users' work runs under (a new cluster: accounts; an existing "
        "one keeps its own).",
    )
    outputDir = serializers.CharField(
        max_length=1024,
        default="",
        allow_blank=True,
        help_text="Where users' output goes, with {home} and {user} (default {home}/.orrery/slurm).",
    )

    def validate_outputDir(self, value: str) -> str:
        try:
            return check_output_dir(value) if value else value
        except SlurmError as exc:
            raise serializers.ValidationError(str(exc)) from None

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["kind"] == "slurm":
            missing = {k: "This field is required." for k in ("url", "token") if not attrs.get(k)}
        elif attrs.get("kubeconfig"):
            missing = {
                k: "Give a kubeconfig, or url, token and caCert: not both."
                for k in ("url", "token", "caCert")
                if attrs.get(k)
            }
        else:
            missing = {
                k: "This field is required (or give a kubeconfig)."
                for k in ("url", "token")
                if not attrs.get(k)
            }
        if missing:
            raise serializers.ValidationError(missing)
        return attrs


class NodeSerializer(serializers.ModelSerializer):
    cluster = serializers.CharField(source="cluster.name")
    stateReason = serializers.CharField(source="state_reason")
    gpuModel = serializers.CharField(source="gpu_model_slug", allow_null=True)
    gpus = serializers.SerializerMethodField()
    cpuMillicores = serializers.IntegerField(source="cpu_millicores_allocatable")
    memoryBytes = serializers.IntegerField(source="memory_bytes_allocatable")
    lastHeartbeatAt = serializers.DateTimeField(source="last_heartbeat_at", allow_null=True)
    agentVersion = serializers.CharField(source="agent_version")
    powerState = serializers.CharField(source="power_state")

    class Meta:
        model = Node
        fields = [
            "id",
            "name",
            "cluster",
            "state",
            "stateReason",
            "gpuModel",
            "gpus",
            "cpuMillicores",
            "memoryBytes",
            "labels",
            "rack",
            "lastHeartbeatAt",
            "agentVersion",
            "powerState",
        ]
        read_only_fields = fields

    @extend_schema_field({"type": "object"})
    def get_gpus(self, node: Node) -> dict[str, int]:
        return {"total": node.gpu_capacity, "healthy": node.gpus_healthy, "allocated": node.gpus_allocated}


class NodeEventSerializer(serializers.ModelSerializer):
    fromState = serializers.CharField(source="from_state")
    toState = serializers.CharField(source="to_state")
    actor = serializers.SerializerMethodField()

    class Meta:
        model = NodeEvent
        fields = ["id", "at", "fromState", "toState", "reason", "actor"]
        read_only_fields = fields

    @extend_schema_field({"type": "string", "nullable": True})
    def get_actor(self, event: NodeEvent) -> str | None:
        return event.actor.username if event.actor else None


class TokenSerializer(serializers.ModelSerializer):
    """A token as its owner sees it: never the token itself, which is shown once at issue."""

    scopes = serializers.ListField(child=serializers.ChoiceField(choices=Scope.choices))
    createdAt = serializers.DateTimeField(source="created_at")
    lastUsedAt = serializers.DateTimeField(source="last_used_at", allow_null=True)
    expiresAt = serializers.DateTimeField(source="expires_at")
    revokedAt = serializers.DateTimeField(source="revoked_at", allow_null=True)

    class Meta:
        model = ApiToken
        fields = ["id", "name", "prefix", "scopes", "createdAt", "lastUsedAt", "expiresAt", "revokedAt"]
        read_only_fields = fields


class IssuedTokenSerializer(TokenSerializer):
    """The answer to ``POST tokens``: the token row and, this once, the token."""

    token = serializers.CharField(help_text="The token (orr_…); shown only in this answer.")

    class Meta(TokenSerializer.Meta):
        fields = [*TokenSerializer.Meta.fields, "token"]
        read_only_fields = fields


class TokenRequestSerializer(serializers.Serializer):
    """``POST tokens``. A token made with a token can neither outlive it nor hold a scope it
    lacks; no token lives longer than the site's maximum. A refusal is a 400 at the field."""

    name = serializers.CharField(max_length=80, default="default")
    scopes = serializers.ListField(
        child=serializers.ChoiceField(choices=Scope.choices),
        allow_empty=False,
        max_length=len(Scope.values),
        required=False,
        help_text="Default: read and submit (with a token: those of them the token holds).",
    )
    expiresInDays = serializers.IntegerField(
        min_value=1,
        max_value=36_500,
        required=False,
        help_text="Default and maximum: ORRERY_TOKEN_MAX_DAYS (90), and with a token, never past "
        "that token's expiry.",
    )


class PosixAccountSerializer(serializers.ModelSerializer):
    """Which POSIX account a user's work runs under on a cluster."""

    user = serializers.CharField(source="user.username")
    createdAt = serializers.DateTimeField(source="created_at")

    class Meta:
        model = PosixAccount
        fields = ["user", "username", "createdAt"]
        read_only_fields = fields
