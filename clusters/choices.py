"""Statuses of the resource model. Values are stable lowercase strings stored in the database."""

from django.db import models


class ClusterKind(models.TextChoices):
    NATIVE = "native", "Orrery agent"
    SLURM = "slurm", "Slurm"
    KUBERNETES = "kubernetes", "Kubernetes"
    SIMULATED = "simulated", "Simulated"


class ClusterState(models.TextChoices):
    ONBOARDING = "onboarding", "Onboarding"
    READY = "ready", "Ready"
    DEGRADED = "degraded", "Degraded"
    UNREACHABLE = "unreachable", "Unreachable"
    DRAINING = "draining", "Draining"
    DISABLED = "disabled", "Disabled"


class NodeState(models.TextChoices):
    READY = "ready", "Ready"
    NOT_READY = "not_ready", "Not ready"
    DOWN = "down", "Down"
    DRAINING = "draining", "Draining"
    DRAINED = "drained", "Drained"
    CORDONED = "cordoned", "Cordoned"


# States an operator put the node in; heartbeats never move a node out of these.
OPERATOR_NODE_STATES = frozenset({NodeState.DRAINING, NodeState.DRAINED, NodeState.CORDONED})


class PowerState(models.TextChoices):
    ON = "on", "On"
    IDLE = "idle", "Idle"
    SUSPENDED = "suspended", "Suspended"


class GpuHealth(models.TextChoices):
    HEALTHY = "healthy", "Healthy"
    UNHEALTHY = "unhealthy", "Unhealthy"


class GpuVendor(models.TextChoices):
    NVIDIA = "nvidia", "NVIDIA"
    AMD = "amd", "AMD"
    INTEL = "intel", "Intel"


class AliasKind(models.TextChoices):
    ALIAS = "alias", "Alias users may type"
    PRODUCT = "product", "Vendor product string"


class Identity(models.TextChoices):
    """Whose POSIX account a user's work runs under on a cluster."""

    ACCOUNTS = "accounts", "Mapped accounts (an operator maps each user)"
    SAME_NAME = "same_name", "Same name (the Orrery user name, resolved on the nodes)"
    SHARED = "shared", "Shared service account (single tenant: no isolation between users)"
