"""Websockets of the live dashboards, through the real ASGI app (session, origin check, router):
who may subscribe, what they hear, and at what rate."""

from __future__ import annotations

import asyncio
import time

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.test import Client

from portal.asgi import application
from tests.factories import make_job, make_project, make_queue, make_user

pytestmark = pytest.mark.django_db(transaction=True)


def _headers(user=None, origin: str = "http://localhost") -> list[tuple[bytes, bytes]]:
    headers = [(b"origin", origin.encode()), (b"host", b"localhost")]
    if user is not None:
        client = Client()
        client.force_login(user)
        cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"
        headers.append((b"cookie", cookie.encode()))
    return headers


async def _connect(path: str, user=None, origin: str = "http://localhost"):
    headers = await sync_to_async(_headers)(user, origin)
    socket = WebsocketCommunicator(application, path, headers=headers)
    connected, code = await socket.connect()
    return socket, connected, code


def _event(job_id: int, project_id: int, to: str) -> dict:
    data = {"job_id": job_id, "project_id": project_id, "from_state": "PENDING", "to_state": to}
    return {"type": "live.event", "event": "JobStateChanged", "data": data | {"reason": "", "at": ""}}


@pytest.fixture(autouse=True)
async def close_consumer_connections():
    """The consumers' queries run on a worker thread with its own connection: close it, or the
    test database cannot be dropped at the end of the run."""
    yield
    from channels.db import database_sync_to_async
    from django.db import connections

    await database_sync_to_async(connections.close_all)()


@pytest.fixture
def world(db):
    alice, bob = make_user("alice"), make_user("bob")
    vision = make_project("vision", members=(alice,))
    nlp = make_project("nlp", members=(bob,))
    jobs = [make_job(alice, make_queue(vision)) for _ in range(1)]
    jobs += [make_job(alice, jobs[0].queue) for _ in range(4)]
    other = make_job(bob, make_queue(nlp))
    return {"alice": alice, "bob": bob, "vision": vision, "nlp": nlp, "jobs": jobs, "other": other}


async def test_who_may_subscribe(world):
    _, connected, code = await _connect("/ws/jobs/")
    assert not connected and code == 4401  # not signed in
    job = world["jobs"][0]
    _, connected, code = await _connect(f"/ws/jobs/{job.pk}/", world["bob"])
    assert not connected and code == 4404  # not bob's project: as if it did not exist
    _, connected, _ = await _connect("/ws/fleet/", world["alice"], origin="http://evil.example")
    assert not connected  # origin checked against ALLOWED_HOSTS
    socket, connected, _ = await _connect(f"/ws/jobs/{job.pk}/", world["alice"])
    assert connected and (await socket.receive_json_from())["type"] == "hello"
    await socket.disconnect()


async def test_updates_are_coalesced_and_never_cross_projects(world):
    socket, connected, _ = await _connect("/ws/jobs/", world["alice"])
    assert connected and (await socket.receive_json_from())["type"] == "hello"
    layer = get_channel_layer()
    vision, nlp = world["vision"].pk, world["nlp"].pk
    started = time.monotonic()
    for job in world["jobs"]:  # five events in a burst...
        await layer.group_send(f"project.{vision}", _event(job.pk, vision, "SCHEDULED"))
        await layer.group_send(f"project.{vision}", _event(job.pk, vision, "RUNNING"))
    # ...and one of bob's, sent (wrongly) to alice's group: the consumer still drops it.
    await layer.group_send(f"project.{vision}", _event(world["other"].pk, nlp, "RUNNING"))
    delta = await socket.receive_json_from(timeout=3)
    assert delta["type"] == "delta"
    assert delta["jobs"] == {str(j.pk): "RUNNING" for j in world["jobs"]}  # one message, latest states
    assert str(world["other"].pk) not in delta["jobs"]
    await layer.group_send(f"project.{vision}", _event(world["jobs"][0].pk, vision, "SUCCEEDED"))
    second = await socket.receive_json_from(timeout=3)
    assert second["jobs"] == {str(world["jobs"][0].pk): "SUCCEEDED"}
    assert time.monotonic() - started >= 0.9  # at most one message per second
    assert await socket.receive_nothing(timeout=1.2)
    await socket.disconnect()


async def test_a_transition_reaches_the_job_page(world):
    from scheduling.services.jobs import hold_job

    job = world["jobs"][0]
    socket, connected, _ = await _connect(f"/ws/jobs/{job.pk}/", world["alice"])
    assert connected and (await socket.receive_json_from())["type"] == "hello"
    await sync_to_async(hold_job)(job, actor=world["alice"])
    delta = await socket.receive_json_from(timeout=3)
    assert delta["jobs"] == {str(job.pk): "HELD"}
    await socket.disconnect()
    await asyncio.sleep(0)


async def test_a_user_removed_from_the_project_is_cut_off(world, monkeypatch):
    from portal import consumers
    from portal.models import Membership

    monkeypatch.setattr(consumers.LiveConsumer, "recheck_s", 1.0)
    job = world["jobs"][0]
    socket, connected, _ = await _connect(f"/ws/jobs/{job.pk}/", world["alice"])
    assert connected and (await socket.receive_json_from())["type"] == "hello"
    await sync_to_async(lambda: Membership.objects.filter(user=world["alice"]).delete())()
    closed = await socket.receive_output(timeout=4)
    assert closed == {"type": "websocket.close", "code": 4404}
