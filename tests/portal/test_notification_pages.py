"""The notification settings page: the form saves, the secret is shown once, an unsafe URL is a
400 with the error at its field, a test is queued, and nobody signed out gets in."""

from __future__ import annotations

import pytest

from scheduling.models import Notification, NotificationSetting

pytestmark = pytest.mark.django_db
PAGE = "/settings/notifications/"
URL = "https://93.184.216.34/h"


@pytest.fixture
def signed_in(client, alice):
    alice.email = "alice@example.org"
    alice.save(update_fields=["email"])
    client.force_login(alice)
    return client


def test_the_page_needs_a_session(client):
    answer = client.get(PAGE)
    assert answer.status_code == 302 and answer["Location"].startswith("/accounts/login/")


def test_the_page_shows_the_form_and_is_linked_from_every_page(signed_in):
    page = signed_in.get(PAGE).content.decode()
    assert 'name="webhook_url"' in page and 'value="preempted"' in page and "Send a test" in page
    assert "alice@example.org" in page
    assert f'href="{PAGE}"' in signed_in.get("/queues/").content.decode()


def test_saving_a_webhook_shows_its_secret_once(signed_in, alice, settings):
    settings.ORRERY_WEBHOOK_ALLOW_PRIVATE = False
    answer = signed_in.post(
        PAGE,
        {
            "action": "save",
            "email": "on",
            "webhook_url": "https://93.184.216.34/h",
            "events": ["failed", "timeout"],
        },
    )
    assert answer.status_code == 200
    assert answer["Cache-Control"] == "no-store"
    setting = NotificationSetting.objects.get(user=alice)
    assert (setting.email, setting.webhook_url, setting.events) == (
        True,
        "https://93.184.216.34/h",
        ["failed", "timeout"],
    )
    page = answer.content.decode()
    assert 'id="webhook-secret"' in page and "whsec_" in page
    again = signed_in.get(PAGE).content.decode()
    assert "whsec_" not in again and "A signing secret is set" in again
    rotated = signed_in.post(PAGE, {"action": "rotate"}).content.decode()
    assert "whsec_" in rotated


@pytest.mark.parametrize(
    "url", ["http://169.254.169.254/latest/meta-data/", "http://127.0.0.1:6379/", "file:///etc/passwd"]
)
def test_an_unsafe_url_is_refused_with_what_was_typed(signed_in, settings, url):
    settings.ORRERY_WEBHOOK_ALLOW_PRIVATE = False
    answer = signed_in.post(PAGE, {"action": "save", "webhook_url": url, "events": ["ended"]})
    assert answer.status_code == 400
    page = answer.content.decode()
    assert 'id="settings-error"' in page and "webhookUrl" in page and url in page
    assert not NotificationSetting.objects.exists()


def test_unknown_events_are_refused(signed_in):
    answer = signed_in.post(PAGE, {"action": "save", "events": ["ended", "<script>"]})
    assert answer.status_code == 400 and "&lt;script&gt;" in answer.content.decode()


def test_send_a_test(signed_in, alice):
    assert signed_in.post(PAGE, {"action": "test"}).status_code == 400  # nothing set up
    signed_in.post(PAGE, {"action": "save", "email": "on", "events": ["ended"]})
    answer = signed_in.post(PAGE, {"action": "test"}, follow=True)
    assert "Test queued (email)" in answer.content.decode()
    assert list(Notification.objects.values_list("user_id", "event", "channel")) == [
        (alice.pk, "test", "email")
    ]
    assert "test" in signed_in.get(PAGE).content.decode()  # listed under recent messages
