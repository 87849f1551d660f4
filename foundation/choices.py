"""Kinds of audited actions. Values are stable lowercase ``noun.verb`` strings: exports and
saved searches rely on them, so a value is never renamed, only added."""

from django.db import models


class AuditAction(models.TextChoices):
    JOB_SUBMIT = "job.submit", "Job submitted"
    JOB_CANCEL = "job.cancel", "Job cancelled"
    JOB_HOLD = "job.hold", "Job held"
    JOB_RELEASE = "job.release", "Job released"
    JOB_REQUEUE = "job.requeue", "Job requeued"
    JOB_UPDATE = "job.update", "Job changed"
    NODE_DRAIN = "node.drain", "Node drained"
    NODE_CORDON = "node.cordon", "Node cordoned"
    NODE_RESUME = "node.resume", "Node resumed"
    CLUSTER_ONBOARD = "cluster.onboard", "Cluster onboarded"
    JOIN_TOKEN_CREATE = "join_token.create", "Join token created"
    CLUSTER_CREDENTIAL_CREATE = "cluster_credential.create", "Collector credential created"
    CREDENTIAL_REVOKE = "credential.revoke", "Cluster or node credential revoked"
    TOKEN_CREATE = "token.create", "API token created"
    TOKEN_REVOKE = "token.revoke", "API token revoked"
    ACCOUNT_MAP = "account.map", "POSIX account mapped"
    ACCOUNT_UNMAP = "account.unmap", "POSIX account unmapped"
    BUDGET_CREATE = "budget.create", "GPU-hour budget created"
    BUDGET_CHANGE = "budget.change", "GPU-hour budget changed"


class AuditSource(models.TextChoices):
    """Where an action came from when it did not come through a web request (which records the
    client's address instead)."""

    CLI = "cli", "Command line on the server (manage.py)"
    SYSTEM = "system", "The control plane itself (workers, scheduler, daemons)"
