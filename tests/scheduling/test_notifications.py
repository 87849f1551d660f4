"""Notifications: which moves write which outbox rows, and delivery by email and to a real
webhook receiver (an HTTP server on 127.0.0.1), with retries, giving up and SSRF refusals."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.core import mail
from django.db import transaction
from django.utils import timezone

from scheduling.choices import DeliveryState, JobState
from scheduling.models import Notification, NotificationSetting
from scheduling.services.notification_delivery import deliver_due, email_subject, retry_delay
from scheduling.services.notifications import SettingsRefused, enqueue, save_settings, send_test
from scheduling.services.transitions import transition_job, transition_jobs
from scheduling.services.webhook_urls import UnsafeWebhook, check_webhook_url, is_public
from tests.factories import make_job, make_user

S = JobState
ALL_EVENTS = ["ended", "failed", "timeout", "preempted"]


def subscribe(user, events, *, email=True, webhook_url="", email_address="a@example.org") -> str | None:
    user.email = email_address
    user.save(update_fields=["email"])
    return save_settings(user, email=email, webhook_url=webhook_url, events=events).new_secret


# --- what is enqueued ------------------------------------------------------------------------

CASES = [
    # (subscribed, move to, the event written or None)
    (["ended"], S.SUCCEEDED, "ended"),
    (["failed"], S.SUCCEEDED, None),
    (["ended"], S.FAILED, "ended"),
    (["failed"], S.FAILED, "failed"),
    (["ended", "failed"], S.FAILED, "failed"),
    (["timeout"], S.FAILED, None),
    (["ended", "timeout"], S.TIMEOUT, "timeout"),
    (["ended"], S.TIMEOUT, "ended"),
    (["failed"], S.TIMEOUT, None),
    (["ended"], S.CANCELLED, "ended"),
    (["failed", "timeout", "preempted"], S.CANCELLED, None),
    (["preempted"], S.PREEMPTED, "preempted"),
    (["ended"], S.PREEMPTED, None),
    (ALL_EVENTS, S.PENDING, None),  # a requeue is no event
    (ALL_EVENTS, S.COMPLETING, None),
    ([], S.FAILED, None),
]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "subscribed, to, expected", CASES, ids=[f"{'+'.join(s) or 'none'}-{to}" for s, to, _ in CASES]
)
def test_a_move_writes_the_most_specific_event_subscribed(alice, queue, subscribed, to, expected):
    subscribe(alice, subscribed)
    job = make_job(alice, queue, state=S.RUNNING)
    transition_job(job.pk, to, exit_code=1 if to == S.FAILED else None)
    rows = list(Notification.objects.filter(job=job).values_list("event", "channel", "state"))
    assert rows == ([(expected, "email", "pending")] if expected else [])


@pytest.mark.django_db
def test_one_row_per_channel_with_the_job_as_it_ended(alice, queue):
    subscribe(alice, ["failed"], webhook_url="http://93.184.216.34/hook")
    job = make_job(alice, queue, state=S.RUNNING, name="train-x")
    transition_job(job.pk, S.FAILED, exit_code=3, message="out of memory")
    rows = {n.channel: n for n in Notification.objects.filter(job=job)}
    assert set(rows) == {"email", "webhook"}
    payload = rows["webhook"].payload
    assert payload["event"] == "failed"
    assert payload["job"] | {"submittedAt": None, "finishedAt": None} == {
        "id": job.pk,
        "ref": str(job.pk),
        "name": "train-x",
        "project": "vision",
        "queue": "default",
        "state": "FAILED",
        "exitCode": 3,
        "reason": "out of memory",
        "submittedAt": None,
        "startedAt": None,
        "finishedAt": None,
        "url": f"http://localhost:8000/jobs/{job.pk}/",
    }
    assert payload["job"]["finishedAt"] is not None


@pytest.mark.django_db
def test_an_array_member_is_named_by_its_ref(alice, queue):
    subscribe(alice, ["ended"])
    job = make_job(alice, queue, state=S.RUNNING, array_id=74, array_index=3)
    transition_job(job.pk, S.SUCCEEDED)
    assert Notification.objects.get(job=job).payload["job"]["ref"] == "74_3"


@pytest.mark.django_db
def test_email_needs_an_address_on_the_account(alice, queue):
    subscribe(alice, ["ended"], webhook_url="")
    NotificationSetting.objects.filter(user=alice).update(email=True)
    alice.email = ""
    alice.save(update_fields=["email"])
    job = make_job(alice, queue, state=S.RUNNING)
    transition_job(job.pk, S.SUCCEEDED)
    assert not Notification.objects.exists()


@pytest.mark.django_db
def test_nothing_for_users_without_settings_and_one_query_to_know(
    alice, bob, queue, django_assert_num_queries
):
    jobs = [make_job(alice if i % 2 else bob, queue) for i in range(50)]
    ids = [job.pk for job in jobs]
    with django_assert_num_queries(0):  # no event: not even a query
        enqueue(ids, S.PENDING, S.SCHEDULED, timezone.now())
    with django_assert_num_queries(1):  # nobody has settings: one probe of that table
        enqueue(ids, S.PENDING, S.CANCELLED, timezone.now())
    subscribe(make_user("carol"), ALL_EVENTS)
    with django_assert_num_queries(2):  # someone has, but none of these owners
        enqueue(ids, S.PENDING, S.CANCELLED, timezone.now())
    assert sorted(transition_jobs(ids, S.CANCELLED, only_from=S.PENDING)) == ids
    assert not Notification.objects.exists()


@pytest.mark.django_db
def test_a_bulk_move_notifies_only_subscribers_in_a_few_statements(
    alice, bob, queue, django_assert_num_queries
):
    subscribe(bob, ["ended"], webhook_url="http://93.184.216.34/hook")
    jobs = [make_job(alice if i % 2 else bob, queue, state=S.CANCELLED) for i in range(40)]
    with django_assert_num_queries(4):  # anyone? jobs with settings, their end reasons, one insert
        enqueue([job.pk for job in jobs], S.PENDING, S.CANCELLED, timezone.now())
    bobs = sorted(job.pk for job in jobs if job.owner_id == bob.pk)
    assert sorted(Notification.objects.filter(channel="email").values_list("job_id", flat=True)) == bobs
    assert Notification.objects.filter(channel="webhook").count() == len(bobs)
    assert set(Notification.objects.values_list("user_id", flat=True)) == {bob.pk}


@pytest.mark.django_db
def test_a_move_rolled_back_leaves_no_notification(alice, queue):
    subscribe(alice, ALL_EVENTS)
    job = make_job(alice, queue, state=S.RUNNING)
    with pytest.raises(RuntimeError), transaction.atomic():
        transition_job(job.pk, S.FAILED, exit_code=1)
        assert Notification.objects.filter(job=job).exists()
        raise RuntimeError("the move fails after the notification was written")
    assert not Notification.objects.exists()


# --- email ------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_email_is_sent_once_through_the_mail_framework(alice, queue, settings):
    settings.DEFAULT_FROM_EMAIL = "orrery@site.example"
    subscribe(alice, ["ended", "failed"], email_address="alice@example.org")
    job = make_job(alice, queue, state=S.RUNNING, name="train-x", array_id=74, array_index=3)
    transition_job(job.pk, S.FAILED, exit_code=1)
    done = deliver_due()
    assert (done.claimed, done.sent) == (1, 1)
    assert len(mail.outbox) == 1
    message = mail.outbox[0]
    assert message.subject == "[Orrery] job 74_3 train-x FAILED (exit 1)"
    assert (message.from_email, message.to) == ("orrery@site.example", ["alice@example.org"])
    assert f"/jobs/{job.pk}/" in message.body and "exit code 1" in message.body
    row = Notification.objects.get()
    assert (row.state, row.tries, row.sent_at is not None) == (DeliveryState.SENT, 1, True)
    assert deliver_due().claimed == 0  # sent is sent
    assert len(mail.outbox) == 1


@pytest.mark.parametrize(
    "job, subject",
    [
        ({"ref": "7", "name": "a", "state": "SUCCEEDED", "exitCode": 0}, "[Orrery] job 7 a SUCCEEDED"),
        ({"ref": "7", "name": "a\r\nBcc: x", "state": "TIMEOUT"}, "[Orrery] job 7 a Bcc: x TIMEOUT"),
        ({"ref": "7_1", "name": "b", "state": "PREEMPTED"}, "[Orrery] job 7_1 b PREEMPTED"),
    ],
    ids=["success", "newline-in-name", "preempted"],
)
def test_email_subjects(job, subject):
    assert email_subject({"event": "ended", "job": job}) == subject


@pytest.mark.django_db
def test_an_email_turned_off_after_the_move_is_not_sent(alice, queue):
    subscribe(alice, ["ended"])
    job = make_job(alice, queue, state=S.RUNNING)
    transition_job(job.pk, S.SUCCEEDED)
    save_settings(alice, email=False, webhook_url="", events=["ended"])
    assert deliver_due().failed == 1
    assert not mail.outbox
    assert "turned off" in Notification.objects.get().last_error


# --- webhooks: a real receiver ----------------------------------------------------------------


class Receiver:
    """An HTTP server on 127.0.0.1 answering each POST with the next scripted status (then
    200), recording what it got."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.got: list[dict[str, Any]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.got.append({"path": self.path, "headers": dict(self.headers), "body": body})
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                if status in (301, 302):
                    self.send_header("Location", "http://169.254.169.254/latest/meta-data")
                self.end_headers()
                self.wfile.write(b"nope " * 1000 if status >= 300 else b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/orrery?k=1"
        serve = {"poll_interval": 0.05}
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs=serve, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(settings) -> Iterator[Receiver]:
    settings.ORRERY_WEBHOOK_ALLOW_PRIVATE = True
    settings.ORRERY_WEBHOOK_TIMEOUT_S = 2
    server = Receiver()
    yield server
    server.close()


def verify(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """What a receiver does (docs/api.md shows the same)."""
    parts = dict(item.split("=", 1) for item in headers["X-Orrery-Signature"].split(","))
    expected = hmac.new(secret.encode(), parts["t"].encode() + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, parts["v1"])


def ended_job(user, queue, to=S.FAILED):
    job = make_job(user, queue, state=S.RUNNING, name="train-x")
    transition_job(job.pk, to, exit_code=1 if to == S.FAILED else None)
    return job


@pytest.mark.django_db
def test_a_webhook_is_signed_and_posted(alice, queue, receiver):
    secret = subscribe(alice, ["failed"], email=False, webhook_url=receiver.url)
    assert secret and secret.startswith("whsec_")
    job = ended_job(alice, queue)
    assert deliver_due().sent == 1
    [got] = receiver.got
    row = Notification.objects.get()
    assert got["path"] == "/hooks/orrery?k=1"
    assert got["headers"]["X-Orrery-Event"] == "failed"
    assert got["headers"]["X-Orrery-Delivery"] == str(row.pk)
    assert got["headers"]["Content-Type"] == "application/json"
    assert verify(secret, got["headers"], got["body"])
    assert not verify("whsec_other", got["headers"], got["body"])
    body = json.loads(got["body"])
    assert (body["id"], body["event"]) == (row.pk, "failed")
    assert (body["job"]["id"], body["job"]["state"]) == (job.pk, "FAILED")
    assert body["deliveredAt"]
    assert row.state == DeliveryState.SENT


@pytest.mark.django_db
def test_a_failed_webhook_is_retried_with_backoff_then_sent_once(alice, queue, receiver):
    subscribe(alice, ["ended"], email=False, webhook_url=receiver.url)
    ended_job(alice, queue, S.SUCCEEDED)
    receiver.statuses = [500]
    now = timezone.now()
    assert deliver_due(now=now).retried == 1
    row = Notification.objects.get()
    assert (row.state, row.tries) == (DeliveryState.PENDING, 1)
    assert "500" in row.last_error
    assert now + timedelta(seconds=23) <= row.next_attempt_at <= now + timedelta(seconds=37)
    assert deliver_due(now=now + timedelta(seconds=5)).claimed == 0  # not due yet
    assert deliver_due(now=now + timedelta(seconds=40)).sent == 1
    row.refresh_from_db()
    assert (row.state, row.tries, row.last_error) == (DeliveryState.SENT, 2, "")
    assert [g["headers"]["X-Orrery-Delivery"] for g in receiver.got] == [str(row.pk)] * 2
    assert Notification.objects.count() == 1


@pytest.mark.django_db
def test_delivery_gives_up_after_the_last_try(alice, queue, receiver, settings):
    settings.ORRERY_NOTIFY_MAX_TRIES = 3
    subscribe(alice, ["ended"], email=False, webhook_url=receiver.url)
    ended_job(alice, queue, S.CANCELLED)
    receiver.statuses = [503] * 10
    when = timezone.now()
    for _ in range(3):
        deliver_due(now=when)
        when += timedelta(hours=2)
    row = Notification.objects.get()
    assert (row.state, row.tries) == (DeliveryState.FAILED, 3)
    assert "503" in row.last_error and len(row.last_error) < 2000
    assert deliver_due(now=when + timedelta(days=1)).claimed == 0
    assert len(receiver.got) == 3


@pytest.mark.django_db
def test_a_redirect_is_not_followed(alice, queue, receiver):
    subscribe(alice, ["failed"], email=False, webhook_url=receiver.url)
    ended_job(alice, queue)
    receiver.statuses = [302]
    assert deliver_due().retried == 1
    assert "redirects are not followed" in Notification.objects.get().last_error
    assert len(receiver.got) == 1


@pytest.mark.django_db
def test_a_receiver_that_is_down_is_retried(alice, queue, settings):
    settings.ORRERY_WEBHOOK_ALLOW_PRIVATE = True
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    subscribe(alice, ["failed"], email=False, webhook_url=f"http://127.0.0.1:{port}/")
    ended_job(alice, queue)
    assert deliver_due().retried == 1
    assert "cannot connect" in Notification.objects.get().last_error


@pytest.mark.django_db
def test_a_private_target_is_refused_again_at_delivery(alice, queue, receiver, settings):
    subscribe(alice, ["failed"], email=False, webhook_url=receiver.url)
    ended_job(alice, queue)
    settings.ORRERY_WEBHOOK_ALLOW_PRIVATE = False  # the operator closed it after the save
    assert deliver_due().retried == 1
    assert "not a public address" in Notification.objects.get().last_error
    assert receiver.got == []


@pytest.mark.django_db
def test_send_test_goes_to_every_channel(alice, receiver):
    secret = subscribe(alice, [], webhook_url=receiver.url)
    rows = send_test(alice)
    assert sorted(r.channel for r in rows) == ["email", "webhook"]
    assert deliver_due().sent == 2
    assert mail.outbox[0].subject == "[Orrery] test notification"
    [got] = receiver.got
    assert got["headers"]["X-Orrery-Event"] == "test" and verify(secret, got["headers"], got["body"])


def test_backoff_doubles_with_jitter_up_to_a_cap():
    for tries, base in [(1, 30), (2, 60), (3, 120), (8, 3600), (30, 3600)]:
        delays = [retry_delay(tries) for _ in range(50)]
        assert all(0.8 * base <= d <= 1.2 * base for d in delays), (tries, min(delays), max(delays))
        assert len(set(delays)) > 1


# --- SSRF -------------------------------------------------------------------------------------

REFUSED = [
    ("http://127.0.0.1/", "not a public address"),
    ("http://127.9.9.9:8080/x", "not a public address"),
    ("http://10.1.2.3/", "not a public address"),
    ("http://192.168.1.1/", "not a public address"),
    ("http://172.16.0.1/", "not a public address"),
    ("http://169.254.169.254/latest/meta-data/", "not a public address"),
    ("http://[::1]/", "not a public address"),
    ("http://[fe80::1]/", "not a public address"),
    ("http://[fd00::1]/", "not a public address"),
    ("http://[::ffff:127.0.0.1]/", "not a public address"),
    ("http://0.0.0.0/", "not a public address"),
    ("http://100.64.0.1/", "not a public address"),
    ("http://224.0.0.1/", "not a public address"),
    ("http://2130706433/", "not a public address"),  # 127.0.0.1 as one number
    ("http://localhost:8000/", "not a public address"),
    ("file:///etc/passwd", "http:// or https://"),
    ("gopher://93.184.216.34/", "http:// or https://"),
    ("ftp://93.184.216.34/", "http:// or https://"),
    ("http:///nohost", "must name a host"),
    ("http://user:pw@93.184.216.34/", "credentials"),
    ("http://93.184.216.34:99999/", "not a valid URL"),
    ("http://93.184.216.34/a b", "spaces"),
    ("http://host.invalid/", "cannot be resolved"),
]


@pytest.mark.parametrize("url, why", REFUSED, ids=[u for u, _ in REFUSED])
def test_unsafe_webhook_urls_are_refused(url, why, settings):
    settings.ORRERY_WEBHOOK_ALLOW_PRIVATE = False
    with pytest.raises(UnsafeWebhook, match=why):
        check_webhook_url(url)


def test_a_public_address_is_allowed(settings):
    settings.ORRERY_WEBHOOK_ALLOW_PRIVATE = False
    target = check_webhook_url("https://93.184.216.34:8443/hooks?x=1")
    assert (target.scheme, target.port, target.path, target.addresses) == (
        "https",
        8443,
        "/hooks?x=1",
        ("93.184.216.34",),
    )


@pytest.mark.parametrize(
    "address, public",
    [("8.8.8.8", True), ("2606:4700::1111", True), ("127.0.0.1", False), ("::ffff:10.0.0.1", False)],
)
def test_is_public(address, public):
    assert is_public(address) is public


@pytest.mark.django_db
def test_an_unsafe_url_is_refused_at_save(alice, settings):
    settings.ORRERY_WEBHOOK_ALLOW_PRIVATE = False
    with pytest.raises(SettingsRefused, match="not a public address") as refused:
        save_settings(alice, email=False, webhook_url="http://169.254.169.254/", events=["ended"])
    assert refused.value.field == "webhookUrl"
    assert not NotificationSetting.objects.exists()


# --- driven by the embedded timer -------------------------------------------------------------


def deliver_then_disconnect() -> None:
    """The periodic task, then its thread's connection closed (the test database is dropped at
    the end of the run, which an idle connection of a finished thread would hold up)."""
    from django.db import connection

    from scheduling.tasks import deliver_notifications_task

    try:
        deliver_notifications_task()
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_the_embedded_timer_delivers_what_a_committed_move_wrote(alice, queue, settings):
    """The embedded default's stand-in for beat runs the same task on an in-process timer."""
    from portal.embedded import start_embedded_timers

    settings.REDIS_URL = ""  # the embedded default: no broker to ring
    settings.ORRERY_EMBEDDED_TASKS = [("tests.scheduling.test_notifications.deliver_then_disconnect", 0.05)]
    subscribe(alice, ["ended"])
    job = make_job(alice, queue, state=S.RUNNING, name="timed")
    stop = threading.Event()
    threads = start_embedded_timers(stop)
    try:
        transition_job(job.pk, S.SUCCEEDED)  # commits: the row is the timer's to send
        deadline = time.monotonic() + 5
        while not mail.outbox and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=5)
    assert [m.subject for m in mail.outbox] == [f"[Orrery] job {job.pk} timed SUCCEEDED"]
    assert Notification.objects.get().state == DeliveryState.SENT
