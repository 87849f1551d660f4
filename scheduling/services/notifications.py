"""Notifications: what a user asked to hear about their jobs, and the outbox rows that say it.

``enqueue`` runs inside the transaction of every job move (``followups.after_moves``), so a
move that rolls back leaves no message and a move that commits never loses one: the rows wait in
the ``Notification`` outbox until ``notification_delivery.deliver_due`` sends them. It costs
nothing for moves no one is told about (a placement, a requeue: no query at all), one small
query while nobody has settings, and one more (jobs joined to their owners' settings) while
none of the owners has; the scheduling cycle and bulk cancels move thousands of jobs at a
time, so it is set-based throughout.

Which event a move is, most specific first; a user gets one message per job and channel, named
after the first of these they subscribed to (subscribed to ``ended`` and ``failed``, a failure
sends one ``failed``)::

    SUCCEEDED · CANCELLED   → ended
    FAILED                  → failed, else ended
    TIMEOUT                 → timeout, else ended
    PREEMPTED               → preempted

The settings' writes (``save_settings``, ``rotate_secret``, ``send_test``) live here too: a
webhook's secret is made on the server, shown once, and kept sealed (``foundation.sealing``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from celery import current_app
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.cache import cache
from django.db import transaction
from django.utils import timezone

from foundation import sealing
from foundation.secrets import new_secret
from scheduling.choices import (
    SUBSCRIBABLE_EVENTS,
    EventKind,
    JobState,
    NotificationChannel,
    NotificationEvent,
)
from scheduling.models import Job, JobEvent, Notification, NotificationSetting
from scheduling.services.webhook_urls import UnsafeWebhook, check_webhook_url

log = logging.getLogger(__name__)

E = NotificationEvent
# The events a move to each state can be, most specific first.
EVENTS_FOR: dict[str, tuple[str, ...]] = {
    JobState.SUCCEEDED: (E.ENDED,),
    JobState.CANCELLED: (E.ENDED,),
    JobState.FAILED: (E.FAILED, E.ENDED),
    JobState.TIMEOUT: (E.TIMEOUT, E.ENDED),
    JobState.PREEMPTED: (E.PREEMPTED,),
}
TEST_EVENT = NotificationEvent.TEST  # "send a test": a message with a sample job, on every channel set up
SECRET_PREFIX = "whsec_"
DELIVER_TASK = "scheduling.tasks.deliver_notifications_task"

_FIELDS = (
    "pk",
    "array_id",
    "array_index",
    "name",
    "state",
    "exit_code",
    "submitted_at",
    "started_at",
    "finished_at",
    "owner_id",
    "owner__email",
    "project__name",
    "queue__name",
    "owner__notifications__email",
    "owner__notifications__webhook_url",
    "owner__notifications__events",
)


def enqueue(job_ids: list[int], from_state: str, to: str, now: datetime) -> None:
    """Write the notifications the owners of ``job_ids`` asked for, for their move from
    ``from_state`` to ``to``: one ``Notification`` per job and channel, pending, due ``now``.
    No query when ``to`` is no event; one when nobody has settings, two when none of these
    jobs' owners has."""
    events = EVENTS_FOR.get(to)
    if not events or not job_ids:
        return
    # A bulk move names thousands of jobs, and the list alone costs a query ~100 ms: ask the
    # small settings table first, so a site where nobody asked pays one indexed probe.
    if not NotificationSetting.objects.exists():
        return
    # One join: only jobs whose owner has settings come back (an inner join on the setting).
    owned = Job.objects.filter(pk__in=job_ids, owner__notifications__isnull=False)
    rows = list(owned.values_list(*_FIELDS, named=True))
    wanted = [(row, event) for row in rows if (event := _event_for(events, row.owner__notifications__events))]
    if not wanted:
        return
    reasons = _end_reasons([row.pk for row, _ in wanted], to)
    notifications = [
        Notification(
            user_id=row.owner_id,
            job_id=row.pk,
            event=event,
            channel=channel,
            payload={"event": event, "job": _job_payload(row, reasons.get(row.pk, ""))},
            next_attempt_at=now,
        )
        for row, event in wanted
        for channel in _channels(
            email=bool(row.owner__notifications__email and row.owner__email),
            webhook=bool(row.owner__notifications__webhook_url),
        )
    ]
    Notification.objects.bulk_create(notifications)
    if notifications:
        nudge()


def _event_for(events: tuple[str, ...], subscribed: Any) -> str | None:
    chosen = set(subscribed) if isinstance(subscribed, list) else set()
    return next((event for event in events if event in chosen), None)


def _channels(*, email: bool, webhook: bool) -> list[str]:
    return [NotificationChannel.EMAIL] * email + [NotificationChannel.WEBHOOK] * webhook


def _end_reasons(job_ids: list[int], to: str) -> dict[int, str]:
    """Why each job made this move, from the transition event written just before (a job's
    reason columns are cleared once it ends)."""
    found: dict[int, str] = {}
    events = (
        JobEvent.objects.filter(job_id__in=job_ids, kind=EventKind.TRANSITION, to_state=to)
        .order_by("job_id", "-pk")
        .values_list("job_id", "message", "reason")
    )
    for job_id, message, reason in events:
        found.setdefault(job_id, message or reason)
    return found


def _job_payload(row: Any, reason: str) -> dict[str, Any]:
    ref = f"{row.array_id}_{row.array_index}" if row.array_id is not None else str(row.pk)
    return {
        "id": row.pk,
        "ref": ref,
        "name": row.name,
        "project": row.project__name,
        "queue": row.queue__name,
        "state": row.state,
        "exitCode": row.exit_code,
        "reason": reason,
        "submittedAt": _iso(row.submitted_at),
        "startedAt": _iso(row.started_at),
        "finishedAt": _iso(row.finished_at),
        "url": job_url(row.pk),
    }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def job_url(job_id: int) -> str:
    """The job's page in the portal, at the address this site is reached by."""
    return f"{settings.ORRERY_PUBLIC_URL.rstrip('/')}/jobs/{job_id}/"


def nudge() -> None:
    """After commit, deliver now rather than at the next pass (with a broker; the embedded
    timer's pass comes within seconds anyway). At most once a second: a doorbell only."""
    if settings.REDIS_URL:
        transaction.on_commit(_ring)


def _ring() -> None:
    try:
        if cache.add("orrery:notify-requested", 1, timeout=1):
            current_app.send_task(DELIVER_TASK, expires=10)
    except Exception:  # the periodic pass delivers regardless
        log.warning("could not wake notification delivery early", exc_info=True)


# --- settings ---------------------------------------------------------------------------------


class SettingsRefused(ValueError):
    """Settings the rules refuse; ``field`` names the input at fault (``webhookUrl``, ``email``,
    ``events``)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


@dataclass(frozen=True)
class SavedSettings:
    """The settings as saved, and the webhook secret when this save made a new one (shown to
    the user this once, never again)."""

    setting: NotificationSetting
    new_secret: str | None


def settings_of(user: AbstractBaseUser) -> NotificationSetting:
    """The user's settings, or unsaved defaults (nothing on) when they never set any."""
    return NotificationSetting.objects.filter(user=user).first() or NotificationSetting(user=user)


@transaction.atomic
def save_settings(
    user: AbstractBaseUser, *, email: bool, webhook_url: str, events: Iterable[str]
) -> SavedSettings:
    """Replace the user's settings. A webhook URL must be one ``check_webhook_url`` allows
    (resolved now, and again at each delivery); setting one where there was none, or another
    one, makes a new secret, returned this once. Clearing the URL drops the secret. Raises
    ``SettingsRefused`` and saves nothing when a rule refuses."""
    chosen = set(events)
    if unknown := sorted(chosen - {value for value, _ in SUBSCRIBABLE_EVENTS}):
        raise SettingsRefused(
            "events",
            f"unknown event '{unknown[0][:40]}'; use {', '.join(value for value, _ in SUBSCRIBABLE_EVENTS)}",
        )
    if email and not getattr(user, "email", ""):
        raise SettingsRefused("email", "your account has no email address; ask an operator to add one")
    webhook_url = webhook_url.strip()
    if webhook_url:
        try:
            check_webhook_url(webhook_url)
        except UnsafeWebhook as exc:
            raise SettingsRefused("webhookUrl", str(exc)) from None
    setting = NotificationSetting.objects.select_for_update().filter(user=user).first()
    setting = setting or NotificationSetting(user=user)
    secret = None
    if webhook_url and (webhook_url != setting.webhook_url or not setting.webhook_secret):
        secret = new_secret(SECRET_PREFIX).plaintext
        setting.webhook_secret = sealing.seal({"secret": secret})
    elif not webhook_url:
        setting.webhook_secret = ""
    setting.email, setting.webhook_url = email, webhook_url
    setting.events = [value for value, _ in SUBSCRIBABLE_EVENTS if value in chosen]
    setting.save()
    return SavedSettings(setting, secret)


@transaction.atomic
def rotate_secret(user: AbstractBaseUser) -> str:
    """A new webhook secret for the user, replacing the old one at once; returns it (shown this
    once). ``SettingsRefused`` at ``webhookUrl`` when no webhook is set."""
    with_webhook = NotificationSetting.objects.exclude(webhook_url="")
    setting = with_webhook.select_for_update().filter(user=user).first()
    if setting is None:
        raise SettingsRefused("webhookUrl", "set a webhook URL first")
    secret = new_secret(SECRET_PREFIX).plaintext
    setting.webhook_secret = sealing.seal({"secret": secret})
    setting.save(update_fields=["webhook_secret", "updated_at"])
    return secret


def webhook_secret(setting: NotificationSetting) -> str:
    """The plaintext secret that signs this user's webhooks (for delivery only)."""
    return str(sealing.unseal(setting.webhook_secret).get("secret", ""))


@transaction.atomic
def send_test(user: AbstractBaseUser, *, now: datetime | None = None) -> list[Notification]:
    """Enqueue a test message, with a sample job, on every channel the user set up; returns the
    rows (none when no channel is set up). Delivered like any other, retries included."""
    setting = NotificationSetting.objects.filter(user=user).first()
    if setting is None:
        return []
    now = now or timezone.now()
    sample = {
        "id": 0,
        "ref": "0",
        "name": "orrery-test",
        "project": "",
        "queue": "",
        "state": JobState.SUCCEEDED,
        "exitCode": 0,
        "reason": "a test sent from your notification settings",
        "submittedAt": now.isoformat(),
        "startedAt": now.isoformat(),
        "finishedAt": now.isoformat(),
        "url": job_url(0),
    }
    rows = Notification.objects.bulk_create(
        Notification(
            user=user,
            job_id=0,  # no job: the column has no foreign key constraint
            event=TEST_EVENT,
            channel=channel,
            payload={"event": TEST_EVENT, "job": sample},
            next_attempt_at=now,
        )
        for channel in _channels(
            email=bool(setting.email and getattr(user, "email", "")), webhook=bool(setting.webhook_url)
        )
    )
    if rows:
        nudge()
    return rows


def recent_notifications(user: AbstractBaseUser, limit: int = 10) -> list[Notification]:
    """The user's latest messages, newest first, with their delivery state (a settings page
    shows them, so a user can see why a webhook fails)."""
    return list(Notification.objects.filter(user=user).order_by("-pk")[:limit])
