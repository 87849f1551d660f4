"""Delivering the notification outbox: claim what is due, send it, mark it sent or try again.

``deliver_due`` is one pass (a Celery beat task every few seconds, the embedded timer without a
broker, and a doorbell after each commit that wrote rows)::

    claim   SELECT … FOR UPDATE SKIP LOCKED the due rows (PostgreSQL; SQLite, one process, reads
            them plainly), count the try and push next_attempt_at past the pass: a short
            transaction, so no lock is held while a message is in flight
    send    email through Django's mail framework; a webhook as a signed JSON POST
    mark    sent; or due again after 30 s, 1 min, 2 min … (capped, with jitter); after
            ORRERY_NOTIFY_MAX_TRIES tries, failed with the last error

Delivery is at least once: a pass that dies after sending and before marking sends again once
its claim runs out. Receivers de-duplicate on ``X-Orrery-Delivery``, the row's id.

A webhook URL is the user's, so it is an attacker's: ``webhook_urls.check_webhook_url`` vets it
again at each delivery, which then connects to the very address it checked (a name that
resolves elsewhere a second later gains nothing). Redirects are not followed, a response is read
for at most 1 KiB.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import logging
import random
import smtplib
import socket
import ssl
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.mail import EmailMessage
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from foundation.sealing import SealBroken
from scheduling.choices import DeliveryState, NotificationChannel
from scheduling.models import Notification, NotificationSetting
from scheduling.services.notifications import TEST_EVENT, webhook_secret
from scheduling.services.webhook_urls import Target, UnsafeWebhook, check_webhook_url

log = logging.getLogger(__name__)

BACKOFF_BASE_S = 30.0
BACKOFF_CAP_S = 3600.0
READ_LIMIT = 1024  # bytes of a response kept, for last_error
USER_AGENT = "Orrery-Webhook/1"


class DeliveryFailed(Exception):
    """One try failed; the message says why (kept in ``last_error``). ``final``: no later try
    can do better (the user turned the channel off), so the row fails now."""

    def __init__(self, message: str, *, final: bool = False) -> None:
        self.final = final
        super().__init__(message)


@dataclass(frozen=True)
class Pass:
    """What one pass did: rows claimed, sent, scheduled again, given up."""

    claimed: int = 0
    sent: int = 0
    retried: int = 0
    failed: int = 0


# --- the pass ---------------------------------------------------------------------------------


def deliver_due(limit: int = 50, *, now: datetime | None = None) -> Pass:
    """Send up to ``limit`` due notifications, oldest due first. Safe to run in any number of
    processes at once: each row is claimed by one (``SKIP LOCKED``), and a row is marked only
    by the pass whose claim is still current (its ``tries``)."""
    now = now or timezone.now()
    rows = _claim(limit, now)
    if not rows:
        return Pass()
    setting_of = {
        s.user_id: s
        for s in NotificationSetting.objects.select_related("user").filter(
            user_id__in={row.user_id for row in rows}
        )
    }
    sent = retried = failed = 0
    for row in rows:
        try:
            _send(row, setting_of.get(row.user_id))
        except DeliveryFailed as exc:
            if _mark_failed(row, str(exc), now, final=exc.final):
                failed += 1
            else:
                retried += 1
            continue
        except Exception as exc:  # a bug must not stop the pass, nor lose the row
            log.exception("notification %s: unexpected error", row.pk)
            retried += not _mark_failed(row, f"internal error: {type(exc).__name__}", now)
            continue
        Notification.objects.filter(pk=row.pk, state=DeliveryState.PENDING, tries=row.tries).update(
            state=DeliveryState.SENT, sent_at=timezone.now(), last_error=""
        )
        sent += 1
    return Pass(claimed=len(rows), sent=sent, retried=retried, failed=failed)


def _claim(limit: int, now: datetime) -> list[Notification]:
    """Take the due rows: count the try and make them due again only after this pass could
    have sent them all, so a pass that dies leaves them to the next one."""
    hold = timedelta(seconds=60 + limit * (settings.ORRERY_WEBHOOK_TIMEOUT_S + 1))
    with transaction.atomic():
        rows = list(
            Notification.objects.select_for_update(skip_locked=True)
            .filter(state=DeliveryState.PENDING, next_attempt_at__lte=now)
            .order_by("next_attempt_at", "pk")[:limit]
        )
        if rows:
            Notification.objects.filter(pk__in=[row.pk for row in rows]).update(
                tries=F("tries") + 1, next_attempt_at=now + hold
            )
    for row in rows:
        row.tries += 1
    return rows


def retry_delay(tries: int) -> float:
    """Seconds before the next try after ``tries`` failed ones: 30 s doubled each time up to an
    hour, times 0.8–1.2 so that messages failing together do not come back together."""
    return min(BACKOFF_BASE_S * 2 ** max(tries - 1, 0), BACKOFF_CAP_S) * random.uniform(0.8, 1.2)


def _mark_failed(row: Notification, error: str, now: datetime, *, final: bool = False) -> bool:
    """Schedule the next try, or give up after the last (or a final failure); True when it
    gave up."""
    give_up = final or row.tries >= settings.ORRERY_NOTIFY_MAX_TRIES
    changes: dict[str, Any] = {"last_error": error[:2000]}
    if give_up:
        changes["state"] = DeliveryState.FAILED
    else:
        changes["next_attempt_at"] = now + timedelta(seconds=retry_delay(row.tries))
    Notification.objects.filter(pk=row.pk, state=DeliveryState.PENDING, tries=row.tries).update(**changes)
    log.info("notification %s try %s failed: %s", row.pk, row.tries, error[:200])
    return give_up


def _send(row: Notification, setting: NotificationSetting | None) -> None:
    if row.channel == NotificationChannel.EMAIL:
        address = setting.user.email if setting is not None and setting.email else ""
        if not address:
            raise DeliveryFailed(
                "email notifications were turned off, or the account has no address", final=True
            )
        send_email(row, address)
    elif row.channel == NotificationChannel.WEBHOOK:
        if setting is None or not setting.webhook_url:
            raise DeliveryFailed("the webhook was removed from the settings", final=True)
        try:
            secret = webhook_secret(setting)
        except SealBroken as exc:
            raise DeliveryFailed(f"the webhook secret cannot be opened ({exc}); rotate it") from None
        send_webhook(row, setting.webhook_url, secret)
    else:
        raise DeliveryFailed(f"unknown channel {row.channel!r}")


# --- email ------------------------------------------------------------------------------------


def email_subject(payload: dict[str, Any]) -> str:
    """``[Orrery] job 74_3 train-x FAILED (exit 1)``, on one line whatever the job is named."""
    job = payload.get("job", {})
    if payload.get("event") == TEST_EVENT:
        return "[Orrery] test notification"
    name = " ".join(str(job.get("name", "")).split())
    exit_code = f" (exit {job['exitCode']})" if job.get("exitCode") not in (None, 0) else ""
    return f"[Orrery] job {job.get('ref')} {name} {job.get('state')}{exit_code}"


def email_body(payload: dict[str, Any]) -> str:
    job = payload.get("job", {})
    exit_code = f", exit code {job['exitCode']}" if job.get("exitCode") is not None else ""
    lines = [
        f"Job {job.get('ref')} ({job.get('name')}) in {job.get('project')}/{job.get('queue')}: "
        f"{job.get('state')}{exit_code}.",
    ]
    if job.get("reason"):
        lines.append(f"Reason: {job['reason']}")
    lines += [
        f"Submitted {job.get('submittedAt')}; started {job.get('startedAt') or '-'}; "
        f"finished {job.get('finishedAt') or '-'}.",
        "",
        str(job.get("url", "")),
        "",
        "You get this message because of your notification settings: "
        f"{settings.ORRERY_PUBLIC_URL.rstrip('/')}/settings/notifications/",
    ]
    if payload.get("event") == TEST_EVENT:
        lines.insert(0, "This is a test: your email notifications work.\n")
    return "\n".join(lines) + "\n"


def send_email(row: Notification, address: str) -> None:
    message = EmailMessage(
        email_subject(row.payload),
        email_body(row.payload),
        settings.DEFAULT_FROM_EMAIL,
        [address],
        headers={"X-Orrery-Event": row.event, "X-Orrery-Delivery": str(row.pk)},
    )
    try:
        message.send()
    except (smtplib.SMTPException, OSError) as exc:
        raise DeliveryFailed(f"email: {type(exc).__name__}: {exc}") from None


# --- webhooks ---------------------------------------------------------------------------------


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """The ``X-Orrery-Signature`` value: ``t=<unix>,v1=<hex HMAC-SHA256 of "t.body">``."""
    digest = hmac.new(secret.encode(), str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def webhook_body(row: Notification, delivered_at: datetime) -> bytes:
    document = {
        "id": row.pk,
        "event": row.payload.get("event", row.event),
        "job": row.payload.get("job", {}),
        "deliveredAt": delivered_at.isoformat(),
    }
    return json.dumps(document, separators=(",", ":"), sort_keys=True).encode()


def send_webhook(row: Notification, url: str, secret: str) -> None:
    """POST the signed body to ``url`` (checked again now, and connected to by the address
    checked); a 2xx answer is delivered, anything else raises ``DeliveryFailed``."""
    try:
        target = check_webhook_url(url)
    except UnsafeWebhook as exc:
        raise DeliveryFailed(f"webhook refused: {exc}") from None
    now = timezone.now()
    body = webhook_body(row, now)
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "X-Orrery-Event": str(row.payload.get("event", row.event)),
        "X-Orrery-Delivery": str(row.pk),
        "X-Orrery-Signature": signature(secret, int(time.time()), body),
    }
    status, excerpt = _post(target, body, headers)
    if not 200 <= status < 300:
        kind = "redirects are not followed" if 300 <= status < 400 else "not a 2xx answer"
        raise DeliveryFailed(f"webhook answered {status} ({kind}): {excerpt}")


class _PinnedHTTP(http.client.HTTPConnection):
    """Connects to an address already checked, whatever the host name resolves to now."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """The same over TLS: the certificate is verified for the host name (SNI too)."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        self.tls = ssl.create_default_context()
        super().__init__(host, port, timeout=timeout, context=self.tls)
        self.address = address

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self.tls.wrap_socket(sock, server_hostname=self.host)


def _post(target: Target, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    """POST to the first of the target's addresses that accepts a connection (a request is
    sent once: only connecting moves on to the next address); the status and the start of the
    answer. ``DeliveryFailed`` when no address answers."""
    kind = _PinnedHTTPS if target.scheme == "https" else _PinnedHTTP
    timeout = settings.ORRERY_WEBHOOK_TIMEOUT_S
    error = "no address"
    for address in target.addresses:
        connection = kind(target.host, target.port, address, timeout)
        try:
            connection.connect()
        except OSError as exc:
            error = f"cannot connect to {address}: {type(exc).__name__}: {exc}"
            connection.close()
            continue
        try:
            connection.request("POST", target.path, body=body, headers=headers)
            response = connection.getresponse()
            excerpt = response.read(READ_LIMIT).decode("utf-8", "replace")
            return response.status, " ".join(excerpt.split())[:300]
        except (OSError, http.client.HTTPException) as exc:
            raise DeliveryFailed(f"webhook: {type(exc).__name__}: {exc}") from None
        finally:
            connection.close()
    raise DeliveryFailed(f"webhook: {error}")
