"""Per-user rate limits: the "submit" and "read" scopes answer 429 with Retry-After, counted
exactly across threads and processes in Redis."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from django.core.cache import caches
from rest_framework.throttling import SimpleRateThrottle

from foundation.cache import UNAVAILABLE
from portal.api.throttles import AnonymousThrottle, SubmitThrottle
from scheduling.models import Job
from tests.portal.api.conftest import error_paths, job_spec
from tests.processes import free_port

pytestmark = pytest.mark.usefixtures("fleet", "queue")

JOBS = "/api/v1/jobs"


@pytest.fixture
def rates(monkeypatch):
    """DRF copies the rates at import; set them on the class for the length of a test."""

    def set_rates(**scopes: str) -> None:
        monkeypatch.setattr(
            SimpleRateThrottle,
            "THROTTLE_RATES",
            {"submit": "1000/min", "read": "1000/min", "anon": "1000/min"} | scopes,
        )

    return set_rates


def test_submissions_over_the_rate_are_a_429_with_retry_after(api, alice, rates):
    rates(submit="3/min")
    client = api(alice)
    codes = [client.post(JOBS, job_spec(metadata__name=f"j{i}"), format="json").status_code for i in range(3)]
    assert codes == [201, 201, 201]
    refused = client.post(JOBS, job_spec(metadata__name="j3"), format="json")
    assert refused.status_code == 429
    assert 0 < int(refused["Retry-After"]) <= 60
    assert error_paths(refused) == []
    assert "throttled" in refused.json()["detail"].lower()
    assert Job.objects.count() == 3


def test_the_submit_scope_covers_batches_actions_and_tokens(api, alice, alice_job, rates):
    rates(submit="2/min")
    client = api(alice)
    assert client.post(f"{JOBS}/{alice_job.pk}/hold").status_code == 200
    assert client.post(f"{JOBS}/batch", {"jobs": [job_spec()]}, format="json").status_code == 201
    assert client.post(f"{JOBS}/{alice_job.pk}/release").status_code == 429
    assert client.post("/api/v1/tokens", {}, format="json").status_code == 429


def test_reads_have_their_own_budget(api, alice, rates):
    rates(submit="1/min", read="2/min")
    client = api(alice)
    assert client.post(JOBS, job_spec(), format="json").status_code == 201
    assert client.post(JOBS, job_spec(), format="json").status_code == 429
    assert [client.get(JOBS).status_code for _ in range(2)] == [200, 200]
    refused = client.get("/api/v1/clusters")
    assert refused.status_code == 429 and refused.has_header("Retry-After")


def test_limits_are_per_user(api, alice, bob, nlp_queue, rates):
    rates(read="1/min")
    assert api(alice).get(JOBS).status_code == 200
    assert api(alice).get(JOBS).status_code == 429  # a second token of alice's: same user
    assert api(bob).get(JOBS).status_code == 200


def test_anonymous_requests_are_refused_before_they_are_counted(api, alice, rates):
    rates(read="1/min", anon="1/min")
    anonymous = api()
    assert [anonymous.get(JOBS).status_code for _ in range(3)] == [401, 401, 401]
    assert api(alice).get(JOBS).status_code == 200


def test_concurrent_requests_never_pass_the_rate_together(alice, rates):
    """Eight threads, one user, 200 requests against 100 a minute: exactly 100 pass, as the log
    is trimmed, counted and added to in one step (a read and a write back let racing requests
    count from the same copy)."""
    rates(submit="100/min")
    request = SimpleNamespace(user=alice)
    allowed = []

    def burst() -> None:
        allowed.extend(SubmitThrottle().allow_request(request, None) for _ in range(25))

    threads = [threading.Thread(target=burst) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(allowed) == 200
    assert allowed.count(True) == 100


def test_the_log_holds_the_requests_of_the_window_only(alice, rates):
    rates(submit="3/min")
    throttle = SubmitThrottle()
    request = SimpleNamespace(user=alice)
    assert [throttle.allow_request(request, None) for _ in range(5)] == [True] * 3 + [False] * 2
    assert 0 < throttle.wait() <= 60
    backend = caches["default"]
    key = backend.make_and_validate_key(f"{throttle.get_cache_key(request, None)}:log")
    client = backend._cache.get_client(key)
    assert client.zcard(key) == 3  # refusals add nothing
    assert 0 < client.pttl(key) <= 60_000
    throttle.timer = lambda: time.time() + 61  # a minute on: the window is empty again
    assert throttle.allow_request(request, None)
    assert client.zcard(key) == 1


def test_a_rate_of_none_at_all_refuses_everything_for_the_whole_window(alice, rates):
    rates(submit="0/min")
    throttle = SubmitThrottle()
    assert not throttle.allow_request(SimpleNamespace(user=alice), None)
    assert throttle.wait() == 60


def test_while_redis_is_away_the_limit_refuses_no_one_and_says_so(alice, rates, settings):
    rates(submit="1/min")
    away = {"default": {**settings.CACHES["default"], "LOCATION": f"redis://127.0.0.1:{free_port()}/0"}}
    if "redis" not in away["default"]["BACKEND"].lower():
        pytest.skip("the cache here is not Redis")  # make test always runs with Redis
    settings.CACHES = away
    before = UNAVAILABLE._value.get()
    request = SimpleNamespace(user=alice)
    assert [SubmitThrottle().allow_request(request, None) for _ in range(3)] == [True] * 3
    assert UNAVAILABLE._value.get() >= before + 3


def test_an_anonymous_client_is_its_peer_not_the_forwarded_for_it_writes(settings):
    throttle = AnonymousThrottle()
    request = SimpleNamespace(META={"REMOTE_ADDR": "10.0.0.9", "HTTP_X_FORWARDED_FOR": "1.2.3.4"})
    assert throttle.get_ident(request) == "10.0.0.9"
    settings.ORRERY_BEHIND_PROXY = True  # then the entry the proxy appended, never the client's
    request.META["HTTP_X_FORWARDED_FOR"] = "1.2.3.4, 172.16.0.7"
    assert throttle.get_ident(request) == "172.16.0.7"
