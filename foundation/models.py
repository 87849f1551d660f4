"""The audit log: one append-only row per change an operator or a user asked for."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from foundation.choices import AuditAction


class AuditEntry(models.Model):
    """Who changed what, when and from where. Written by ``foundation.audit.record`` inside the
    transaction of the change itself, so a change never lands without its entry and a rolled-back
    change leaves none.

    Append-only in the database: triggers refuse UPDATE and DELETE on PostgreSQL and on SQLite
    (migration 0001), whoever asks. The actor is therefore not a foreign key: deleting a user
    would have to null or cascade the rows. ``actor_id`` keeps the user's id (never reused) and
    ``actor_name`` the user name as it was; both are empty for actions nobody asked for.
    ``source`` is the client's address for a web request, ``cli`` for ``manage.py`` and
    ``system`` for the control plane's own processes. ``details`` is small (ids, counts, the
    reason given) and never holds a secret.
    """

    at = models.DateTimeField(default=timezone.now, editable=False)
    actor_id = models.BigIntegerField(null=True, blank=True)
    actor_name = models.CharField(max_length=150, blank=True)
    source = models.CharField(max_length=64)
    action = models.CharField(max_length=40, choices=AuditAction.choices)
    target = models.CharField(max_length=255)
    details = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-id"]
        verbose_name = "audit entry"
        verbose_name_plural = "audit log"
        indexes = [
            # The console's filters: by time (date hierarchy, export ranges), by action, by
            # actor and by target, each newest first.
            models.Index(fields=["at"], name="audit_at"),
            models.Index(fields=["action", "at"], name="audit_action_at"),
            models.Index(fields=["actor_name", "at"], name="audit_actor_at"),
            models.Index(fields=["target", "at"], name="audit_target_at"),
        ]

    def __str__(self) -> str:
        return f"{self.action} {self.target} by {self.actor_name or self.source}"


class BeatLease(models.Model):
    """Which beat process may send the periodic schedule named ``name`` (the Celery queue prefix),
    until ``expires_at`` (database time). Taken and renewed only by compare-and-set in
    ``foundation.beat.Lease``: a holder renews its own row; anyone may take a row whose time is
    up, and each change of holder adds one to ``term``."""

    name = models.CharField(max_length=200, primary_key=True)
    holder = models.CharField(max_length=255, blank=True)
    term = models.BigIntegerField(default=0)
    expires_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.name}: {self.holder or 'nobody'} (term {self.term})"
