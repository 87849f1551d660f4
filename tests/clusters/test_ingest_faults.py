"""Heartbeat ingest under faults: Redis and the database going away and coming back, and flow
control. Redis faults are made on a private redis-server (never the shared one); database
faults by pointing connections at a closed port, and by terminating a kept connection's
backend from another session."""

from __future__ import annotations

import io
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack

import orjson
import psycopg
import pytest
import redis
from django.db import connection

from clusters.choices import NodeState
from clusters.ingest import buffer as buffer_module
from clusters.ingest.buffer import RedisBuffer, get_buffer
from clusters.ingest.flow import in_flight
from clusters.models import Node
from clusters.services.aggregation import flush_heartbeats
from clusters.services.credentials import issue_cluster_credential
from clusters.services.lifecycle import run_node_lifecycle
from clusters.traffic import HeartbeatTraffic
from tests.factories import ensure_catalog, make_cluster, make_node
from tests.processes import free_port, wait


class PrivateRedis:
    """A redis-server of this test's own, on its own port, without persistence: killed,
    restarted and flushed at will."""

    def __init__(self, tmp_path) -> None:
        self.port, self.dir = free_port(), tmp_path
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen([*argv, "--dir", str(self.dir)], stdout=subprocess.DEVNULL)
        wait(lambda: self._ping(), "the private redis-server to answer", timeout=10)

    def _ping(self) -> bool:
        try:
            return bool(redis.Redis(port=self.port, socket_connect_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def flushall(self) -> None:
        redis.Redis(port=self.port).flushall()


@pytest.fixture
def private_redis(tmp_path) -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = PrivateRedis(tmp_path)
    server.start()
    previous = buffer_module._buffer
    buffer_module._buffer = RedisBuffer(server.url, "orrery-test:hb:")
    try:
        yield server
    finally:
        buffer_module._buffer = previous
        server.kill()


def report(client, cluster: str, names: list[str], seq: int, credential: str):
    body = {
        "cluster": cluster,
        "nodes": [{"node": n, "boot_id": "b1", "seq": seq, "gpus": []} for n in names],
    }
    return client.post(
        "/api/v1/agent/report",
        orjson.dumps(body),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {credential}",
    )


@pytest.mark.django_db
def test_losing_redis_answers_503_and_no_node_flaps(client, private_redis, settings):
    settings.NODE_GRACE = 2
    settings.ORRERY_HEARING_GAP_S = 0.5
    cluster = make_cluster("cache")
    nodes = [make_node(cluster, gpus=1, name=f"c{i}") for i in range(6)]
    names = [n.name for n in nodes]
    _, credential = issue_cluster_credential(cluster)
    seq = 1
    assert report(client, "cache", names, seq, credential).status_code == 200
    flush_heartbeats()

    private_redis.kill()
    outage_ends = time.monotonic() + settings.NODE_GRACE + 0.5
    while time.monotonic() < outage_ends:
        seq += 1
        answer = report(client, "cache", names, seq, credential)
        assert answer.status_code == 503, answer.content  # never a 500
        assert int(answer.headers["Retry-After"]) >= 1
        assert answer.json()["retryAfter"] == int(answer.headers["Retry-After"])
        with pytest.raises(redis.RedisError):
            flush_heartbeats()  # the flush fails too, and the watermark stays where it was
        assert run_node_lifecycle().not_ready == []  # the control plane is deaf, not the nodes
        time.sleep(0.3)

    private_redis.start()  # back, and empty
    for fault in ("restarted", "flushed"):
        if fault == "flushed":
            private_redis.flushall()
        seq += 1
        assert report(client, "cache", names, seq, credential).status_code == 200, fault
        flush_heartbeats()
        assert run_node_lifecycle().not_ready == [], fault
    end = time.monotonic() + settings.NODE_GRACE + 0.5
    while time.monotonic() < end:  # hearing again for the grace: still nobody is silent
        seq += 1
        report(client, "cache", names, seq, credential)
        flush_heartbeats()
        assert run_node_lifecycle().not_ready == []
        time.sleep(0.3)
    assert set(Node.objects.filter(cluster=cluster).values_list("state", flat=True)) == {NodeState.READY}


# --- the database away ------------------------------------------------------------------------
def http(url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.mark.django_db(transaction=True)
def test_every_endpoint_answers_503_while_the_database_is_away_then_works(live_server):
    """The live server opens a connection per request; with the database's port closed every
    request fails to connect, as during a restart."""
    cluster = make_cluster("dbdown")
    make_node(cluster, gpus=1, name="d0")
    _, credential = issue_cluster_credential(cluster)
    agent = {"Authorization": f"Bearer {credential}", "Content-Type": "application/json"}
    beat = orjson.dumps(
        {"cluster": "dbdown", "nodes": [{"node": "d0", "boot_id": "b", "seq": 1, "gpus": []}]}
    )
    api_token = {"Authorization": "Bearer orr_not-a-real-token"}
    port = connection.settings_dict["PORT"]
    connection.settings_dict["PORT"] = str(free_port())  # the dict every thread's connection uses
    try:
        status, headers, body = http(f"{live_server.url}/api/v1/agent/report", beat, agent)
        assert status == 503 and int(headers["Retry-After"]) >= 1 and orjson.loads(body)["retryAfter"]
        status, headers, body = http(f"{live_server.url}/api/v1/jobs", headers=api_token)
        assert status == 503 and int(headers["Retry-After"]) >= 1
        assert orjson.loads(body)["detail"] == "The database is unavailable; retry later."
        page = {"Cookie": "sessionid=abcdefghijklmnopqrstuvwxyz012345"}  # loading it needs the database
        status, headers, body = http(f"{live_server.url}/", headers=page)
        assert status == 503 and headers["Content-Type"].startswith("text/plain") and b"briefly" in body
    finally:
        connection.settings_dict["PORT"] = port
        connection.close()
    status, _, body = http(f"{live_server.url}/api/v1/agent/report", beat, agent)  # the next works
    assert status == 200 and orjson.loads(body)["accepted"] == 1
    assert http(f"{live_server.url}/api/v1/jobs", headers=api_token)[0] == 401


@pytest.mark.django_db(transaction=True)
def test_a_kept_connection_whose_backend_was_terminated_is_replaced(settings):
    """A database restart kills every kept connection. The WSGI fast path keeps connections
    between requests (CONN_MAX_AGE) and checks them at the start of each (conn_health_checks):
    the first request after the restart must be answered, never a 500."""
    from clusters.api.fastpath import AgentFastPath
    from tests.clusters.test_fastpath import report as fast_report

    assert connection.settings_dict["CONN_MAX_AGE"] > 0 and connection.settings_dict["CONN_HEALTH_CHECKS"]
    cluster = make_cluster("fast")
    make_node(cluster, gpus=1, name="f0")
    _, credential = issue_cluster_credential(cluster)
    app = AgentFastPath(None)

    def call(seq: int) -> int:
        seen = {}
        body = fast_report(seq)
        environ = {
            "PATH_INFO": "/api/v1/agent/report",
            "REQUEST_METHOD": "POST",
            "CONTENT_LENGTH": str(len(body)),
            "wsgi.input": io.BytesIO(body),
            "HTTP_AUTHORIZATION": f"Bearer {credential}",
        }
        b"".join(app(environ, lambda status, headers: seen.update(status=status)))
        return int(seen["status"].split()[0])

    assert call(1) == 200
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    db = connection.settings_dict
    with psycopg.connect(
        host=db["HOST"], port=db["PORT"], user=db["USER"], password=db["PASSWORD"], dbname=db["NAME"]
    ) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
    assert call(2) == 200
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        assert cursor.fetchone()[0] != pid


# --- flow control -----------------------------------------------------------------------------
@pytest.mark.django_db
def test_ingest_pushes_back_with_429_past_the_in_flight_limit(client, settings):
    settings.ORRERY_INGEST_MAX_IN_FLIGHT = 2
    settings.ORRERY_INGEST_RETRY_AFTER_S = 4
    cluster = make_cluster("busy")
    make_node(cluster, gpus=1, name="b0")
    _, credential = issue_cluster_credential(cluster)
    with ExitStack() as held:  # two requests being served in this process
        assert all(held.enter_context(in_flight.slot()) for _ in range(2))
        answer = report(client, "busy", ["b0"], 1, credential)
        assert answer.status_code == 429
        assert 4 <= int(answer.headers["Retry-After"]) <= 8
        assert answer.json()["retryAfter"] == int(answer.headers["Retry-After"])
        assert get_buffer().latest([Node.objects.get(name="b0").pk]) == {}  # nothing stored
    assert in_flight.count == 0
    assert report(client, "busy", ["b0"], 1, credential).status_code == 200


@pytest.mark.django_db(transaction=True)
def test_the_traffic_generator_honours_retry_after(live_server, settings):
    ensure_catalog()
    settings.ORRERY_INGEST_MAX_IN_FLIGHT = 1
    settings.ORRERY_INGEST_RETRY_AFTER_S = 1
    traffic = HeartbeatTraffic(
        live_server.url, clusters=1, nodes=4, mode="per-node", gpus_per_node=1, prefix="ra"
    )
    traffic.setup()
    with in_flight.slot():  # this process is "busy": every heartbeat is refused
        refused_at = time.time()
        assert traffic.tick() == 0 and traffic.sent == 4 and traffic.refused == 4
        waits = [n.retry_at - refused_at for n in traffic.nodes]
        assert all(1 <= w <= 2 * 1.5 + 1 for w in waits)  # Retry-After 1–2 s, with 0–50 % jitter
        assert traffic.tick() == 0 and traffic.sent == 4  # told to wait: nothing is sent
    settings.ORRERY_INGEST_MAX_IN_FLIGHT = 16  # room for the generator's concurrent heartbeats
    wait(lambda: time.time() > max(n.retry_at for n in traffic.nodes), "the suggested waits to pass", 10)
    assert traffic.tick() == 4
