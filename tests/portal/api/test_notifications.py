"""``/api/v1/me/notifications``: settings read and replaced, the secret shown once, bad input a
400 at its field, unsafe webhook URLs refused, tokens held to their scopes."""

from __future__ import annotations

import pytest

from foundation import sealing
from scheduling.models import Notification, NotificationSetting
from tests.portal.api.conftest import error_paths

URL = "/api/v1/me/notifications"


@pytest.fixture
def alice_mail(alice):
    alice.email = "alice@example.org"
    alice.save(update_fields=["email"])
    return alice


def test_settings_start_off(api, alice):
    body = api(alice).get(URL).json()
    assert body == {
        "email": False,
        "emailAddress": "",
        "webhookUrl": "",
        "webhookSecretSet": False,
        "events": [],
        "updatedAt": None,
    }


def test_a_webhook_gets_a_secret_shown_once_and_kept_sealed(api, alice_mail, settings):
    settings.ORRERY_WEBHOOK_ALLOW_PRIVATE = False
    client = api(alice_mail)
    put = client.put(
        URL,
        {"email": True, "webhookUrl": "https://93.184.216.34/hook", "events": ["failed", "ended"]},
        format="json",
    )
    assert put.status_code == 200, put.content
    body = put.json()
    secret = body["webhookSecret"]
    assert secret.startswith("whsec_")
    assert body["events"] == ["ended", "failed"] and body["webhookSecretSet"] is True
    stored = NotificationSetting.objects.get(user=alice_mail)
    assert secret not in stored.webhook_secret
    assert sealing.unseal(stored.webhook_secret) == {"secret": secret}

    shown = client.get(URL).json()
    assert "webhookSecret" not in shown and secret not in str(shown)
    # The same URL again keeps the secret; changing events only says nothing of it.
    again = client.put(URL, {"events": ["timeout"]}, format="json").json()
    assert "webhookSecret" not in again
    assert (again["events"], again["email"], again["webhookUrl"]) == (
        ["timeout"],
        True,
        "https://93.184.216.34/hook",
    )
    rotated = client.post(f"{URL}/rotate-secret")
    assert rotated.status_code == 200
    assert rotated.json()["webhookSecret"] not in (secret, "")
    assert client.put(URL, {"webhookUrl": ""}, format="json").json()["webhookSecretSet"] is False


@pytest.mark.parametrize(
    "body, path",
    [
        ({"events": ["finished"]}, "events.0"),
        ({"events": "ended"}, "events"),
        ({"events": ["ended"] * 5}, "events"),
        ({"email": "perhaps"}, "email"),
        ({"webhookUrl": "x" * 501}, "webhookUrl"),
        ({"webhookUrl": "http://127.0.0.1:8000/"}, "webhookUrl"),
        ({"webhookUrl": "http://169.254.169.254/latest/meta-data/"}, "webhookUrl"),
        ({"webhookUrl": "http://[::1]/"}, "webhookUrl"),
        ({"webhookUrl": "http://10.0.0.7/"}, "webhookUrl"),
        ({"webhookUrl": "http://localhost/"}, "webhookUrl"),
        ({"webhookUrl": "file:///etc/passwd"}, "webhookUrl"),
        ({"webhookUrl": "javascript:alert(1)"}, "webhookUrl"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_bad_input_is_a_400_at_its_field(api, alice_mail, settings, body, path):
    settings.ORRERY_WEBHOOK_ALLOW_PRIVATE = False
    response = api(alice_mail).put(URL, body, format="json")
    assert response.status_code == 400, response.content
    assert path in error_paths(response), response.json()
    assert not NotificationSetting.objects.exists()


def test_a_body_that_is_not_an_object_is_a_400(api, alice):
    response = api(alice).put(URL, [1, 2], format="json")
    assert response.status_code == 400
    assert error_paths(response) == ["(body)"]


def test_email_needs_an_address(api, alice):
    response = api(alice).put(URL, {"email": True}, format="json")
    assert response.status_code == 400
    assert error_paths(response) == ["email"]


def test_rotating_without_a_webhook_is_a_400(api, alice):
    response = api(alice).post(f"{URL}/rotate-secret")
    assert response.status_code == 400
    assert error_paths(response) == ["webhookUrl"]


def test_send_a_test(api, alice_mail):
    client = api(alice_mail)
    assert client.post(f"{URL}/test").status_code == 400  # nothing set up yet
    client.put(URL, {"email": True}, format="json")
    response = client.post(f"{URL}/test")
    assert response.status_code == 202
    assert response.json() == {"channels": ["email"]}
    assert Notification.objects.get().event == "test"


def test_each_user_sees_only_their_own(api, alice_mail, bob):
    api(alice_mail).put(URL, {"email": True, "events": ["ended"]}, format="json")
    assert api(bob).get(URL).json()["email"] is False


def test_a_read_token_reads_but_cannot_change(api, alice_mail):
    client = api(alice_mail, scopes=("read",))
    assert client.get(URL).status_code == 200
    assert client.put(URL, {"email": True}, format="json").status_code == 403
    assert client.post(f"{URL}/rotate-secret").status_code == 403
    assert client.post(f"{URL}/test").status_code == 403
    assert not NotificationSetting.objects.exists()


def test_anonymous_is_refused(api, alice):
    assert api().get(URL).status_code in (401, 403)
