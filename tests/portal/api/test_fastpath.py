"""The WSGI fast path for submission (``portal.api.fastpath``): it answers plain submissions as
the views would, and leaves everything else to Django."""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from foundation import live
from portal.api.fastpath import bearer
from portal.choices import Scope
from portal.services.tokens import issue_token
from scheduling.models import Job
from tests.portal.api.conftest import FastPathHandler, job_spec
from tests.processes import run_embedded

pytestmark = pytest.mark.usefixtures("fleet", "queue")

JOBS = "/api/v1/jobs"


def fast_client(api, user):
    client = api(user)
    client.handler = FastPathHandler(client.handler)
    return client


@pytest.mark.parametrize("https", [False, True])
def test_a_plain_submission_is_answered_by_the_fast_path_as_by_the_view(api, alice, settings, https):
    settings.SECURE_HSTS_SECONDS = 3600  # sent over HTTPS only
    fast, view = fast_client(api, alice), api(alice)
    answers = [
        client.post(JOBS, json.dumps(job_spec()), content_type="application/json", secure=https)
        for client in (fast, view)
    ]
    assert fast.handler.answered == 1
    assert [a.status_code for a in answers] == [201, 201]
    bodies = [a.json() for a in answers]
    for body in bodies:
        body.pop("id"), body.pop("ref"), body.pop("submittedAt")
    assert bodies[0] == bodies[1]
    # The two jobs' ids may differ in length (99 and 100): each length is its own body's.
    assert [int(a.headers["Content-Length"]) for a in answers] == [len(a.content) for a in answers]
    headers = [sorted((k, v) for k, v in a.headers.items() if k != "Content-Length") for a in answers]
    assert headers[0] == headers[1]
    assert ("Strict-Transport-Security" in answers[0].headers) is https
    batch = json.dumps({"jobs": [job_spec()] * 3})
    batch = fast.post(JOBS + "/batch", batch, content_type="application/json")
    assert batch.status_code == 201 and batch.json()["count"] == 3
    assert fast.handler.answered == 2
    assert Job.objects.count() == 5


@pytest.mark.parametrize(
    "how",
    [
        {"path": JOBS + "?dryRun=true"},
        {"content_type": "application/yaml"},
        {"body": b"{not json"},
        {"body": json.dumps(job_spec(spec__resources__gpus="h100:99")).encode()},
        {"token": "Bearer orr_nothing"},
        {"idempotency": "\x01"},
    ],
    ids=["query", "yaml", "malformed", "refused-spec", "bad-token", "bad-key"],
)
def test_what_the_fast_path_leaves_to_django(api, alice, how):
    client = fast_client(api, alice)
    body = how.get("body", json.dumps(job_spec()).encode())
    extra = {}
    if "token" in how:
        client.credentials(HTTP_AUTHORIZATION=how["token"])
    if "idempotency" in how:
        extra["HTTP_IDEMPOTENCY_KEY"] = how["idempotency"]
    content_type = how.get("content_type", "application/json")
    if content_type == "application/yaml":
        body = b"apiVersion: orrery/v1\n"
    client.post(how.get("path", JOBS), body, content_type=content_type, **extra)
    assert client.handler.answered == 0


async def _received(layer, channel: str) -> dict:
    return await asyncio.wait_for(layer.receive(channel), 5)


@pytest.mark.parametrize("fast", [False, True], ids=["view", "fast"])
def test_a_submission_is_published_to_its_project_once_committed(
    api, alice, queue, fast, django_capture_on_commit_callbacks
):
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(f"project.{queue.project_id}", channel)
    client = fast_client(api, alice) if fast else api(alice)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(JOBS, json.dumps(job_spec()), content_type="application/json")
    assert response.status_code == 201
    assert live.flush()  # the publisher thread has sent it
    message = async_to_sync(_received)(layer, channel)
    assert message["event"] == "JobsSubmitted"
    assert (message["data"]["job_ids"], message["data"]["count"]) == ([response.json()["id"]], 1)


SQLITE_SCRIPT = r"""
import io, json
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from django.contrib.auth import get_user_model
from portal.services.demo import seed_demo
from portal.services.tokens import issue_token
from portal.wsgi import application
seed_demo()
_, token = issue_token(get_user_model().objects.get(username="alice"), name="t", scopes=["read", "submit"])
spec = {"apiVersion": "orrery/v1", "kind": "Job", "metadata": {"name": "t", "project": "vision"},
        "spec": {"queue": "default", "resources": {"gpus": 0, "cpus": 1}, "timeLimit": "1h", "run": "true"}}
statuses = []
for kind, body in (("", spec), ("/batch", {"jobs": [spec, spec]}), ("", spec)):
    payload = json.dumps(body).encode()
    environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/api/v1/jobs" + kind, "QUERY_STRING": "",
               "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": str(len(payload)),
               "HTTP_AUTHORIZATION": f"Bearer {token}", "HTTP_HOST": "127.0.0.1", "SERVER_NAME": "127.0.0.1",
               "SERVER_PORT": "8000", "REMOTE_ADDR": "127.0.0.1", "wsgi.input": io.BytesIO(payload),
               "wsgi.url_scheme": "http", "wsgi.errors": io.StringIO()}
    application(environ, lambda status, headers, exc_info=None: statuses.append(int(status.split()[0])))
print(json.dumps(statuses))
"""


def test_the_fast_path_answers_on_the_embedded_default_too(tmp_path):
    """On SQLite (``make demo``'s database behind the WSGI entry point) a token already used is
    read as the views read it: SQLite hands times back without a zone, which the written-out
    PostgreSQL read compared with an aware clock (a 500 from the second submission on)."""
    assert run_embedded(SQLITE_SCRIPT, tmp_path) == [201, 201, 201]


def test_the_fast_path_reads_a_token_as_the_orm_does(alice):
    """Its token query is written out: the JSON list of scopes still comes back a list, not the
    driver's text (where ``"read" in '["read-only"]'`` would hold)."""
    _, plaintext = issue_token(alice, name="narrow", scopes=["read"])
    token, generation = bearer(f"Bearer {plaintext}")
    assert token.scopes == ["read"] and not token.has_scope(Scope.SUBMIT)
    assert token.user == alice and isinstance(generation, int)
