"""The node agent under faults, on real processes (as root): it fences itself before the server
may run its attempts elsewhere, never runs an unrecorded start twice, survives a work directory
it cannot write, delivers any number of reports and any output (binary, 200 MB) without
wedging, cleans up after itself, and honours the server's Retry-After."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from clusters.agent.agent import Agent
from clusters.agent.runner import Runner
from clusters.choices import ClusterKind, ClusterState, Identity, NodeState
from clusters.models import Node
from clusters.services.credentials import create_join_token
from portal.services.tokens import issue_token
from scheduling.models import JobLog
from tests.clusters.test_agent_e2e import api, state_of, submit
from tests.factories import ensure_catalog, make_cluster, make_project, make_queue, make_user
from tests.faults.invariants import assert_invariants
from tests.processes import Service, celery_worker_argv, control_plane_env, free_port, spawn_agent, wait

ROOT = Path(__file__).resolve().parents[2]
FENCED = "fenced: lost contact with the control plane"  # the reason a fenced attempt ends with


def entry(attempt: str, script: str, **extra) -> dict:
    return {"attempt": attempt, "job": 1, "script": script, "user": "", **extra}


def processes(marker: str) -> list[str]:
    return subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()


def until(condition, what: str, timeout: float = 20.0):
    """``tests.processes.wait`` without the database (these tests have none)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for: {what}")


def alive(pgid: int) -> bool:
    """Whether any process of the group still runs (a zombie waiting for its reaper does not)."""
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if entry.name.isdigit() and int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


# --- the runner on its own ------------------------------------------------------------------------


def test_an_unrecorded_start_is_killed_before_it_starts_again_even_without_cgroups(tmp_path):
    attempt = str(uuid.uuid4())
    marker = f"sleep 5{uuid.uuid4().int % 1000:03d}"
    first = Runner(tmp_path, grace=0.5, cgroups=None)
    first.start(entry(attempt, f"sleep 0.1 & exec {marker}"))
    until(lambda: len(processes(marker)) == 1, "the first start to run")
    # The agent dies after starting the attempt and before recording it.
    (tmp_path / "attempts" / attempt / "meta.json").unlink()
    again = Runner(tmp_path, grace=0.5, cgroups=None)
    assert attempt not in again.attempts  # nothing to adopt: the server's list starts it again
    again.start(entry(attempt, f"exec {marker}"))
    until(lambda: len(processes(marker)) == 1, "one process")
    time.sleep(0.3)
    assert len(processes(marker)) == 1, "the unrecorded first start still runs beside the second"
    again.stop(attempt)
    until(lambda: not again.poll() and not again.attempts and not processes(marker), "the stop")


def test_an_unrecorded_start_is_killed_at_adoption_and_a_reused_pid_is_left_alone(tmp_path):
    """A restarted agent kills an unrecorded start even when the server no longer lists it (it
    would never be started, nor stopped, again); a pid file naming someone else's process
    (pids are reused) kills nothing."""
    attempt, stranger = str(uuid.uuid4()), str(uuid.uuid4())
    marker = f"sleep 6{uuid.uuid4().int % 1000:03d}"
    Runner(tmp_path, grace=0.5, cgroups=None).start(entry(attempt, f"exec {marker}"))
    until(lambda: processes(marker), "the start")
    (tmp_path / "attempts" / attempt / "meta.json").unlink()
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    (tmp_path / "attempts" / stranger).mkdir()
    (tmp_path / "attempts" / stranger / "pid").write_text(str(bystander.pid))
    try:
        Runner(tmp_path, grace=0.5, cgroups=None)
        until(lambda: not processes(marker), "the unrecorded start to be killed at adoption")
        assert bystander.poll() is None, "a process that is not the attempt's was killed"
    finally:
        bystander.kill()
        bystander.wait()


def test_ended_attempts_are_cleaned_up_and_never_started_again(tmp_path):
    attempt = str(uuid.uuid4())
    runner = Runner(tmp_path, grace=0.5, cgroups=None)
    runner.start(entry(attempt, "echo done"))
    ended = until(lambda: runner.poll(), "the end")
    assert ended[0]["state"] == "succeeded"
    runner.mark_reported(attempt, "succeeded")
    assert runner.clean(retention=0) == 0, "cleaned before the server had its end"
    runner.mark_delivered(attempt)
    assert runner.clean(retention=3600) == 0, "cleaned before the retention time"
    assert runner.clean(retention=0) == 0, "cleaned before its output was shipped"
    runner.mark_shipped(runner.new_output())
    assert runner.clean(retention=0) == 1
    assert not (tmp_path / "attempts" / attempt).exists() and not (tmp_path / "jobs" / attempt).exists()
    assert Runner(tmp_path, cgroups=None).is_ended(attempt), "a cleaned-up attempt could start again"


# --- the lease and flow control against a stand-in server --------------------------------------


class StandInServer:
    """A stand-in for the control plane's agent API: the real server never answers 503 with
    Retry-After on demand, so this one does, after as many 200 answers as the test wants. It
    records every request."""

    def __init__(self, answers: list[tuple[int, dict]]) -> None:
        self.answers, self.requests = answers, []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                server.requests.append((time.monotonic(), self.path))
                status, body = server.answers.pop(0) if len(server.answers) > 1 else server.answers[0]
                payload = json.dumps(body).encode()
                self.send_response(status)
                if status in (429, 503):
                    self.send_header("Retry-After", "1")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()


def stand_in_agent(server: StandInServer, work: Path, **options) -> Agent:
    work.mkdir(parents=True)
    (work / "credential.json").write_text(json.dumps({"server": server.url, "node": "n1", "credential": "x"}))
    return Agent(server.url, work, name="n1", fake_gpus="h100:1", use_cgroups=False, **options)


def test_a_lease_that_would_outlive_the_failover_time_is_refused(tmp_path):
    server = StandInServer([(200, {})])
    agent = stand_in_agent(server, tmp_path / "n1", grace=10, lease=250)
    agent._set_failover(300, fatal=False)  # 300 - 10 - 2 × 10: 250 fits
    assert agent.lease == 250
    agent._set_failover(200, fatal=False)  # learned later: refused, the longest safe lease instead
    assert agent.lease == 170
    (tmp_path / "n1" / "lease.json").write_text(
        json.dumps({"server": server.url, "ok_at": time.time(), "failover_after_s": 200, "interval": 10})
    )
    with pytest.raises(SystemExit, match="would outlive the node failover time"):
        Agent(
            server.url, tmp_path / "n1", name="n1", fake_gpus="h100:1", use_cgroups=False, grace=10, lease=250
        )
    with pytest.raises(SystemExit, match="above 0"):
        Agent(server.url, tmp_path / "n1", name="n1", fake_gpus="h100:1", use_cgroups=False, lease=0)
    server.http.shutdown()


def test_retry_after_is_honoured_and_a_503_does_not_renew_the_lease(tmp_path):
    attempt = str(uuid.uuid4())
    marker = f"sleep 7{uuid.uuid4().int % 1000:03d}"
    desired = [entry(attempt, f"exec {marker}", gpus=[0])]
    ok = {"interval": 1, "failover_after_s": 5, "desired": desired, "stop": []}
    server = StandInServer([(200, ok), (200, {}), (503, {"detail": "busy"})])
    agent = stand_in_agent(server, tmp_path / "n1", grace=0.5)
    agent.step()  # 200: the lease is 5 - 0.5 - 2 × 1 = 2.5 s
    started = time.monotonic()
    until(lambda: processes(marker), "the attempt to start")
    pgid = agent.runner.attempts[attempt].pgid
    while time.monotonic() - started < 4:  # a loop far faster than any interval
        agent.step()
        time.sleep(0.05)
    asked = [t for t, _ in server.requests if t > started + 0.1]
    # Each 503 says "Retry-After: 1" (the agent adds up to half again): at most 4 in 4 s.
    assert len(asked) <= 5, f"{len(asked)} requests in 4 s: the agent hammers a server that asks it to wait"
    assert agent.lease == 2.5
    assert not alive(pgid), "503 answers renewed the lease: the attempt runs on"
    assert agent.fenced and [r for r in agent.queue if r.get("reason") == FENCED]
    server.http.shutdown()


# --- end to end, with the control plane ---------------------------------------------------------


@contextlib.contextmanager
def control_plane(tmp: Path, **timers: str):
    """Daphne serving the API and the agents, and a Celery worker with beat, on short timers."""
    if not settings.REDIS_URL:
        pytest.skip("the processes share the heartbeat buffer and the broker through Redis")
    env = control_plane_env(
        tmp,
        **{
            "ORRERY_HEARTBEAT_INTERVAL": "1",
            "ORRERY_NODE_RECOVERY": "1",
            "ORRERY_NODE_GRACE": "3",
            "ORRERY_NODE_FAILOVER_AFTER": "12",  # an agent's lease: 12 - grace 1 - 2 × interval 1 = 9 s
            "ORRERY_FAILOVER_PER_MINUTE": "100",
            **timers,
        },
    )
    port = free_port()
    argv = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "portal.asgi:application"]
    server = Service(argv, env, tmp / "daphne.log", port).start()
    worker = Service(celery_worker_argv(env, tmp), env, tmp / "celery.log").start()
    ensure_catalog()
    alice = make_user("alice")
    make_queue(make_project("vision", members=(alice,)))
    cluster = make_cluster("lab", kind=ClusterKind.NATIVE, state=ClusterState.READY, identity=Identity.SHARED)
    _, join = create_join_token(cluster, max_uses=None)
    _, token = issue_token(alice)
    world = {"url": f"http://127.0.0.1:{port}", "token": token, "join": join, "server": server, "agents": []}

    def agent(name: str, *extra: str) -> subprocess.Popen:
        process = spawn_agent(world["url"], join, tmp / name, name, "h100:2", *extra)
        world["agents"].append(process)
        return process

    world["agent"] = agent
    try:
        yield world
    finally:
        for process in world["agents"]:
            process.kill()
            process.wait()
        worker.stop()
        server.stop()
        for pid_file in tmp.glob("*/attempts/*/pid"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)


def attempt_dir(tmp: Path, world: dict, job: int) -> Path:
    attempt = api(world, "GET", f"jobs/{job}")["placement"]["attemptId"]
    return next(tmp.glob(f"*/attempts/{attempt}"))


@pytest.mark.django_db(transaction=True)
def test_an_agent_whose_spool_cannot_be_written_runs_on_and_delivers(tmp_path):
    """The spool cannot be written. With the server up, the agent keeps heartbeating (the node
    stays ready), runs work and delivers every report; with the server away too, it keeps a
    job's end in memory and delivers it once the server is back."""
    with control_plane(tmp_path) as world:
        agent = world["agent"]("n1")
        wait(lambda: Node.objects.filter(name="n1", state=NodeState.READY).exists(), "the node", timeout=90)
        spool = tmp_path / "n1" / "spool.jsonl"
        spool.unlink(missing_ok=True)
        spool.mkdir()  # no one writes a file there, root included
        quick = submit(world, "quick", "echo quick-done")
        job = submit(world, "while-unwritable", "sleep 12; echo done")
        # Longer than the grace (3 s) and a lifecycle pass (5 s): a node whose heartbeats had
        # stopped would go not ready meanwhile.
        end = time.monotonic() + 9
        while time.monotonic() < end:
            assert agent.poll() is None, "the agent died"
            assert Node.objects.get(name="n1").state == NodeState.READY, "the node stopped being ready"
            time.sleep(0.2)
        assert wait(lambda: state_of(world, quick, "SUCCEEDED", "FAILED"), "its end")["state"] == "SUCCEEDED"
        wait(lambda: "quick-done" in api(world, "GET", f"jobs/{quick}/logs")["lines"], "its output")
        wait(lambda: state_of(world, job, "RUNNING"), "the job to run")
        directory = attempt_dir(tmp_path, world, job)
        world["server"].stop()
        until(lambda: (directory / "exit_code").exists(), "the job to end while the server is away")
        time.sleep(1.5)  # the agent tries to spool its end, and cannot
        assert agent.poll() is None, "the agent died"
        world["server"].start()
        finished = wait(lambda: state_of(world, job, "SUCCEEDED", "FAILED"), "the end kept in memory")
        assert finished["state"] == "SUCCEEDED"
        # silent for longer than the grace while the server was away, it is ready again only
        # once heartbeats flow on time
        wait(lambda: Node.objects.get(name="n1").state == NodeState.READY, "heartbeats going on")
        assert agent.poll() is None and "cannot write the spool" in Path(f"{tmp_path / 'n1'}.log").read_text()
        wait(lambda: "done" in api(world, "GET", f"jobs/{job}/logs")["lines"], "the output written meanwhile")
        with connection.cursor() as cursor:
            assert_invariants(cursor, accepted_jobs=[quick, job], settle_s=5)


@pytest.mark.django_db(transaction=True)
def test_thousands_of_spooled_reports_are_all_delivered(tmp_path):
    with control_plane(tmp_path) as world:
        agent = world["agent"]("n1")
        wait(lambda: Node.objects.filter(name="n1", state=NodeState.READY).exists(), "the node", timeout=90)
        job = submit(world, "behind-the-backlog", "sleep 2; echo done")
        wait(lambda: state_of(world, job, "RUNNING"), "the job to run")
        directory = attempt_dir(tmp_path, world, job)
        agent.kill()
        agent.wait()
        until(lambda: (directory / "exit_code").exists(), "the job to end")
        # A long outage's backlog (reports about attempts long gone: the server ignores them)
        # ahead of the job's end, which the next agent spools behind it.
        spool = tmp_path / "n1" / "spool.jsonl"
        backlog = [{"attempt": str(uuid.uuid4()), "state": "failed", "exit_code": 1} for _ in range(2500)]
        torn = '{"attempt": "0c1d3e6a-1b1e-4c83-9a0a-5f8c'  # a line cut short by a full disk
        spool.write_text(torn + "\n" + "".join(json.dumps(r) + "\n" for r in backlog) + spool.read_text())
        once = [sys.executable, "-m", "clusters.agent", "--server", world["url"], "--once", "--grace", "1"]
        once += ["--fake-gpus", "h100:2", "--work-dir", str(tmp_path / "n1"), "--name", "n1"]
        done = subprocess.run(once, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert not spool.read_text().strip(), (
            f"{len(spool.read_text().splitlines())} reports left after a round"
        )
        assert wait(lambda: state_of(world, job, "SUCCEEDED", "FAILED"), "the end")["state"] == "SUCCEEDED"


@pytest.mark.django_db(transaction=True)
def test_binary_and_huge_output_wedge_nothing(tmp_path):
    """A job printing NUL bytes and bytes that are not UTF-8 breaks none of the node's later
    reports (never an error answer). A job writing 200 MB holds up neither its own end nor that
    of a small job running beside it, nor the node's heartbeats; its newest output is stored.
    With no retention, ended attempts are cleaned up once reported and shipped."""
    with control_plane(tmp_path) as world:
        world["agent"]("n1", "--retention", "0")
        wait(lambda: Node.objects.filter(name="n1", state=NodeState.READY).exists(), "the node", timeout=90)
        garbage = (
            "printf 'nul:\\000:ff:\\377\\376:\\n'; head -c 2000000 /dev/urandom; echo; echo after-binary"
        )
        binary = submit(world, "binary", garbage)
        assert wait(lambda: state_of(world, binary, "SUCCEEDED", "FAILED"), "its end")["state"] == "SUCCEEDED"
        wait(lambda: "after-binary" in api(world, "GET", f"jobs/{binary}/logs")["lines"], "the text after it")

        line = "x" * 99
        big = submit(world, "200MB", f"yes {line} | head -c 200000000; echo tail-marker")
        wait(lambda: state_of(world, big, "RUNNING", "SUCCEEDED"), "the big job to start")
        directory = attempt_dir(tmp_path, world, big)
        output = directory / "output.log"
        until(lambda: output.exists() and output.stat().st_size > 50_000_000, "50 MB of output", timeout=60)
        small = submit(world, "small", "sleep 1; echo small-done")
        # Each attempt's directory goes once its end is reported and its output shipped (no
        # retention): when its process ended is read while it is there.
        directories, ended, reported = {big: directory}, {}, {}
        ready_throughout = True
        deadline = time.monotonic() + 120
        while len(reported) < 2 and time.monotonic() < deadline:
            ready_throughout &= Node.objects.get(name="n1").state == NodeState.READY
            if small not in directories and state_of(world, small, "RUNNING", "SUCCEEDED", "FAILED"):
                with contextlib.suppress(StopIteration):
                    directories[small] = attempt_dir(tmp_path, world, small)
            for job, path in directories.items():
                with contextlib.suppress(FileNotFoundError):
                    ended.setdefault(job, (path / "exit_code").stat().st_mtime)
            for job in {big, small} - set(reported):
                if state_of(world, job, "SUCCEEDED", "FAILED"):
                    reported[job] = time.time()
            time.sleep(0.1)
        assert {big, small} <= reported.keys() & ended.keys(), (reported, ended)
        assert reported[small] - ended[small] < 15, "the small job's end was held up"
        assert reported[big] - ended[big] < 30, "the big job's end was held up"
        assert ready_throughout, "the node stopped being ready while shipping output"
        assert state_of(world, big, "SUCCEEDED") and state_of(world, small, "SUCCEEDED")
        log_row = wait(
            lambda: JobLog.objects.filter(job_id=big, end__gte=200_000_000 + len("tail-marker\n")).first(),
            "its output to be shipped",
        )
        shipped = time.time() - ended[big]
        assert api(world, "GET", f"jobs/{big}/logs")["lines"][-1].endswith("tail-marker")
        assert log_row.start > 200_000_000 - 2 * JobLog.MAX_BYTES, "the first byte kept is not where it says"
        print(
            f"\n200 MB of output: end report {reported[big] - ended[big]:.1f} s after the job ended (a "
            f"small job's beside it: {reported[small] - ended[small]:.1f} s); output caught up "
            f"{shipped:.1f} s after ({200 / shipped:.0f} MB/s of stream; the server keeps "
            f"{len(log_row.text.encode()) >> 10} KiB of it, from byte {log_row.start})"
        )

        after = submit(world, "next", "echo next")
        assert (
            wait(lambda: state_of(world, after, "SUCCEEDED", "FAILED"), "the next end")["state"]
            == "SUCCEEDED"
        )
        assert "HTTP 5" not in Path(f"{tmp_path / 'n1'}.log").read_text(), "the server refused a report"
        # with no retention, ended attempts go once reported and shipped; their ids stay
        wait(
            lambda: not directory.exists() and not (tmp_path / "n1" / "jobs" / directory.name).exists(),
            "cleanup",
        )
        assert directory.name in (tmp_path / "n1" / "ended").read_text()
        with connection.cursor() as cursor:
            assert_invariants(cursor, accepted_jobs=[binary, big, small, after])
