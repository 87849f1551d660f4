"""The production process set on one machine, on a PostgreSQL and a Redis of its own, for the
fault suite and the soak.

* ``PrivatePostgres`` and ``PrivateRedis``: servers started for the suite in a temporary
  directory, on free ports (PostgreSQL with ``fsync=off``, Redis with no persistence), so that a
  scenario may restart, kill or flush them without touching the services the rest of the suite
  shares;
* ``Process``: one control-plane process in a session of its own (so that its whole process
  group can be killed, as systemd kills a unit's control group); ``Supervisor`` restarts a dead
  one after ``restart_delay_s``, as ``Restart=always`` does, and remembers every death;
* ``Topology``: two gunicorns, two daphnes, two Celery workers and two Celery beats on one
  database seeded by ``tests.faults.seed``; ``Api`` is a client of both gunicorns that retries
  with its Idempotency-Key; ``Heartbeats`` is a thread reporting every simulated node through
  the collector API.

The test process never opens the private database through Django (its Django is bound to the
suite's shared test database): it reads with psycopg (``Topology.query``).
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psycopg
import redis

ROOT = Path(__file__).resolve().parents[2]
PG_BIN = max(Path("/usr/lib/postgresql").glob("*/bin"), default=None)  # Debian's layout
TEMPLATE = "orrery_template"


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 60.0, every: float = 0.2) -> Any:
    """``condition()``'s first true value; fails after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        with suppress(psycopg.OperationalError, OSError):
            value = condition()
            if value:
                return value
        if time.monotonic() >= end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for: {what}")
        time.sleep(every)


# --- private servers ------------------------------------------------------------------------------


class PrivatePostgres:
    """A PostgreSQL cluster of the suite's own: ``initdb`` into ``root`` (as the ``postgres``
    user when run as root), served on a free loopback port with durability off."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.data, self.socket_dir, self.log = root / "pgdata", root / "pgsock", root / "postgres.log"

    def _run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        assert PG_BIN is not None, "PostgreSQL's server binaries are not installed"
        command = [str(PG_BIN / argv[0]), *argv[1:]]
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{argv[0]} failed: {done.stdout[-2000:]} {done.stderr[-2000:]}"
        return done

    def init(self) -> PrivatePostgres:
        self.socket_dir.mkdir(parents=True)
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
            shutil.chown(self.socket_dir, "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        return self

    def start(self) -> None:
        options = (
            # Durability against a crash of the server (-m immediate) is kept: a committed
            # transaction is in the WAL before the commit returns. Only an OS crash would lose it.
            f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1 -c fsync=off"
            " -c full_page_writes=off -c max_connections=300"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def url(self, database: str) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    def execute(self, sql: str, database: str = "postgres") -> None:
        with psycopg.connect(self.url(database), autocommit=True) as conn:
            conn.execute(sql)

    def migrate_template(self) -> float:
        """Create and migrate the template every topology's database is copied from; returns
        the seconds it took."""
        started = time.monotonic()
        self.execute(f'CREATE DATABASE "{TEMPLATE}"')
        env = os.environ | {"DATABASE_URL": self.url(TEMPLATE), "DJANGO_SETTINGS_MODULE": "portal.settings"}
        env.pop("REDIS_URL", None)
        done = subprocess.run(
            [sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return time.monotonic() - started

    def create_database(self, name: str) -> str:
        self.execute(f'CREATE DATABASE "{name}" TEMPLATE "{TEMPLATE}"')
        return self.url(name)


class PrivateRedis:
    """A Redis of the suite's own on a free loopback port, with no persistence: a restart
    comes back empty, as a lost Redis does."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(self.root), "--daemonize", "no"]
        with open(self.root / "redis.log", "a") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_for(self.client().ping, "Redis to answer", timeout=20, every=0.05)

    def shutdown(self) -> None:
        """``SHUTDOWN NOSAVE``: everything in it is gone."""
        with suppress(redis.ConnectionError):
            self.client().shutdown(nosave=True)
        if self.process is not None:
            self.process.wait(20)

    def restart(self, down_s: float = 0.0) -> None:
        self.shutdown()
        time.sleep(down_s)
        self.start()

    def flushall(self) -> None:
        self.client().flushall()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(20)


# --- processes ------------------------------------------------------------------------------------


@dataclass
class Death:
    name: str
    at: float  # wall clock
    returncode: int | None
    planned: bool


class Process:
    """One control-plane process, in a session of its own. ``port``: it serves HTTP there and
    is up when it answers."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log: Path,
        port: int | None = None,
        ready_line: str | None = None,
    ) -> None:
        self.name, self.argv, self.env, self.log, self.port = name, argv, env, log, port
        self.ready_line = ready_line  # what its log says once it serves (when it has no port)
        self.log_offset = 0
        self.popen: subprocess.Popen | None = None
        self.started_at = 0.0
        self.planned_kill = False

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def start(self, wait: bool = True) -> Process:
        self.log_offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "a") as log:  # the child keeps its own copy of the descriptor
            self.popen = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started_at = time.time()
        self.planned_kill = False
        if wait:
            self.wait_up()
        return self

    def wait_up(self, timeout: float = 90.0) -> None:
        if self.port:
            wait_for(lambda: answers(self.port), f"{self.name} to answer on :{self.port}", timeout)
        if self.ready_line:
            wait_for(self.ready, f"{self.name} to log {self.ready_line!r}", timeout)

    def ready(self) -> bool:
        """Whether this run of the process says it serves (always, for one without a marker)."""
        if not self.ready_line:
            return self.alive()
        with open(self.log, "rb") as log:
            log.seek(self.log_offset)
            return self.ready_line.encode() in log.read()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        with suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL to the whole process group: what systemd does to a unit's leftovers."""
        if self.popen is None:
            return
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.popen.wait(20)

    def stop(self) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.popen.wait(10)
        self.kill_group()


def group_members(pgid: int) -> list[int]:
    """Pids of the processes in process group ``pgid`` (a process and what it forked)."""
    members = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # after the name: state, ppid, pgrp
            members.append(int(proc.name))
    return members


def rss_mib(pids: list[int]) -> float:
    """Resident memory of ``pids`` together, in MiB."""
    total = 0
    for pid in pids:
        with suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return round(total / 1024, 1)


def answers(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/metrics")
        conn.getresponse().read()
        return True
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


class Supervisor(threading.Thread):
    """Restarts every dead process after ``restart_delay_s``, as systemd's ``Restart=always``
    with ``RestartSec`` does, and records each death (planned: the scenario killed it)."""

    def __init__(self, processes: dict[str, Process], restart_delay_s: float = 1.0) -> None:
        super().__init__(daemon=True, name="supervisor")
        self.processes, self.delay = processes, restart_delay_s
        self.deaths: list[Death] = []
        self.halted = threading.Event()
        self.paused: set[str] = set()

    def run(self) -> None:
        while not self.halted.wait(0.1):
            for process in list(self.processes.values()):
                if process.popen is None or process.alive() or process.name in self.paused:
                    continue
                code = process.popen.returncode
                self.deaths.append(Death(process.name, time.time(), code, process.planned_kill))
                process.kill_group()
                if self.halted.wait(self.delay):
                    return
                process.start(wait=False)

    def unplanned(self, since: float = 0.0) -> list[Death]:
        return [d for d in self.deaths if not d.planned and d.at >= since]


# --- clients ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    at: float
    status: int  # 0: no answer (refused, reset, timed out)
    retry_after: str | None


def refusals(answers: list[Answer], since: float, until: float = float("inf")) -> list[Answer]:
    """Answers in the window that are neither a success, nor a missing answer (a client
    retries), nor a 503/429 telling when to retry: what a client must not be given."""
    return [
        a
        for a in answers
        if since <= a.at <= until
        and a.status not in (0, 200, 201)
        and not (a.status in (429, 503) and a.retry_after)
    ]


class Api:
    """A client of the API behind two gunicorns, as a load balancer and a careful client are
    together: each call goes to the next server; a refused connection, a 5xx or a 429 is
    retried (after ``Retry-After`` when the server gives one) with the same Idempotency-Key."""

    def __init__(self, ports: list[int], token: str) -> None:
        self.ports, self.token = ports, token
        self._next = itertools.cycle(range(len(ports)))
        self._lock = threading.Lock()
        self.answers: list[Answer] = []  # every answer to a submission (0: none came)

    def _port(self) -> int:
        with self._lock:
            return self.ports[next(self._next)]

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float = 15,
    ) -> tuple[int, Any, dict[str, str]]:
        """One request to the next server; raises OSError when none answered."""
        conn = http.client.HTTPConnection("127.0.0.1", self._port(), timeout=timeout)
        try:
            sent = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
            sent |= headers or {}
            conn.request(method, path, orjson.dumps(body) if body is not None else None, sent)
            response = conn.getresponse()
            payload = response.read()
            try:
                data = orjson.loads(payload) if payload else None
            except orjson.JSONDecodeError:
                data = payload[:200]
            return response.status, data, {k.lower(): v for k, v in response.getheaders()}
        except http.client.HTTPException as exc:
            raise OSError(str(exc)) from exc
        finally:
            conn.close()

    def submit(
        self,
        spec: dict,
        key: str | None = None,
        deadline_s: float = 120.0,
        path: str = "/api/v1/jobs",
        timeout: float = 15.0,
    ):
        """Submit until the server answers 200/201 with the same key; returns ``(status, body,
        answers)`` where ``answers`` lists every status seen (``0``: no answer)."""
        key = key or uuid.uuid4().hex
        seen: list[int] = []
        end = time.monotonic() + deadline_s
        while True:
            try:
                status, body, headers = self.call("POST", path, spec, {"Idempotency-Key": key}, timeout)
            except OSError:
                status, body, headers = 0, None, {}
            seen.append(status)
            self.answers.append(Answer(time.time(), status, headers.get("retry-after")))
            if status in (200, 201):
                return status, body, seen
            if 400 <= status < 500 and status != 429:
                raise AssertionError(f"POST {path} refused: {status} {body}")
            if time.monotonic() >= end:
                raise AssertionError(f"POST {path} never accepted within {deadline_s:g} s: {seen[-10:]}")
            time.sleep(min(float(headers.get("retry-after", 0.2) or 0.2), 5.0))


def job_spec(
    project: str, *, gpus: int = 1, seconds: float = 2, queue: str = "default", name: str = "f"
) -> dict:
    return {
        "apiVersion": "orrery/v1",
        "kind": "Job",
        "metadata": {"name": name, "project": project},
        "spec": {
            "queue": queue,
            "resources": {"gpus": f"a100:{gpus}"},
            "run": "true",
            "sim": {"duration": f"{seconds}s"},
        },
    }


@dataclass
class Submitter:
    """Submits one job every ``every_s`` through ``api`` until stopped, keyed; remembers each
    accepted job and when it was accepted."""

    api: Api
    project: str
    every_s: float = 0.3
    seconds: float = 2.0
    accepted: dict[str, int] = field(default_factory=dict)  # key -> job id
    accepted_at: list[tuple[float, int]] = field(default_factory=list)  # (wall clock, job id)
    failures: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="submitter")

    def start(self) -> Submitter:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            key = uuid.uuid4().hex
            try:
                spec = job_spec(self.project, seconds=self.seconds)
                _, body, _ = self.api.submit(spec, key, deadline_s=90)
            except AssertionError:
                self.failures += 1
                continue
            self.accepted[key] = body["id"]
            self.accepted_at.append((time.time(), body["id"]))

    def first_accepted_after(self, t: float) -> float | None:
        return next((at for at, _ in self.accepted_at if at > t), None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)


class Heartbeats(threading.Thread):
    """Every ``interval_s``, a report for every node of every cluster not ``silent``, in
    1,000-node batches through ``agent/report`` on alternating gunicorns. A batch that gets no
    200 is sent again (a collector's spool) until it is answered; the next round waits for it.
    Counts what it sent and what the server said of it."""

    def __init__(
        self,
        ports: list[int],
        fleet: dict[str, dict],
        interval_s: float = 2.0,
        threads: int = 2,
        after: Heartbeats | None = None,
    ) -> None:
        """``after``: go on from another sender's boot ids and sequence (the same collectors)."""
        super().__init__(daemon=True, name="heartbeats")
        self.ports, self.fleet, self.interval = ports, fleet, interval_s
        self.silent: set[str] = set()
        self.boot = after.boot if after else {n: uuid.uuid4().hex for c in fleet.values() for n in c["nodes"]}
        self.seq = after.seq if after else 0
        self.acked: dict[str, int] = dict(after.acked) if after else {}  # node -> last seq answered 200
        self.sent = self.accepted = self.stale = self.unknown = self.failed = 0
        self.answered_at: list[float] = []
        self.answers: list[Answer] = []
        self.rounds = 0
        self.halted = threading.Event()
        self._ports = itertools.cycle(ports)
        self._lock = threading.Lock()
        self.threads = threads

    def _batches(self) -> list[tuple[str, str, list[str]]]:
        return [
            (cluster, spec["credential"], spec["nodes"][i : i + 1000])
            for cluster, spec in self.fleet.items()
            if cluster not in self.silent
            for i in range(0, len(spec["nodes"]), 1000)
        ]

    def _body(self, cluster: str, nodes: list[str], seq: int, gpus: int) -> bytes:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return orjson.dumps(
            {
                "cluster": cluster,
                "nodes": [
                    {
                        "node": n,
                        "boot_id": self.boot[n],
                        "seq": seq,
                        "sent_at": now,
                        "cpu": 0.2,
                        "memory": 2**34,
                        "power_w": 900.0,
                        "agent_version": "faults",
                        "gpus": [
                            {"index": g, "util": 10.0, "memory_used_mb": 100, "power_w": 80.0, "temp_c": 40.0}
                            for g in range(gpus)
                        ],
                    }
                    for n in nodes
                ],
            }
        )

    def _send(self, cluster: str, credential: str, nodes: list[str], seq: int) -> None:
        body = self._body(cluster, nodes, seq, self.fleet[cluster]["gpus"])
        headers = {"Authorization": f"Bearer {credential}", "Content-Type": "application/json"}
        if self.halted.is_set():
            return  # stopped before this batch of the round went out: nothing was sent
        with self._lock:
            self.sent += len(nodes)
        while not self.halted.is_set():
            with self._lock:
                port = next(self._ports)
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            wait = 0.2
            try:
                conn.request("POST", "/api/v1/agent/report", body, headers)
                response = conn.getresponse()
                payload = response.read()
                self.answers.append(Answer(time.time(), response.status, response.getheader("Retry-After")))
                if response.status == 200:
                    answer = orjson.loads(payload)
                    with self._lock:
                        self.accepted += answer["accepted"]
                        self.stale += answer["stale"]
                        self.unknown += len(answer["unknown"])
                        self.answered_at.append(time.time())
                        self.acked.update(dict.fromkeys(nodes, seq))
                    return
                wait = float(response.getheader("Retry-After") or 0.2)
            except (OSError, http.client.HTTPException, ValueError):
                self.answers.append(Answer(time.time(), 0, None))
            finally:
                conn.close()
            with self._lock:
                self.failed += 1
            self.halted.wait(min(wait, 5.0))

    def run(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.threads) as pool:
            while not self.halted.is_set():
                started = time.monotonic()
                self.seq += 1
                batches = [(*batch, self.seq) for batch in self._batches()]
                list(pool.map(lambda b: self._send(*b), batches))
                self.rounds += 1
                self.halted.wait(max(self.interval - (time.monotonic() - started), 0.0))

    @property
    def lost(self) -> int:
        """Reports sent but never answered (the sender stopped while retrying them)."""
        return self.sent - self.accepted - self.stale - self.unknown

    def last_answer_after(self, t: float) -> float | None:
        with self._lock:
            return next((at for at in self.answered_at if at > t), None)

    def stop(self) -> None:
        self.halted.set()
        self.join(60)


# --- the topology ---------------------------------------------------------------------------------

TIMERS = {
    "ORRERY_HEARTBEAT_INTERVAL": "2",
    "ORRERY_NODE_GRACE": "15",
    "ORRERY_NODE_FAILOVER_AFTER": "30",
    "ORRERY_NODE_RECOVERY": "4",
    "ORRERY_SCHEDULER_RESYNC_S": "10",
    "ORRERY_SCHEDULER_STALL_S": "3",
    "ORRERY_THROTTLE_SUBMIT": "1000000/min",
    "ORRERY_THROTTLE_READ": "1000000/min",
    "ORRERY_SIM_DEFAULT_DURATION_S": "2",
    "ORRERY_LOG_LEVEL": "WARNING",
}


class Topology:
    """The production process set on ``database`` (a fresh copy of the migrated template) and
    the private Redis: two of each of gunicorn (2 workers × 4 threads), daphne, Celery worker
    (solo pool) and Celery beat, supervised. ``seed`` is what ``tests.faults.seed`` printed."""

    WEB, WS = ("web-1", "web-2"), ("ws-1", "ws-2")
    WORKERS, BEATS = ("worker-1", "worker-2"), ("beat-1", "beat-2")

    def __init__(
        self,
        pg: PrivatePostgres,
        rds: PrivateRedis,
        root: Path,
        *,
        clusters: int = 2,
        nodes: int = 10,
        gpus: int = 8,
        env: dict[str, str] | None = None,
        gunicorn_workers: int = 2,
    ) -> None:
        self.pg, self.redis, self.root = pg, rds, root
        (root / "static").mkdir(parents=True, exist_ok=True)
        self.database = f"faults_{uuid.uuid4().hex[:8]}"
        started = time.monotonic()
        self.url = pg.create_database(self.database)
        self.env = {
            **os.environ,
            **TIMERS,
            "DATABASE_URL": self.url,
            "REDIS_URL": rds.url,
            "ORRERY_REDIS_PREFIX": f"{self.database}:",
            "ORRERY_DATA_DIR": str(root),
            "DJANGO_SETTINGS_MODULE": "portal.settings",
            **(env or {}),
        }
        self.env.pop("ORRERY_CELERY_QUEUE", None)  # production queues, whatever they are
        self.seed = self._seed(clusters, nodes, gpus)
        self.seed_s = time.monotonic() - started
        self.processes: dict[str, Process] = {}
        self.web_ports = [free_port() for _ in self.WEB]
        for name, port in zip(self.WEB, self.web_ports, strict=True):
            argv = [
                sys.executable,
                "-m",
                "gunicorn",
                "portal.wsgi:application",
                "--bind",
                f"127.0.0.1:{port}",
            ]
            argv += ["--workers", str(gunicorn_workers), "--worker-class", "gthread", "--threads", "4"]
            # --preload: a restarted server listens only once it can answer (the application
            # loads before the socket opens), and a killed worker is replaced by a fork.
            argv += ["--preload", "--log-level", "warning", "--graceful-timeout", "5"]
            self._add(name, argv, port)
        self.ws_ports = [free_port() for _ in self.WS]
        for name, port in zip(self.WS, self.ws_ports, strict=True):
            argv = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port)]
            self._add(name, [*argv, "portal.asgi:application"], port)
        for name in self.WORKERS:
            argv = [sys.executable, "-m", "celery", "-A", "portal", "worker", "--pool", "solo"]
            self._add(name, [*argv, "-n", f"{name}@%h", "--loglevel", "INFO"], ready_line=" ready.")
        for name in self.BEATS:
            argv = [sys.executable, "-m", "celery", "-A", "portal", "beat", "--loglevel", "INFO"]
            argv += ["--schedule", str(root / f"{name}-schedule")]
            self._add(name, argv, ready_line="beat: Starting")
        self.supervisor = Supervisor(self.processes)
        self.api = Api(self.web_ports, self.seed["token"])
        self._conn: psycopg.Connection | None = None

    def _seed(self, clusters: int, nodes: int, gpus: int) -> dict:
        argv = [sys.executable, "-m", "tests.faults.seed", "--clusters", str(clusters)]
        argv += ["--nodes", str(nodes), "--gpus", str(gpus)]
        done = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)

    def _add(
        self, name: str, argv: list[str], port: int | None = None, ready_line: str | None = None
    ) -> None:
        # PGAPPNAME names each process's database sessions, so pg_stat_activity says whose they are.
        env = self.env | {"PGAPPNAME": f"orrery-{name}"}
        self.processes[name] = Process(name, argv, env, self.root / f"{name}.log", port, ready_line)

    @property
    def project(self) -> str:
        return self.seed["project"]

    def start(self) -> Topology:
        for process in self.processes.values():
            process.start(wait=False)
        for process in self.processes.values():
            process.wait_up()
        self.supervisor.start()
        wait_for(lambda: self.last_cycle_at() is not None, "a first scheduling cycle", timeout=90)
        return self

    def stop(self) -> None:
        self.supervisor.halted.set()
        self.supervisor.join(10)
        # SIGTERM to every process at once, then one shared deadline: each may take seconds to
        # finish its work (gunicorn's graceful timeout, a worker's task), and none waits for another.
        running = [process for process in self.processes.values() if process.alive()]
        for process in running:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in running:
            with suppress(subprocess.TimeoutExpired):
                process.popen.wait(max(deadline - time.monotonic(), 0.0))
        for process in self.processes.values():
            process.kill_group()
        if self._conn is not None:
            with suppress(Exception):
                self._conn.close()

    # --- faults -----------------------------------------------------------------------------
    def kill(self, name: str, sig: int = signal.SIGKILL) -> float:
        """Send ``sig`` to the process's main pid, as a crash or the OOM killer would; the
        supervisor restarts it. Returns the wall-clock time of the kill."""
        process = self.processes[name]
        process.planned_kill = True
        at = time.time()
        process.signal(sig)
        return at

    @contextmanager
    def stopped(self, name: str) -> Iterator[Process]:
        """SIGSTOP the process for the block's duration (a stalled host), SIGCONT after."""
        process = self.processes[name]
        process.signal(signal.SIGSTOP)
        try:
            yield process
        finally:
            process.signal(signal.SIGCONT)

    def wait_all_up(self, timeout: float = 90.0) -> None:
        for process in self.processes.values():
            wait_for(process.alive, f"{process.name} to run", timeout)
            process.wait_up(timeout)

    # --- reading the private database -------------------------------------------------------
    def query(self, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Rows of ``sql`` on the private database (reconnects after a restart)."""
        for attempt in (1, 2):
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
                return list(self._conn.execute(sql, params).fetchall())
            except psycopg.OperationalError:
                with suppress(Exception):
                    self._conn.close()
                self._conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    @contextmanager
    def cursor(self) -> Iterator[psycopg.Cursor]:
        with psycopg.connect(self.url, autocommit=True) as conn, conn.cursor() as cursor:
            yield cursor

    def scalar(self, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> Any:
        return self.query(sql, params)[0][0]

    def last_cycle_at(self) -> float | None:
        rows = self.query("SELECT extract(epoch FROM last_cycle_at) FROM scheduling_schedulerstate")
        return float(rows[0][0]) if rows and rows[0][0] is not None else None

    def last_placement_at(self) -> float | None:
        value = self.scalar("SELECT extract(epoch FROM max(created_at)) FROM scheduling_jobattempt")
        return None if value is None else float(value)

    def last_seen_at(self) -> float | None:
        value = self.scalar("SELECT extract(epoch FROM max(seen_at)) FROM clusters_nodelastseen")
        return None if value is None else float(value)

    def pending(self, queue: str = "default") -> int:
        return self.scalar(
            "SELECT count(*) FROM scheduling_job j JOIN scheduling_queue q ON q.id = j.queue_id"
            " WHERE j.state = 'PENDING' AND q.name = %s",
            [queue],
        )

    def lock_holder(self) -> str | None:
        """The process whose session holds the scheduling cycle's advisory lock, if any."""
        from scheduling.engine.cycle.lock import LOCK_KEY

        rows = self.query(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.objid = %s",
            [LOCK_KEY & 0xFFFFFFFF],
        )
        return rows[0][0].removeprefix("orrery-") if rows else None

    def node_flaps(self, since: float) -> int:
        return self.scalar(
            "SELECT count(*) FROM clusters_nodeevent WHERE from_state = 'ready' AND to_state <> 'ready'"
            " AND at > to_timestamp(%s)",
            [since],
        )

    def log_text(self, name: str) -> str:
        return self.processes[name].log.read_text(errors="replace")


def private_root(prefix: str = "orrery-faults-") -> Path:
    """A temporary directory the ``postgres`` user may enter (pytest's are private to root)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    root.chmod(0o755)
    return root
