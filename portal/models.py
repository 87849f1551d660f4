"""Tenancy: projects, their members, and personal API tokens.

Operators are Django staff users; they see and act on everything.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q

from clusters.models import slug_validator
from portal.choices import Role


class Project(models.Model):
    """A team's unit of ownership: its members submit jobs to its queues and see its jobs."""

    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    display_name = models.CharField(max_length=120, blank=True)
    description = models.TextField(blank=True)
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, through="Membership", related_name="projects")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    """A user's role in a project: ``member`` submits and manages own jobs; ``manager`` also acts
    on every job of the project."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["project_id", "user_id"]
        constraints = [models.UniqueConstraint(fields=["user", "project"], name="membership_unique")]

    def __str__(self) -> str:
        return f"{self.user} in {self.project} ({self.role})"


class ApiToken(models.Model):
    """A personal API token. Only its SHA-256 digest is stored: the token is shown once, when it
    is issued. Tokens carry 256 bits of randomness, so a fast digest (not a password hash) is
    safe and keeps authentication a cached lookup. ``prefix`` lets a user tell tokens apart.

    ``scopes`` (a list of ``Scope`` values, a JSON list so it reads the same on PostgreSQL and
    SQLite) narrows what requests made with the token may do; every token expires
    (``expires_at``, at most ``ORRERY_TOKEN_MAX_DAYS`` after issue; ``services/tokens.py``)."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=80, default="default")
    prefix = models.CharField(max_length=16, editable=False)
    digest = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    scopes = models.JSONField(default=list)

    class Meta:
        ordering = ["user_id", "-created_at"]
        verbose_name = "API token"
        indexes = [models.Index(fields=["user"], condition=Q(revoked_at__isnull=True), name="token_live_idx")]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name})"

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes
