"""The WSGI fast path answers the hot agent endpoints exactly as the Django views do."""

from __future__ import annotations

import io

import orjson
import pytest
from django.core.signals import request_finished, request_started
from django.db import close_old_connections

from clusters.api.fastpath import AgentFastPath
from clusters.ingest.buffer import get_buffer
from clusters.services.credentials import issue_cluster_credential
from tests.factories import make_cluster, make_node

pytestmark = pytest.mark.django_db


def call(app, path: str, body: bytes, bearer: str = "", method: str = "POST", length: str | None = None):
    seen = {}

    def start_response(status, headers):
        seen["status"], seen["headers"] = status, dict(headers)

    environ = {
        "PATH_INFO": path,
        "REQUEST_METHOD": method,
        "CONTENT_LENGTH": length or str(len(body)),
        "wsgi.input": io.BytesIO(body),
        "HTTP_AUTHORIZATION": f"Bearer {bearer}",
    }
    # As Django's test client does: the request signals must not close the connection that
    # holds the test's transaction.
    for signal in (request_started, request_finished):
        signal.disconnect(close_old_connections)
    try:
        payload = b"".join(app(environ, start_response))
    finally:
        for signal in (request_started, request_finished):
            signal.connect(close_old_connections)
    return int(seen["status"].split()[0]), orjson.loads(payload) if payload else None


@pytest.fixture
def setup():
    cluster = make_cluster("fast")
    node = make_node(cluster, gpus=1, name="f0")
    _, cred = issue_cluster_credential(cluster)
    return node, cred


def report(seq: int = 1, cluster: str = "fast") -> bytes:
    return orjson.dumps(
        {"cluster": cluster, "nodes": [{"node": "f0", "boot_id": "b", "seq": seq, "gpus": []}]}
    )


def test_fast_and_django_paths_agree(client, setup):
    _, cred = setup
    not_django = lambda environ, start_response: pytest.fail("the fast path fell through")  # noqa: E731
    fast = AgentFastPath(not_django)
    for body, expected in ((report(1), 200), (report(1), 200), (b"{", 400), (report(2, "other"), 403)):
        get_buffer().clear()
        fast_answer = call(fast, "/api/v1/agent/report", body, cred)
        get_buffer().clear()
        django = client.post(
            "/api/v1/agent/report", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {cred}"
        )
        assert fast_answer == (expected, django.json()) and django.status_code == expected
    assert call(fast, "/api/v1/agent/heartbeat", b"{}", "orn_unknown")[0] == 401


def test_other_requests_go_to_django(setup):
    reached = []

    def django(environ, start_response):
        reached.append(environ["PATH_INFO"])
        start_response("204 No Content", [])
        return []

    fast = AgentFastPath(django)
    call(fast, "/api/v1/jobs", b"{}")
    call(fast, "/api/v1/agent/register", b"{}")
    call(fast, "/api/v1/agent/report", b"", method="GET")
    assert reached == ["/api/v1/jobs", "/api/v1/agent/register", "/api/v1/agent/report"]


@pytest.mark.parametrize("length", ["-1", "abc", str(100 * 2**20)])
def test_bad_or_huge_lengths_are_refused(setup, length):
    status, body = call(AgentFastPath(None), "/api/v1/agent/report", report(), setup[1], length=length)
    assert status == 413 and "too large" in body["detail"]
    assert get_buffer().latest() == {}
