"""Per-tenant fairness: at most ORRERY_API_TENANT_CONCURRENCY requests of one user in flight at
once across every web process; one more is a 429 with Retry-After, and other users get in."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psycopg
import pytest
from django.conf import settings

from portal.api import fairness
from portal.api.fairness import LocalSlots, TenantSlots
from portal.services.tokens import issue_token
from tests.factories import make_job, make_project, make_queue, make_user
from tests.processes import Service, control_plane_env, free_port, wait

JOBS = "/api/v1/jobs"


def needs_redis() -> None:
    if not settings.REDIS_URL:
        pytest.skip("slots shared across processes live in Redis")


# --- the slots ---------------------------------------------------------------------------------


def test_a_tenant_at_its_limit_is_refused_and_another_is_not():
    needs_redis()
    slots = TenantSlots(settings.REDIS_URL, f"{settings.ORRERY_REDIS_PREFIX}limit:")
    held = [slots.acquire("a", 2, 60) for _ in range(2)]
    assert all(s is not None and s.shared for s in held)
    assert slots.acquire("a", 2, 60) is None
    assert slots.acquire("b", 2, 60) is not None
    slots.release(held[0])
    assert slots.acquire("a", 2, 60) is not None


def test_two_processes_share_one_count():
    needs_redis()
    prefix = f"{settings.ORRERY_REDIS_PREFIX}shared:"
    first, second = TenantSlots(settings.REDIS_URL, prefix), TenantSlots(settings.REDIS_URL, prefix)
    assert first.acquire("a", 2, 60) is not None
    assert second.acquire("a", 2, 60) is not None
    assert first.acquire("a", 2, 60) is None


def test_the_slot_of_a_worker_that_never_gave_it_back_expires_with_its_lease():
    needs_redis()
    slots = TenantSlots(settings.REDIS_URL, f"{settings.ORRERY_REDIS_PREFIX}lease:")
    assert slots.acquire("a", 1, 0.3) is not None  # never released: its worker was killed
    assert slots.acquire("a", 1, 0.3) is None
    time.sleep(0.5)
    assert slots.acquire("a", 1, 0.3) is not None


def test_without_redis_the_process_counts():
    slots = TenantSlots("", "x:")
    held = slots.acquire("a", 1, 60)
    assert held is not None and not held.shared
    assert slots.acquire("a", 1, 60) is None
    slots.release(held)
    assert slots.acquire("a", 1, 60) is not None


def test_local_counts_go_back_to_nothing():
    local = LocalSlots()
    assert local.acquire("a", 2) and local.acquire("a", 2) and not local.acquire("a", 2)
    local.release("a")
    local.release("a")
    assert local._held == {}


def test_while_redis_is_down_the_limit_holds_per_process_and_redis_is_used_again_when_back(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(fairness, "REDIS_RETRY_S", 0.2)
    port = free_port()
    slots = TenantSlots(f"redis://127.0.0.1:{port}/0", "down:")
    held = slots.acquire("a", 2, 60)
    assert held is not None and not held.shared  # nothing listens: counted here
    assert slots.acquire("a", 2, 60) is not None
    assert slots.acquire("a", 2, 60) is None
    slots.release(held)  # given back where it was taken
    redis = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.3)
        back = wait(lambda: slots.acquire("b", 2, 60), "Redis to answer again", timeout=10)
        assert back.shared
    finally:
        redis.terminate()
        redis.wait(10)


# --- through the API, on two real gunicorn processes --------------------------------------------


def call(url: str, token: str, method: str = "GET", path: str = JOBS) -> tuple[int, dict, dict]:
    request = urllib.request.Request(
        f"{url}{path}", method=method, headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def gunicorn(env: dict[str, str], log: Path) -> tuple[Service, str]:
    port = free_port()
    argv = [sys.executable, "-m", "gunicorn", "portal.wsgi:application", "--bind", f"127.0.0.1:{port}"]
    argv += ["--workers", "1", "--threads", "4", "--log-level", "warning"]
    return Service(argv, env, log, port).start(), f"http://127.0.0.1:{port}"


def waiting_on_locks(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone()
        return row[0]


@pytest.mark.django_db(transaction=True)
def test_a_tenants_requests_beyond_its_limit_get_429_across_processes_and_another_tenant_gets_in(
    tmp_path,
):
    needs_redis()
    alice, bob = make_user("alice"), make_user("bob")
    queue = make_queue(make_project("vision", members=(alice, bob)))
    job = make_job(alice, queue, name="held-up")
    _, alice_token = issue_token(alice, name="t")
    _, bob_token = issue_token(bob, name="t")
    env = control_plane_env(tmp_path, ORRERY_API_TENANT_CONCURRENCY="2")
    first, first_url = gunicorn(env, tmp_path / "first.log")
    second, second_url = gunicorn(env, tmp_path / "second.log")
    dsn = env["DATABASE_URL"]
    answers: list[int] = []
    try:
        with psycopg.connect(dsn) as lock:
            # Alice's two holds wait on the job's row, one in each process, each holding a slot.
            lock.execute("SELECT 1 FROM scheduling_job WHERE id = %s FOR UPDATE", [job.pk])

            def hold(url: str) -> None:
                answers.append(call(url, alice_token, "POST", f"{JOBS}/{job.pk}/hold")[0])

            threads = [threading.Thread(target=hold, args=(url,)) for url in (first_url, second_url)]
            for thread in threads:
                thread.start()
            wait(lambda: waiting_on_locks(dsn) >= 2, "alice's two requests to be in flight")

            code, headers, body = call(first_url, alice_token)
            assert code == 429, body
            assert 1 <= int(headers["Retry-After"]) <= 3
            assert body["errors"] == [] and "at most 2" in body["detail"]
            assert call(second_url, alice_token)[0] == 429
            assert call(first_url, bob_token)[0] == 200  # another tenant is let in meanwhile
            lock.rollback()
        for thread in threads:
            thread.join(30)
        assert sorted(answers) == [200, 409]  # one held it; the other found it held already
        assert call(first_url, alice_token)[0] == 200  # the slots came back with the answers
    finally:
        first.stop()
        second.stop()
