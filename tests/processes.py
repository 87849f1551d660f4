"""What the tests need to start real control-plane processes (servers, Celery workers)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import redis
from django.conf import settings
from django.db import close_old_connections, connection

ROOT = Path(__file__).resolve().parents[1]
CELERY = [sys.executable, "-m", "celery", "-A", "portal"]


def run_embedded(script: str, data_dir: Path, timeout: float = 180) -> Any:
    """Run ``script`` in a fresh interpreter configured like ``make demo`` (no DATABASE_URL, no
    REDIS_URL: SQLite and the in-process buffer) and return the JSON of its last line."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "REDIS_URL"} and not k.startswith("ORRERY")
    }
    env |= {"ORRERY_DATA_DIR": str(data_dir), "DJANGO_SETTINGS_MODULE": "portal.settings"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def control_plane_env(data_dir: Path, **overrides: str) -> dict[str, str]:
    """The environment of a server or worker process on the test database and Redis prefix,
    with a Celery queue of its own so that no other worker takes its tasks."""
    db = settings.DATABASES["default"]
    return {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}:{db['PASSWORD']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "REDIS_URL": settings.REDIS_URL,
        "ORRERY_REDIS_PREFIX": settings.ORRERY_REDIS_PREFIX,
        "ORRERY_CELERY_QUEUE": f"test-{uuid.uuid4().hex[:8]}",
        "ORRERY_DATA_DIR": str(data_dir),
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        **overrides,
    }


def celery_worker_argv(
    env: dict[str, str],
    data_dir: Path,
    *,
    roles: tuple[str, ...] | None = None,
    beat: bool = True,
    loglevel: str = "WARNING",
) -> list[str]:
    """A Celery worker on the environment's own queues: every role's (``settings.ORRERY_CELERY_ROLES``)
    unless ``roles`` names some, with its beat unless ``beat`` is false."""
    argv = [*CELERY, "worker", "--pool", "solo", "--loglevel", loglevel]
    argv += ["-Q", ",".join(role_queues(env, roles)), "--hostname", f"w{uuid.uuid4().hex[:8]}@%h"]
    if beat:
        argv += ["--beat", "--schedule", str(data_dir / f"beat-schedule-{uuid.uuid4().hex[:6]}")]
    return argv


def celery_beat_argv(env: dict[str, str], data_dir: Path, loglevel: str = "INFO") -> list[str]:
    """A Celery beat process of its own (production runs two: only the lease holder sends)."""
    schedule = str(data_dir / f"beat-schedule-{uuid.uuid4().hex[:6]}")  # never shared by two beats
    return [*CELERY, "beat", "--loglevel", loglevel, "--schedule", schedule]


def role_queues(env: dict[str, str], roles: tuple[str, ...] | None = None) -> list[str]:
    """The queue names of ``roles`` (every role when None) under the environment's prefix."""
    return [f"{env['ORRERY_CELERY_QUEUE']}.{role}" for role in roles or settings.ORRERY_CELERY_ROLES]


def queued_tasks(env: dict[str, str], roles: tuple[str, ...] | None = None) -> list[str]:
    """The names of the tasks waiting in the environment's queues of ``roles`` (of every role and
    the bare prefix when None), read from Redis: kombu keeps a queue as a list of JSON messages
    under the queue's name."""
    queues = role_queues(env, roles) + ([env["ORRERY_CELERY_QUEUE"]] if roles is None else [])
    client = redis.Redis.from_url(env["REDIS_URL"])
    try:
        return [json.loads(raw)["headers"]["task"] for queue in queues for raw in client.lrange(queue, 0, -1)]
    finally:
        client.close()


def forget_queues(env: dict[str, str]) -> None:
    """Delete the environment's queues from Redis (a test's leftovers)."""
    client = redis.Redis.from_url(env["REDIS_URL"])
    try:
        client.delete(*role_queues(env), env["ORRERY_CELERY_QUEUE"])
    finally:
        client.close()


class PrivateRedis:
    """A ``redis-server`` of the test's own on a free port, without persistence, which the test may
    stop and start again (never the shared server)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir, self.port = data_dir, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> PrivateRedis:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir)]
        argv += ["--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait(self._answers, f"redis-server on port {self.port}", timeout=15)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()  # as a crash or a restart loses it: nothing saved
            self.process.wait()

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as probe:
                probe.sendall(b"PING\r\n")
                return probe.recv(16).startswith(b"+PONG")
        except OSError:
            return False


class Service:
    """A real process of the control plane: the ASGI server (Daphne), gunicorn, or a Celery
    worker with its beat."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, port: int | None = None) -> None:
        self.argv, self.env, self.log, self.port = argv, env, log, port
        self.process: subprocess.Popen | None = None

    def start(self) -> Service:
        with open(self.log, "a") as log:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(
                self.argv, cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=log
            )
        if self.port:
            wait(lambda: _answers(self.port), f"{self.argv[2]} to answer")
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _answers(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read()
        return True
    except urllib.error.HTTPError:  # 401 without the scrape token: the server is up all the same
        return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait(condition, what: str, timeout: float = 30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not connection.in_atomic_block:  # inside a test's transaction, the connection is it
            close_old_connections()
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for: {what}")


def spawn_agent(
    server: str, join: str, work_dir: Path, name: str, gpus: str, *extra: str
) -> subprocess.Popen:
    """A real ``orrery-agent`` process with fake GPUs, logging to ``<work_dir>.log``; the join
    token goes through the environment, as on a real node (never on the command line)."""
    argv = [sys.executable, "-m", "clusters.agent", "--server", server]
    argv += ["--fake-gpus", gpus, "--work-dir", str(work_dir), "--name", name, "--grace", "1", *extra]
    env = os.environ | {"ORRERY_JOIN_TOKEN": join}
    with open(f"{work_dir}.log", "a") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, env=env)


def squeue(job_id: str, fmt: str = "%T") -> str:
    """What the dev Slurm cluster's ``squeue`` says of one job ("" once it is gone)."""
    argv = ["squeue", "-h", "-j", job_id, "-o", fmt]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()


def scancel_tagged(tag: str) -> None:
    """Cancel the dev Slurm cluster's live jobs of one Orrery cluster (those carrying its tag),
    and no one else's."""
    listed = subprocess.run(["squeue", "-h", "-o", "%i|%k"], capture_output=True, text=True, timeout=30)
    ids = [
        i for i, _, c in (line.partition("|") for line in listed.stdout.splitlines()) if c == f"orrery:{tag}"
    ]
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, timeout=30)
