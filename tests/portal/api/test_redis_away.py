"""Redis is a cache: with it unreachable, the API still reads and takes submissions (nothing it
keeps there is needed for correctness), and the cache's calls neither raise nor hang."""

from __future__ import annotations

import time

import pytest
from django.conf import settings
from django.core.cache import cache
from django.test import override_settings

from foundation.cache import UNAVAILABLE
from scheduling.models import Job
from tests.portal.api.conftest import job_spec
from tests.processes import free_port

pytestmark = pytest.mark.usefixtures("fleet", "queue")


@pytest.fixture
def redis_away():
    """The production cache backend, pointed at a port where no Redis answers."""
    away = {"default": {**settings.CACHES["default"], "LOCATION": f"redis://127.0.0.1:{free_port()}/0"}}
    if "redis" not in away["default"]["BACKEND"].lower():
        pytest.skip("the cache here is not Redis")  # make test always runs with Redis
    with override_settings(CACHES=away):
        yield


def test_the_api_reads_and_submits_while_redis_is_away(api, alice, redis_away):
    client = api(alice)
    before = UNAVAILABLE._value.get()
    submitted = client.post("/api/v1/jobs", job_spec(metadata__name="while-away"), format="json")
    assert submitted.status_code == 201, submitted.content
    listed = client.get("/api/v1/jobs")
    assert listed.status_code == 200
    assert [j["name"] for j in listed.json()["results"]] == ["while-away"]
    assert Job.objects.filter(name="while-away").count() == 1
    assert UNAVAILABLE._value.get() > before  # the misses were counted, not hidden


def test_every_cache_call_degrades_quickly(redis_away):
    started = time.monotonic()
    assert cache.get("k", "default") == "default"
    assert cache.get_many(["a", "b"]) == {}
    assert cache.add("k", 1, timeout=1) is False  # a doorbell stays silent rather than ringing twice
    cache.set("k", 1, timeout=1)
    cache.set_many({"a": 1})
    cache.delete("k")
    cache.delete_many(["a", "b"])
    assert cache.touch("k", 5) is False
    assert cache.has_key("k") is False
    with pytest.raises(ValueError):
        cache.incr("k")
    assert time.monotonic() - started < 10  # refused at once: nothing waits for an OS time-out
