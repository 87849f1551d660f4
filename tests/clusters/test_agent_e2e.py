"""End to end on real processes: a live server, the scheduler and the aggregator on a timer,
and orrery-agent processes with fake GPUs, all driven through the public API."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings

from clusters.choices import ClusterKind, ClusterState, Identity, NodeState
from clusters.models import Node
from clusters.services.credentials import create_join_token
from portal.services.tokens import issue_token
from scheduling.models import Allocation, JobAttempt
from tests.factories import ensure_catalog, make_cluster, make_project, make_queue, make_user
from tests.processes import Service, celery_worker_argv, control_plane_env, free_port, spawn_agent, wait

pytestmark = pytest.mark.django_db(transaction=True)
ROOT = Path(__file__).resolve().parents[2]


def service_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of the server and worker processes, with timers short enough for a test."""
    return control_plane_env(
        tmp,
        ORRERY_HEARTBEAT_INTERVAL="1",
        ORRERY_NODE_RECOVERY="1",
        ORRERY_NODE_GRACE="3",
        ORRERY_NODE_FAILOVER_AFTER="12",  # an agent's lease: 12 - grace 1 - 2 × interval 1 = 9 s
        ORRERY_FAILOVER_PER_MINUTE="100",
        **extra,
    )


@pytest.fixture
def plane(tmp_path):
    """Daphne serving the API and the agents, and a Celery worker with beat running the
    scheduler, the aggregator, the lifecycle and the outbox sweep."""
    with running_plane(tmp_path) as services:
        yield services


@contextlib.contextmanager
def running_plane(tmp_path: Path, **extra: str) -> Iterator[dict]:
    """The control plane of ``plane``, with ``extra`` settings in its environment."""
    if not settings.REDIS_URL:
        pytest.skip("the processes share the heartbeat buffer and the broker through Redis")
    env = service_env(tmp_path, **extra)
    port = free_port()
    server = Service(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "portal.asgi:application"],
        env,
        tmp_path / "daphne.log",
        port,
    )
    worker = Service(
        celery_worker_argv(env, tmp_path),
        env,
        tmp_path / "celery.log",
    )
    services = {
        "server": server.start(),
        "worker": worker.start(),
        "url": f"http://127.0.0.1:{port}",
        "env": env,
    }
    try:
        yield services
    finally:
        worker.stop()
        server.stop()


@pytest.fixture
def world(plane, tmp_path):
    ensure_catalog()
    alice = make_user("alice")
    make_queue(make_project("vision", members=(alice,)))
    cluster = make_cluster("lab", kind=ClusterKind.NATIVE, state=ClusterState.READY, identity=Identity.SHARED)
    _, join = create_join_token(cluster, max_uses=None)  # the whole lab joins with one token
    _, token = issue_token(alice)
    agents: dict[str, subprocess.Popen] = {}

    def start_agent(name: str) -> subprocess.Popen:
        agents[name] = spawn_agent(
            plane["url"], join, tmp_path / name, name, "h100:2", "--address", f"{name}.lab"
        )
        return agents[name]

    start_agent("n1")
    start_agent("n2")
    wait(lambda: Node.objects.filter(cluster=cluster, state=NodeState.READY).count() == 2, "both nodes ready")
    yield {
        "url": plane["url"],
        "token": token,
        "start_agent": start_agent,
        "agents": agents,
        "tmp": tmp_path,
    }
    for agent in agents.values():
        agent.kill()
        agent.wait()
    _kill_leftovers(tmp_path)


def _kill_leftovers(tmp: Path) -> None:
    for meta in tmp.glob("*/attempts/*/meta.json"):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(json.loads(meta.read_text())["pgid"], signal.SIGKILL)


def api(world, method: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(
        f"{world['url']}/api/v1/{path}",
        method=method,
        data=json.dumps(body).encode() if body else None,
        headers={"Authorization": f"Bearer {world['token']}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def submit(world, name: str, run: str, gpus: str = "h100:1", **spec) -> int:
    body = {
        "apiVersion": "orrery/v1",
        "kind": "Job",
        "metadata": {"name": name, "project": "vision"},
        "spec": {"resources": {"gpus": gpus, **spec.pop("resources", {})}, "run": run, **spec},
    }
    return api(world, "POST", "jobs", body)["id"]


def state_of(world, job_id: int, *states: str) -> dict | None:
    job = api(world, "GET", f"jobs/{job_id}")
    return job if job["state"] in states else None


def test_jobs_run_on_real_processes(world):
    env = (
        'echo "gpus=$CUDA_VISIBLE_DEVICES job=$ORRERY_JOB_ID nodes=$ORRERY_NNODES '
        'rank=$ORRERY_NODE_RANK head=$ORRERY_HEAD_ADDR"'
    )
    ok = submit(world, "print", f"python3 -c 'print(42)'; {env}")
    failing = submit(world, "exit3", "exit 3")
    slow = submit(world, "late", "sleep 30", timeLimit="2s")
    sleeper = submit(world, "sleeper", "sleep 300")
    pairs = [submit(world, f"pair{i}", f"{env}; sleep 2") for i in range(2)]

    done = wait(lambda: state_of(world, ok, "SUCCEEDED", "FAILED"), "the print job to end")
    assert done["state"] == "SUCCEEDED" and done["exitCode"] == 0
    lines = wait(lambda: api(world, "GET", f"jobs/{ok}/logs")["lines"], "its output")
    assert "42" in lines
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "portal.cli.commands",
            "logs",
            str(ok),
            "--server",
            world["url"],
            "--token",
            world["token"],
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert cli.returncode == 0 and "42" in cli.stdout.splitlines()
    held = sorted(
        Allocation.objects.filter(job_id=ok, gpu__isnull=False).values_list("gpu__index", flat=True)
    )
    assert f"gpus={','.join(map(str, held))} job={ok} nodes=1 rank=0" in " ".join(lines)

    failed = wait(lambda: state_of(world, failing, "FAILED", "SUCCEEDED"), "exit 3")
    assert (failed["state"], failed["exitCode"]) == ("FAILED", 3)
    timed_out = wait(lambda: state_of(world, slow, "TIMEOUT", "FAILED", "SUCCEEDED"), "the time limit")
    assert timed_out["state"] == "TIMEOUT"

    for job_id in pairs:
        wait(lambda j=job_id: state_of(world, j, "SUCCEEDED"), "the pair")
    seen = []
    for job_id in pairs:
        line = next(x for x in api(world, "GET", f"jobs/{job_id}/logs")["lines"] if x.startswith("gpus="))
        node = (
            Allocation.objects.filter(job_id=job_id, gpu__isnull=True)
            .values_list("node__name", flat=True)
            .get()
        )
        seen.append((node, line.split()[0]))
    assert len(set(seen)) == 2, f"two jobs shared a GPU: {seen}"

    wait(lambda: state_of(world, sleeper, "RUNNING"), "the sleeper to run")
    attempt = api(world, "GET", f"jobs/{sleeper}")["placement"]["attemptId"]
    meta = next(world["tmp"].glob(f"*/attempts/{attempt}/meta.json"))
    pgid = json.loads(meta.read_text())["pgid"]
    os.killpg(pgid, 0)  # alive
    assert api(world, "POST", f"jobs/{sleeper}/cancel")["state"] == "CANCELLED"
    wait(lambda: not _alive(pgid), "the process group to be killed", timeout=15)


def test_gangs_start_on_both_nodes_with_one_head_and_a_port_each(world):
    # Two gangs at once, both headed on the lowest node: each gets its own MASTER_PORT there,
    # and all ranks of a gang agree on the address, the port and the world. The head's exit
    # decides a gang, and ends the other ranks: give both time to start.
    launch = (
        'echo "rank=$ORRERY_NODE_RANK of $ORRERY_NNODES head=$ORRERY_HEAD_ADDR '
        "launch=$MASTER_ADDR:$MASTER_PORT/$ORRERY_MASTER_PORT node=$NODE_RANK rank=$RANK world=$WORLD_SIZE "
        'local=$LOCAL_WORLD_SIZE nodes=$NNODES"; sleep 3'
    )
    jobs = [
        submit(world, f"gang{i}", launch, gpus="h100:1", resources={"nodes": 2}, env={"MASTER_PORT": "1"})
        for i in range(2)
    ]
    ports = set()
    for job in jobs:
        wait(lambda j=job: state_of(world, j, "SUCCEEDED"), "the gang to finish")
        lines = wait(
            lambda j=job: (
                len(api(world, "GET", f"jobs/{j}/logs")["lines"]) >= 2
                and api(world, "GET", f"jobs/{j}/logs")["lines"]
            ),
            "both nodes' output",
        )
        ranks = sorted(line.split("] ", 1)[1] for line in lines if "rank=" in line)
        heads = {r.split("head=", 1)[1].split()[0] for r in ranks}
        assert len(heads) == 1 and heads <= {"n1.lab", "n2.lab"}, ranks
        (head,) = heads
        assert [r.split(" head=")[0] for r in ranks] == ["rank=0 of 2", "rank=1 of 2"]
        port = JobAttempt.objects.get(job_id=job).master_port
        assert [r.split(" launch=")[1] for r in ranks] == [
            f"{head}:{port}/{port} node=0 rank=0 world=2 local=1 nodes=2",
            f"{head}:{port}/{port} node=1 rank=1 world=2 local=1 nodes=2",
        ]
        ports.add(port)
    assert ports == {29500, 29501}  # two gangs headed on one node, running side by side


def test_node_loss_follows_the_failover_policy_and_a_restarted_agent_cleans_up(world):
    held = submit(world, "held", "sleep 300")  # GPU job, no retries: hold on node loss
    requeued = submit(world, "requeued", "sleep 300", retries=1)  # retries: requeue
    wait(lambda: state_of(world, held, "RUNNING") and state_of(world, requeued, "RUNNING"), "both running")
    victim = (
        Allocation.objects.filter(job_id=held, gpu__isnull=True).values_list("node__name", flat=True).get()
    )
    attempt = api(world, "GET", f"jobs/{held}")["placement"]["attemptId"]
    pgid = json.loads(next(world["tmp"].glob(f"{victim}/attempts/{attempt}/meta.json")).read_text())["pgid"]
    world["agents"][victim].send_signal(signal.SIGKILL)
    world["agents"][victim].wait()
    wait(lambda: Node.objects.get(name=victim).state == NodeState.DOWN, "the node to go down", timeout=40)
    held_job = wait(lambda: state_of(world, held, "HELD"), "the held job")
    assert held_job["reason"] == "NodeLost"
    if Allocation.objects.filter(job_id=requeued, node__name=victim).exists():
        wait(lambda: state_of(world, requeued, "PENDING", "SCHEDULED", "STARTING", "RUNNING"), "the requeue")
    assert _alive(pgid), "the job keeps running on the cut-off node until its agent returns"
    world["start_agent"](victim)
    wait(lambda: not _alive(pgid), "the restarted agent to kill the stale process", timeout=20)
    wait(lambda: Node.objects.get(name=victim).state == NodeState.READY, "the node to come back")


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_server_outage_loses_no_report(plane, tmp_path):
    ensure_catalog()
    alice = make_user("alice")
    make_queue(make_project("vision", members=(alice,)))
    cluster = make_cluster("lab", kind=ClusterKind.NATIVE, state=ClusterState.READY, identity=Identity.SHARED)
    _, join = create_join_token(cluster, max_uses=None)  # the whole lab joins with one token
    _, token = issue_token(alice)
    plane["server"].stop()  # this test serves with gunicorn, the production WSGI server
    port = free_port()
    server = Service(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "portal.wsgi:application",
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            "1",
            "--threads",
            "4",
            "--log-level",
            "warning",
        ],
        plane["env"],
        tmp_path / "gunicorn.log",
        port,
    ).start()
    agent = spawn_agent(f"http://127.0.0.1:{port}", join, tmp_path / "n1", "n1", "h100:1")
    world = {"url": f"http://127.0.0.1:{port}", "token": token}
    try:
        wait(lambda: Node.objects.filter(name="n1", state=NodeState.READY).exists(), "the node")
        job = submit(world, "through-an-outage", "sleep 3; echo done")
        wait(lambda: state_of(world, job, "RUNNING"), "the job to run")
        server.stop()
        # the job ends while nobody listens: the agent keeps its report on disk
        spool = tmp_path / "n1" / "spool.jsonl"
        wait(lambda: list((tmp_path / "n1").glob("attempts/*/exit_code")), "the job to end", timeout=30)
        wait(lambda: spool.exists() and spool.read_text().strip(), "the report in the spool", timeout=30)
        server.start()
        finished = wait(lambda: state_of(world, job, "SUCCEEDED", "FAILED"), "the report to arrive")
        assert finished["state"] == "SUCCEEDED"
        wait(lambda: "done" in api(world, "GET", f"jobs/{job}/logs")["lines"], "the output written meanwhile")
    finally:
        agent.kill()
        agent.wait()
        server.stop()
        _kill_leftovers(tmp_path)
