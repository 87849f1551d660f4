"""The web surface under attack: password guessing on both login pages, scraping /metrics, and
what a debug page shows of the settings."""

from __future__ import annotations

from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.test import Client, RequestFactory
from django.utils import timezone
from django.views.debug import technical_500_response

from portal.error_reports import redact_url_passwords
from tests.factories import make_user

pytestmark = pytest.mark.django_db

LOGIN_PAGES = ["/accounts/login/", "/admin/login/"]


def guess(client: Client, page: str, username: str, password: str, **headers: str):
    return client.post(page, {"username": username, "password": password}, **headers)


def signed_in_as(client: Client) -> str | None:
    user = client.session.get("_auth_user_id")
    return None if user is None else str(user)


# --- login throttling -------------------------------------------------------------------------


@pytest.mark.parametrize("page", LOGIN_PAGES)
def test_wrong_passwords_lock_out_even_the_right_one(client, operator, settings, page):
    settings.AXES_FAILURE_LIMIT = 5
    answers = [guess(client, page, "ops", f"wrong-{i}").status_code for i in range(150)]
    assert answers[:4] == [200] * 4  # the form again, with an error
    assert set(answers[4:]) == {429}
    locked = guess(client, page, "ops", "ops")
    assert locked.status_code == 429 and int(locked["Retry-After"]) == settings.ORRERY_LOGIN_LOCKOUT_S
    assert "Too many failed sign-ins" in locked.content.decode()
    assert signed_in_as(client) is None


def test_the_lockout_ends_after_the_cool_off(client, alice, settings):
    settings.AXES_FAILURE_LIMIT = 3
    for i in range(3):
        guess(client, "/accounts/login/", "alice", f"wrong-{i}")
    assert guess(client, "/accounts/login/", "alice", "alice").status_code == 429
    AccessAttempt.objects.update(
        attempt_time=timezone.now() - timedelta(seconds=settings.ORRERY_LOGIN_LOCKOUT_S + 1)
    )
    assert guess(client, "/accounts/login/", "alice", "alice").status_code == 302
    assert signed_in_as(client) == str(alice.pk)


def test_the_lockout_holds_one_user_name_from_one_address(client, alice, bob, settings):
    """An attacker cannot lock alice out from everywhere, nor lock out everyone from their own
    address: the pair (user name, address) is what is locked."""
    settings.AXES_FAILURE_LIMIT = 3
    for i in range(5):
        guess(client, "/accounts/login/", "alice", f"wrong-{i}", REMOTE_ADDR="203.0.113.9")
    assert guess(client, "/accounts/login/", "alice", "alice", REMOTE_ADDR="203.0.113.9").status_code == 429
    assert guess(Client(), "/accounts/login/", "bob", "bob", REMOTE_ADDR="203.0.113.9").status_code == 302
    assert (
        guess(Client(), "/accounts/login/", "alice", "alice", REMOTE_ADDR="198.51.100.7").status_code == 302
    )


def test_a_forged_forwarded_for_does_not_reset_the_count(client, alice, settings):
    settings.AXES_FAILURE_LIMIT = 3
    for i in range(5):
        guess(client, "/accounts/login/", "alice", f"wrong-{i}", HTTP_X_FORWARDED_FOR=f"10.0.0.{i}")
    answer = guess(client, "/accounts/login/", "alice", "alice", HTTP_X_FORWARDED_FOR="10.9.9.9")
    assert answer.status_code == 429


def test_behind_a_proxy_the_address_is_the_one_the_proxy_appended(alice, settings):
    """The proxy appends the peer it saw; whatever the client put to its left is ignored."""
    settings.ORRERY_BEHIND_PROXY = True
    settings.AXES_FAILURE_LIMIT = 3
    attacker = {"REMOTE_ADDR": "10.0.0.2"}  # every request arrives from the proxy
    for i in range(3):
        forged = {"HTTP_X_FORWARDED_FOR": f"192.0.2.{i}, 203.0.113.9"}
        guess(Client(), "/accounts/login/", "alice", f"wrong-{i}", **attacker, **forged)
    locked = {"HTTP_X_FORWARDED_FOR": "192.0.2.77, 203.0.113.9"}
    assert guess(Client(), "/accounts/login/", "alice", "alice", **attacker, **locked).status_code == 429
    elsewhere = {"HTTP_X_FORWARDED_FOR": "198.51.100.7"}
    assert guess(Client(), "/accounts/login/", "alice", "alice", **attacker, **elsewhere).status_code == 302


def test_a_good_sign_in_clears_earlier_failures(client, alice, settings):
    settings.AXES_FAILURE_LIMIT = 3
    guess(client, "/accounts/login/", "alice", "wrong-1")
    guess(client, "/accounts/login/", "alice", "wrong-2")
    assert guess(client, "/accounts/login/", "alice", "alice").status_code == 302
    client.logout()
    guess(client, "/accounts/login/", "alice", "wrong-3")
    assert guess(client, "/accounts/login/", "alice", "alice").status_code == 302


# --- /metrics ---------------------------------------------------------------------------------

SCRAPE_TOKEN = "scrape-0123456789abcdefghijklmnopqrstuvwxyz"


@pytest.mark.parametrize(
    ("who", "authorization", "status"),
    [
        pytest.param(None, None, 401, id="anonymous"),
        pytest.param(None, "Bearer not-the-token", 403, id="wrong-token"),
        pytest.param(None, f"Bearer {SCRAPE_TOKEN[:-1]}", 403, id="token-prefix"),
        pytest.param(None, f"Basic {SCRAPE_TOKEN}", 401, id="other-scheme"),
        pytest.param("member", None, 403, id="member-session"),
        pytest.param(None, f"Bearer {SCRAPE_TOKEN}", 200, id="scrape-token"),
        pytest.param("staff", None, 200, id="staff-session"),
    ],
)
def test_metrics_need_the_scrape_token_or_a_staff_session(client, settings, who, authorization, status):
    settings.ORRERY_METRICS_TOKEN = SCRAPE_TOKEN
    if who:
        client.force_login(make_user(who, staff=who == "staff"))
    headers = {"HTTP_AUTHORIZATION": authorization} if authorization else {}
    answer = client.get("/metrics", **headers)
    assert answer.status_code == status
    assert (b"django_http_requests" in answer.content) == (status == 200)


def test_without_a_configured_token_no_bearer_opens_metrics(client, settings):
    settings.ORRERY_METRICS_TOKEN = ""
    for authorization in ("Bearer ", "Bearer x", "bearer"):
        assert client.get("/metrics", HTTP_AUTHORIZATION=authorization).status_code == 403, authorization


# --- debug pages ------------------------------------------------------------------------------

PASSWORDS = ["db-pw-4417", "redis-pw-9921", "broker-pw-3380", "cache-pw-5512", "layer-pw-7264"]


def test_the_debug_page_redacts_passwords_in_urls(settings):
    settings.DATABASE_URL = f"postgres://orrery:{PASSWORDS[0]}@db.example.org:5432/orrery"
    settings.REDIS_URL = f"redis://:{PASSWORDS[1]}@cache.example.org:6379/0"
    settings.CELERY_BROKER_URL = f"rediss://orrery:{PASSWORDS[2]}@broker.example.org:6380/1"
    settings.CACHES = settings.CACHES | {
        "example": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": f"redis://:{PASSWORDS[3]}@cache.example.org:6379/2",
        }
    }
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [(f"redis://u:{PASSWORDS[4]}@layer.example.org:6379/3", "extra")]},
        }
    }
    # Under runserver, META carries the process environment, URLs included.
    request = RequestFactory().get("/boom", DATABASE_URL=settings.DATABASE_URL)
    try:
        raise RuntimeError("boom")
    except RuntimeError as error:
        page = technical_500_response(request, type(error), error, error.__traceback__).content.decode()
    assert "db.example.org" in page and "layer.example.org" in page  # the settings are shown…
    for password in PASSWORDS:
        assert password not in page  # …without their passwords


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgres://orrery:pw@db:5432/orrery", "postgres://orrery:***@db:5432/orrery"),
        ("redis://:pw@cache:6379/0", "redis://:***@cache:6379/0"),
        ("amqp://u:p%40ss@mq//", "amqp://u:***@mq//"),
        ("postgres://u:p@ss@db/x", "postgres://u:***@db/x"),
        ("a redis://:one@h1 and redis://:two@h2", "a redis://:***@h1 and redis://:***@h2"),
        ("redis://cache:6379/0", "redis://cache:6379/0"),
        ("postgres://orrery@db/orrery", "postgres://orrery@db/orrery"),
        ("https://example.org/a:b@c", "https://example.org/a:b@c"),
    ],
)
def test_url_passwords_are_redacted(url, shown):
    assert redact_url_passwords(url, "***") == shown
