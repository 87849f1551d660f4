"""The unified resource model: GpuModel, Cluster, Node, GpuDevice.

Capacities are stored in integer base units (cpu millicores, memory bytes, GPU memory MiB) and
guarded by check constraints, so no code path can write a negative or inconsistent capacity.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.db.models import F, Q

from clusters.choices import (
    AliasKind,
    ClusterKind,
    ClusterState,
    GpuHealth,
    GpuVendor,
    Identity,
    NodeState,
    PowerState,
)
from foundation.sealing import seal, unseal

slug_validator = RegexValidator(
    r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
    "Use lowercase letters, digits and dashes; start and end with a letter or digit.",
)
# A portable POSIX user name (what useradd accepts by default): no option-like leading dash,
# nothing a shell, a path or sbatch's argument parsing would read twice.
POSIX_NAME = r"^[a-z_][a-z0-9_-]{0,31}$"
posix_name_validator = RegexValidator(
    POSIX_NAME, "A POSIX user name: lowercase letters, digits, '_' and '-', starting with a letter or '_'."
)


class GpuModel(models.Model):
    """One accelerator type of the catalog. Jobs ask for ``slug`` or an alias, never a raw
    product string; collectors map the product strings they see through ``GpuModelAlias``."""

    slug = models.CharField(max_length=40, unique=True, validators=[slug_validator])
    name = models.CharField(max_length=80)
    vendor = models.CharField(max_length=16, choices=GpuVendor.choices, default=GpuVendor.NVIDIA)
    memory_mb = models.PositiveIntegerField(help_text="Device memory in MiB.")
    tdp_watts = models.PositiveIntegerField(help_text="Board power limit in watts.")
    relative_throughput = models.FloatField(
        default=1.0,
        validators=[MinValueValidator(0.0)],
        help_text="Training throughput relative to an A100-80G (1.0).",
    )

    class Meta:
        ordering = ["slug"]
        constraints = [
            models.CheckConstraint(condition=Q(memory_mb__gt=0), name="gpumodel_memory_positive"),
            models.CheckConstraint(
                condition=Q(relative_throughput__gte=0), name="gpumodel_throughput_nonneg"
            ),
        ]

    def __str__(self) -> str:
        return self.slug


class GpuModelAlias(models.Model):
    """Another name of a GpuModel: a short alias users type (``h100``) or a vendor product string
    a node reports (``NVIDIA H100 80GB HBM3``). Stored lowercased; unique across the catalog so a
    name can never mean two models."""

    gpu_model = models.ForeignKey(GpuModel, on_delete=models.CASCADE, related_name="aliases")
    name = models.CharField(max_length=120, unique=True)
    kind = models.CharField(max_length=16, choices=AliasKind.choices, default=AliasKind.ALIAS)

    class Meta:
        ordering = ["name"]
        verbose_name_plural = "GPU model aliases"

    def __str__(self) -> str:
        return f"{self.name} → {self.gpu_model.slug}"

    def save(self, *args, **kwargs) -> None:
        self.name = self.name.strip().lower()
        super().save(*args, **kwargs)


class Cluster(models.Model):
    """A member cluster of any kind. ``config`` holds ordinary connection settings; secrets live
    in ``ClusterSecret`` and are never echoed back by the API or the admin."""

    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    display_name = models.CharField(max_length=120, blank=True)
    kind = models.CharField(max_length=16, choices=ClusterKind.choices)
    state = models.CharField(max_length=16, choices=ClusterState.choices, default=ClusterState.ONBOARDING)
    state_reason = models.CharField(max_length=255, blank=True)
    state_changed_at = models.DateTimeField(auto_now_add=True)
    labels = models.JSONField(default=dict, blank=True, help_text='e.g. {"region": "eu-west"}')
    config = models.JSONField(default=dict, blank=True, help_text="Connection settings without secrets.")
    identity = models.CharField(
        max_length=16,
        choices=Identity.choices,
        default=Identity.ACCOUNTS,
        help_text="Whose POSIX account each user's work runs under on this cluster.",
    )
    energy_price_per_kwh = models.DecimalField(max_digits=8, decimal_places=4, null=True, blank=True)
    carbon_g_per_kwh = models.PositiveIntegerField(null=True, blank=True)
    power_saving = models.BooleanField(
        default=False,
        db_default=False,
        help_text="Let Orrery power idle nodes down (where the cluster's adapter can, e.g. Slurm's "
        "power saving); off: recommendations only.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        permissions = [("onboard_cluster", "Can onboard clusters and issue join tokens")]
        constraints = [
            models.CheckConstraint(
                condition=Q(energy_price_per_kwh__isnull=True) | Q(energy_price_per_kwh__gte=0),
                name="cluster_energy_price_nonneg",
                violation_error_message="The energy price cannot be negative.",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class PosixAccount(models.Model):
    """The POSIX account an Orrery user's work runs under on one cluster (``Cluster.identity``
    ``accounts``). The name is resolved on the cluster itself (the node's user database, or
    Slurm's), so uid, gid and groups are the site's, never Orrery's."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="accounts")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="posix_accounts"
    )
    username = models.CharField(
        max_length=32,
        validators=[posix_name_validator],
        help_text="The account's name on the cluster's machines (never root).",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["cluster", "user"]
        constraints = [
            models.UniqueConstraint(fields=["cluster", "user"], name="posix_account_one_per_cluster"),
            models.CheckConstraint(condition=~Q(username="root"), name="posix_account_not_root"),
        ]

    def __str__(self) -> str:
        return f"{self.user} → {self.username}@{self.cluster}"


class ClusterSecret(models.Model):
    """Credentials of a cluster (a slurmrestd JWT, a kubeconfig), apart from ``Cluster.config``,
    sealed at rest (``foundation.sealing``): the column holds ciphertext only. ``data`` reads and
    writes the plaintext mapping."""

    cluster = models.OneToOneField(Cluster, on_delete=models.CASCADE, related_name="secret")
    sealed = models.TextField(blank=True, editable=False)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"secret of {self.cluster.name}"

    @property
    def data(self) -> dict[str, Any]:
        return unseal(self.sealed)

    @data.setter
    def data(self, value: dict[str, Any]) -> None:
        self.sealed = seal(value)


class Node(models.Model):
    """A machine of a cluster. ``*_allocatable`` is what the scheduler may hand out (capacity
    minus what the system reserves); what is free is derived from active allocations."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="nodes")
    name = models.CharField(max_length=120)
    state = models.CharField(max_length=16, choices=NodeState.choices, default=NodeState.NOT_READY)
    state_reason = models.CharField(max_length=255, blank=True)
    state_changed_at = models.DateTimeField(auto_now_add=True)

    cpu_millicores_capacity = models.BigIntegerField(default=0)
    cpu_millicores_allocatable = models.BigIntegerField(default=0)
    memory_bytes_capacity = models.BigIntegerField(default=0)
    memory_bytes_allocatable = models.BigIntegerField(default=0)
    gpu_capacity = models.IntegerField(default=0, help_text="Number of GPU devices.")

    labels = models.JSONField(default=dict, blank=True)
    rack = models.CharField(max_length=63, blank=True)
    switch = models.CharField(max_length=63, blank=True)
    nvlink_domain = models.CharField(max_length=63, blank=True)

    last_heartbeat_at = models.DateTimeField(null=True, blank=True, help_text="Server time.")
    agent_version = models.CharField(max_length=40, blank=True)
    boot_id = models.CharField(max_length=64, blank=True)
    cpu_load = models.FloatField(null=True, blank=True, help_text="Fraction of CPU busy, 0–1.")
    memory_used_bytes = models.BigIntegerField(null=True, blank=True)
    power_w = models.FloatField(null=True, blank=True)
    power_state = models.CharField(max_length=16, choices=PowerState.choices, default=PowerState.ON)

    class Meta:
        ordering = ["cluster_id", "name"]
        constraints = [
            models.UniqueConstraint(fields=["cluster", "name"], name="node_unique_name_per_cluster"),
            models.CheckConstraint(
                condition=Q(cpu_millicores_capacity__gte=0)
                & Q(memory_bytes_capacity__gte=0)
                & Q(gpu_capacity__gte=0),
                name="node_capacity_nonneg",
                violation_error_message="Capacities cannot be negative.",
            ),
            models.CheckConstraint(
                condition=Q(cpu_millicores_allocatable__gte=0)
                & Q(cpu_millicores_allocatable__lte=F("cpu_millicores_capacity"))
                & Q(memory_bytes_allocatable__gte=0)
                & Q(memory_bytes_allocatable__lte=F("memory_bytes_capacity")),
                name="node_allocatable_within_capacity",
                violation_error_message="Allocatable CPU and memory must be between 0 and the capacity.",
            ),
            models.CheckConstraint(
                condition=Q(memory_used_bytes__isnull=True) | Q(memory_used_bytes__gte=0),
                name="node_memory_used_nonneg",
            ),
        ]
        indexes = [models.Index(fields=["state"], name="node_state_idx")]

    def __str__(self) -> str:
        return f"{self.cluster.name}/{self.name}" if self.cluster_id else self.name


class GpuDevice(models.Model):
    """One GPU of a node, addressed by its index (what ``CUDA_VISIBLE_DEVICES`` names). Telemetry
    fields follow the DCGM exporter (``DCGM_FI_DEV_GPU_UTIL``, ``DCGM_FI_DEV_FB_USED``,
    ``DCGM_FI_DEV_POWER_USAGE``, ``DCGM_FI_DEV_GPU_TEMP``)."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=64, blank=True)
    model = models.ForeignKey(GpuModel, on_delete=models.PROTECT, related_name="devices")
    memory_mb = models.PositiveIntegerField(default=0)
    health = models.CharField(max_length=16, choices=GpuHealth.choices, default=GpuHealth.HEALTHY)
    health_reason = models.CharField(max_length=255, blank=True)
    last_xid = models.PositiveIntegerField(null=True, blank=True, help_text="Last XID error reported.")
    mig_enabled = models.BooleanField(default=False)
    mig_layout_wanted = models.JSONField(
        null=True,
        blank=True,
        help_text='The MIG layout an operator asks for, e.g. ["3g.40gb", "3g.40gb"] ([]: MIG off); '
        "the node's agent applies it when the GPU is idle. Empty: leave the layout as it is.",
    )
    shareable = models.BooleanField(
        default=False,
        db_default=False,
        help_text="Offer this GPU in fractions (by memory or share) to jobs that ask for one.",
    )
    topology_group = models.CharField(
        max_length=63, blank=True, help_text="NVLink/PCIe group; GPUs of one group talk fastest."
    )

    utilization = models.FloatField(null=True, blank=True, help_text="DCGM_FI_DEV_GPU_UTIL, percent.")
    memory_used_mb = models.PositiveIntegerField(null=True, blank=True, help_text="DCGM_FI_DEV_FB_USED.")
    power_w = models.FloatField(null=True, blank=True, help_text="DCGM_FI_DEV_POWER_USAGE.")
    temperature_c = models.FloatField(null=True, blank=True, help_text="DCGM_FI_DEV_GPU_TEMP.")
    telemetry_at = models.DateTimeField(null=True, blank=True)
    # Exponential averages over recent telemetry (``sync_telemetry``), what load-aware placement reads.
    utilization_avg = models.FloatField(null=True, blank=True)
    memory_used_avg_mb = models.FloatField(null=True, blank=True)
    temperature_avg_c = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["node_id", "index"]
        verbose_name = "GPU"
        constraints = [
            models.UniqueConstraint(fields=["node", "index"], name="gpu_unique_index_per_node"),
            models.UniqueConstraint(fields=["uuid"], condition=~Q(uuid=""), name="gpu_unique_uuid"),
            models.CheckConstraint(
                condition=Q(utilization__isnull=True) | (Q(utilization__gte=0) & Q(utilization__lte=100)),
                name="gpu_utilization_percent",
                violation_error_message="Utilisation is a percentage between 0 and 100.",
            ),
            models.CheckConstraint(
                condition=Q(power_w__isnull=True) | Q(power_w__gte=0), name="gpu_power_nonneg"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.node}#{self.index}"


class MigInstance(models.Model):
    """One MIG instance of a GPU in MIG mode: a GPU of its own to the job that gets it, with its
    own UUID (what ``CUDA_VISIBLE_DEVICES`` names). ``slot`` is its place in the GPU's layout;
    ``slices`` its compute slices (of 7 on A100/H100), what its share of the GPU's power is
    reckoned by."""

    gpu = models.ForeignKey(GpuDevice, on_delete=models.CASCADE, related_name="mig_instances")
    slot = models.PositiveSmallIntegerField()
    profile = models.CharField(max_length=32, help_text='e.g. "1g.10gb"')
    uuid = models.CharField(max_length=64, blank=True)
    memory_mb = models.PositiveIntegerField(default=0)
    slices = models.PositiveSmallIntegerField(default=1)

    class Meta:
        ordering = ["gpu_id", "slot"]
        verbose_name = "MIG instance"
        constraints = [
            models.UniqueConstraint(fields=["gpu", "slot"], name="mig_unique_slot_per_gpu"),
            models.UniqueConstraint(fields=["uuid"], condition=~Q(uuid=""), name="mig_unique_uuid"),
            models.CheckConstraint(condition=Q(slices__gte=1) & Q(slices__lte=8), name="mig_slices_range"),
        ]

    def __str__(self) -> str:
        return f"{self.gpu}/{self.profile}#{self.slot}"


class NodeEvent(models.Model):
    """The append-only history of a node's state: who or what moved it, from where, and why."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    from_state = models.CharField(max_length=16, choices=NodeState.choices)
    to_state = models.CharField(max_length=16, choices=NodeState.choices)
    reason = models.CharField(max_length=255, blank=True)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)

    class Meta:
        ordering = ["node_id", "id"]

    def __str__(self) -> str:
        return f"{self.node}: {self.from_state} → {self.to_state}"


class JoinToken(models.Model):
    """Lets machines join a cluster: an agent trades it once for a per-node credential.
    Only a SHA-256 digest is stored; the token is shown once, when an operator creates it. It
    expires (an hour by default) and admits at most ``max_uses`` machines (one by default)."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="join_tokens")
    name = models.CharField(max_length=80, default="default")
    prefix = models.CharField(max_length=16, editable=False)
    digest = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    uses = models.PositiveIntegerField(default=0, editable=False)
    max_uses = models.PositiveIntegerField(
        null=True, blank=True, default=1, help_text="How many machines it admits; empty: no limit."
    )

    class Meta:
        ordering = ["cluster_id", "-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… for {self.cluster.name}"


class NodeCredential(models.Model):
    """The secret a node agent heartbeats with, scoped to that one node. Registering again
    revokes the previous one; only one live credential per node (partial unique index)."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="credentials")
    prefix = models.CharField(max_length=24, editable=False)
    digest = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["node_id", "-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["node"], condition=Q(revoked_at__isnull=True), name="one_live_node_credential"
            )
        ]

    def __str__(self) -> str:
        return f"{self.prefix}… for {self.node}"


class ClusterCredential(models.Model):
    """The secret a collector (Slurm, Kubernetes, simulated) reports a whole cluster's nodes
    with. Scoped to one cluster."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="credentials")
    name = models.CharField(max_length=80, default="collector")
    prefix = models.CharField(max_length=24, editable=False)
    digest = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["cluster_id", "-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… for {self.cluster.name}"


class NodeLastSeen(models.Model):
    """The slim, hot table of node liveness: one narrow row per node, rewritten by every
    aggregation pass (the wide Node row is written only when something about it changes).
    ``seen_at`` is server time; ``good_since`` starts a streak of on-time heartbeats, which
    NODE_RECOVERY measures; ``fingerprint`` hashes the node's slow-changing facts so a pass can
    tell which Node and GPU rows need writing."""

    node = models.OneToOneField(Node, on_delete=models.CASCADE, primary_key=True, related_name="last_seen")
    seen_at = models.DateTimeField()
    good_since = models.DateTimeField()
    boot_id = models.CharField(max_length=64, blank=True)
    seq = models.BigIntegerField(default=0)
    fingerprint = models.CharField(max_length=32, blank=True)

    # No index but the primary key, on purpose: every pass rewrites every row, and with no
    # indexed column changing (and free space kept in each page, see the migration) PostgreSQL
    # can update in place (HOT). The lifecycle pass reads the whole table anyway.

    def __str__(self) -> str:
        return f"{self.node_id} seen {self.seen_at:%H:%M:%S}"


class MetricPoint(models.Model):
    """A roll-up of the fleet's GPUs per cluster and model over one bucket: 1-minute points are
    kept 24 h, 1-hour points 30 days. Averages are sums over ``samples`` (GPU reports)."""

    class Resolution(models.TextChoices):
        MINUTE = "1m", "1 minute"
        HOUR = "1h", "1 hour"

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="metric_points")
    gpu_model = models.ForeignKey(GpuModel, on_delete=models.CASCADE, related_name="metric_points")
    resolution = models.CharField(max_length=2, choices=Resolution.choices)
    at = models.DateTimeField(help_text="Start of the bucket.")
    samples = models.BigIntegerField(default=0)
    gpus_total = models.IntegerField(default=0)
    gpus_allocated = models.IntegerField(default=0)
    utilization_sum = models.FloatField(default=0.0)
    power_w_sum = models.FloatField(default=0.0)

    class Meta:
        ordering = ["cluster_id", "gpu_model_id", "resolution", "at"]
        constraints = [
            models.UniqueConstraint(
                fields=["cluster", "gpu_model", "resolution", "at"], name="metric_point_unique"
            ),
            models.CheckConstraint(
                condition=Q(samples__gte=0) & Q(gpus_total__gte=0) & Q(gpus_allocated__gte=0),
                name="metric_point_nonneg",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.cluster_id}/{self.gpu_model_id} {self.resolution} {self.at:%Y-%m-%d %H:%M}"

    @property
    def utilization(self) -> float | None:
        return self.utilization_sum / self.samples if self.samples else None

    @property
    def power_w(self) -> float | None:
        return self.power_w_sum / self.samples if self.samples else None


class HeartbeatWatermark(models.Model):
    """One row: how long the control plane has been able to hear its nodes.

    ``flushed_at`` is when the heartbeat flush last succeeded; ``hearing_since`` when the flush
    last came back after a gap longer than ``ORRERY_HEARING_GAP_S`` (an outage of Redis, beat,
    the workers or the database), or null when no such gap has been seen. Both are stamped with
    the database's clock, so hosts' clocks do not matter (``clusters.services.hearing``)."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    flushed_at = models.DateTimeField(null=True)
    hearing_since = models.DateTimeField(null=True)

    def __str__(self) -> str:
        return f"flushed {self.flushed_at}, hearing since {self.hearing_since}"
