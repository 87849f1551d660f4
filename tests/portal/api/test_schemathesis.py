"""Schemathesis against the app's own OpenAPI document (/api/schema/): every operation, called
in-process through the WSGI app with a valid bearer token, never answers with a server error.

Driven by hand rather than through schemathesis' pytest plugin so that the cases run inside
pytest-django's test transaction: one hypothesis run per operation and generation mode."""

from __future__ import annotations

from functools import cache

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from rest_framework.throttling import SimpleRateThrottle
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from portal.services.tokens import issue_token
from tests.factories import make_job

MAX_EXAMPLES = 20


@cache
def load_schema() -> schemathesis.BaseSchema:
    """The document the running app serves, fetched through its WSGI interface."""
    return schemathesis.openapi.from_wsgi(
        "/api/schema/", get_wsgi_application(), headers={"Accept": "application/json"}
    )


def operations() -> list[tuple[str, str]]:
    return [
        (op.path, op.method.upper()) for op in (result.ok() for result in load_schema().get_all_operations())
    ]


@pytest.fixture
def in_test_transaction():
    """The WSGI handler closes "old" connections around each request; inside a test transaction
    that would drop the transaction. Django's own test client disconnects the same signal."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def world(alice, vision, queue, fleet, bob_job, monkeypatch):
    """Objects for path parameters to hit: a job, a token to delete, the cluster."""
    monkeypatch.setattr(SimpleRateThrottle, "THROTTLE_RATES", {"submit": "100000/min", "read": "100000/min"})
    _, plaintext = issue_token(alice, name="schemathesis")
    spare, _ = issue_token(alice, name="spare")
    job = make_job(alice, queue)
    return {
        "headers": {"Authorization": f"Bearer {plaintext}"},
        "path_parameters": {"id": job.pk, "name": fleet.cluster.name},
        "spare_token": spare.pk,
        "other_job": bob_job.pk,
    }


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("path, method", operations(), ids=lambda v: v)
def test_no_server_errors(in_test_transaction, world, path, method, mode):
    operation = load_schema()[path][method]
    strategies = [operation.as_strategy(generation_mode=mode)]
    if "{" in path:
        fixed = {
            name: world["spare_token"] if path.startswith("/api/v1/tokens") else value
            for name, value in world["path_parameters"].items()
            if "{" + name + "}" in path
        }
        strategies.append(operation.as_strategy(generation_mode=mode, path_parameters=fixed))
        if path.startswith("/api/v1/jobs/"):
            other = {"id": world["other_job"]}
            strategies.append(operation.as_strategy(generation_mode=mode, path_parameters=other))

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=st.one_of(strategies))
    def call(case: schemathesis.Case) -> None:
        response = case.call(headers=world["headers"])
        seen.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error], headers=world["headers"])

    seen: list[int] = []
    call()
    # The token got through at least once: the run exercised the views, not just authentication.
    assert set(seen) - {401}, seen
