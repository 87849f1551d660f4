"""Live updates through Redis faults, end to end: a real Daphne server on the test database with
channels-redis, a real websocket client, and Redis flushed (the test's own database only) or a
private ``redis-server`` stopped and started again. A socket held idle stays open; after a flush
or a restart the page hears again within a few seconds, without the user reloading it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import websocket
from asgiref.sync import async_to_sync
from django.conf import settings
from django.test import Client
from django.utils.module_loading import import_string

from tests.factories import make_project, make_user
from tests.processes import Service, control_plane_env, free_port, wait

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
RESTART = 4503  # Redis lost the socket's groups: the page reconnects and resynchronises from REST
HEARD_WITHIN_S = 10.0  # one recheck (3 s) and the page's reconnect (1 s), with room for a slow machine


def _daphne(tmp_path: Path, redis_url: str) -> Service:
    port = free_port()
    env = control_plane_env(
        tmp_path,
        REDIS_URL=redis_url,
        ORRERY_ALLOWED_HOSTS="127.0.0.1,localhost",
        ORRERY_SECRET_KEY=settings.SECRET_KEY,  # the session's auth hash is signed with it
    )
    argv = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "portal.asgi:application"]
    return Service(argv, env, tmp_path / "daphne.log", port).start()


@pytest.fixture
def alice(db):
    user = make_user("alice")
    make_project("vision", members=(user,))
    client = Client()
    client.force_login(user)
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"


class Page:
    """What ``static/portal/live.js`` does with one socket, driven by hand: open it, read deltas,
    and after any close but 4401 or 4404 open it again (the page waits 1 s first, doubling to
    15 s while it fails; this waits 1 s each time)."""

    def __init__(self, port: int, path: str, cookie: str) -> None:
        self.url, self.cookie = f"ws://127.0.0.1:{port}{path}", cookie
        self.closes: list[int] = []
        self.ws: websocket.WebSocket | None = None
        self.open()
        assert self.ws is not None

    def open(self) -> None:
        try:
            self.ws = websocket.create_connection(
                self.url, origin="http://localhost", cookie=self.cookie, timeout=5
            )
            assert json.loads(self.ws.recv())["type"] == "hello"
        except (websocket.WebSocketException, OSError):
            self.ws = None

    def next_message(self, timeout: float) -> dict | None:
        """The next message within ``timeout`` (None when none came). A close is recorded (its
        code; 1006 when the connection just dropped) and the socket opened again, as the page
        does."""
        if self.ws is None:
            time.sleep(1.0)
            self.open()
            return {"type": "reconnected" if self.ws else "down"}
        self.ws.settimeout(timeout)
        try:
            opcode, data = self.ws.recv_data(control_frame=True)
        except websocket.WebSocketTimeoutException:
            return None
        except (websocket.WebSocketException, OSError):
            opcode, data = websocket.ABNF.OPCODE_CLOSE, b""
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            code = int.from_bytes(data[:2], "big") if len(data) >= 2 else 1006
            self.closes.append(code)
            assert code not in (4401, 4404), code
            self.ws = None
            return {"type": "closed", "code": code}
        if opcode != websocket.ABNF.OPCODE_TEXT:
            return {"type": "control"}
        return json.loads(data)

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()


def _node_event(node_id: int) -> dict:
    data = {"node_id": node_id, "cluster_id": 1, "from_state": "ready", "to_state": "down"}
    return {"type": "live.event", "event": "NodeStateChanged", "data": data}


def _publisher(redis_url: str):
    """A channel layer of this process on ``redis_url``, configured as the servers' is."""
    layer = settings.CHANNEL_LAYERS["default"]
    config = layer.get("CONFIG", {})
    hosts = [{**host, "address": redis_url} for host in config.get("hosts", [{}])]
    return import_string(layer["BACKEND"])(**{**config, "hosts": hosts})


def _hears(page: Page, layer, within: float) -> bool:
    """Publish node events to the fleet group every half second until the page's next delta
    carries one (True) or ``within`` passes (False)."""
    deadline, node = time.monotonic() + within, 0
    while time.monotonic() < deadline:
        node += 1
        with contextlib.suppress(Exception):  # Redis still on its way back: try until the deadline
            async_to_sync(layer.group_send)("fleet", _node_event(node))
        end = time.monotonic() + 0.5
        while (left := end - time.monotonic()) > 0:
            message = page.next_message(left)
            if message is None:
                break
            if message["type"] == "delta" and message["nodes"]:
                return True
    return False


@pytest.fixture
def shared_redis() -> Iterator[str]:
    if not settings.REDIS_URL:
        pytest.skip("the fault is in the Redis channel layer")
    yield settings.REDIS_URL
    redis.Redis.from_url(settings.REDIS_URL).flushdb()  # this test's own database only


def test_an_idle_socket_stays_open(tmp_path, alice, shared_redis):
    server = _daphne(tmp_path, shared_redis)
    try:
        page = Page(server.port, "/ws/fleet/", alice)
        started = time.monotonic()
        while time.monotonic() - started < 16:  # three blocking receives of the layer (5 s each)
            message = page.next_message(16 - (time.monotonic() - started))
            assert message is None, f"after {time.monotonic() - started:.1f} s idle: {message}"
        assert page.closes == []
        assert _hears(page, _publisher(shared_redis), within=HEARD_WITHIN_S)
        page.close()
    finally:
        server.stop()


def test_a_flush_does_not_silence_open_pages(tmp_path, alice, shared_redis):
    server = _daphne(tmp_path, shared_redis)
    try:
        page = Page(server.port, "/ws/fleet/", alice)
        layer = _publisher(shared_redis)
        assert _hears(page, layer, within=HEARD_WITHIN_S)
        redis.Redis.from_url(shared_redis).flushdb()  # group memberships gone with everything else
        assert _hears(page, layer, within=HEARD_WITHIN_S)
        # The server told the page to reconnect (and so resynchronise from REST, for what it
        # missed), once: it was not dropped with an error.
        assert page.closes == [RESTART], page.closes
        page.close()
    finally:
        server.stop()


@pytest.fixture
def private_redis(tmp_path) -> Iterator[tuple[str, callable]]:
    """A redis-server of this test's own (never the shared one), and a function that stops it
    and starts it again on the same port, empty."""
    port = free_port()
    argv = [REDIS_SERVER, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]
    url = f"redis://127.0.0.1:{port}/0"
    box: dict[str, subprocess.Popen] = {}

    def start() -> None:
        box["p"] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait(lambda: _pings(url), "the private redis-server to answer", timeout=15)

    def restart(down_s: float) -> None:
        box["p"].terminate()
        box["p"].wait(10)
        time.sleep(down_s)
        start()

    start()
    yield url, restart
    box["p"].terminate()
    box["p"].wait(10)


def _pings(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.mark.parametrize("down_s", [0.0, 6.0], ids=["quick-restart", "down-6s"])
def test_a_redis_restart_does_not_silence_open_pages(tmp_path, alice, private_redis, down_s):
    url, restart = private_redis
    server = _daphne(tmp_path, url)
    try:
        page = Page(server.port, "/ws/fleet/", alice)
        layer = _publisher(url)
        assert _hears(page, layer, within=HEARD_WITHIN_S)
        restart(down_s)
        assert _hears(page, _publisher(url), within=HEARD_WITHIN_S)
        assert page.closes == [RESTART], page.closes  # told to reconnect once Redis was back
        page.close()
    finally:
        server.stop()


def test_after_a_restart_the_layer_counts_no_fault_for_a_connection_pooled_before_it(private_redis):
    """redis-py hands out a connection pooled before the restart without noticing it is closed;
    its first command must go through on a fresh one (the configured retry), or a join fails
    (the socket is refused) or a receive counts a fault (every socket that reconnected after
    the restart is closed again)."""
    url, restart = private_redis
    layer = _publisher(url)

    async def exchange() -> int:
        channel = await layer.new_channel()
        await layer.group_add("fleet", channel)
        await layer.group_send("fleet", _node_event(1))
        faults = layer.faults
        await asyncio.wait_for(layer.receive(channel), timeout=10)
        await layer.group_discard("fleet", channel)
        return layer.faults - faults

    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(exchange()) == 0
        restart(0.0)  # the pool keeps the connections the exchange used, closed by the server
        assert loop.run_until_complete(exchange()) == 0
    finally:
        loop.run_until_complete(layer.close_pools())
        loop.close()


def test_every_close_code_is_one_daphne_sends():
    """Daphne (autobahn) sends only 1000 and 3000–4999 from an application and raises on any
    other code, so a consumer closing with 1011 stays open, its recheck task dead: fail-open."""
    from portal import consumers

    codes = [consumers.SIGNED_OUT, consumers.NOT_FOUND, consumers.RECHECK_FAILED, consumers.REDIS_LOST]
    assert all(code == 1000 or 3000 <= code <= 4999 for code in codes), codes
