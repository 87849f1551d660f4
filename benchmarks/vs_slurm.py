#!/usr/bin/env python
"""Side by side with Slurm: one workload on a real local Slurm and on Orrery.

    python benchmarks/vs_slurm.py --nodes 64 --gpus-per-node 8 --jobs 2000 --json

The workload: ``--jobs`` jobs of 1, 2, 4 or 8 GPUs (uniformly), each sleeping 1–5 s (seeded).

* **Slurm**: ``scripts/slurm-dev-cluster.sh`` starts a second throwaway cluster (its own
  directory and ports) of ``--nodes`` slurmd with ``--gpus-per-node`` fake GPUs each; one client
  submits every job with ``sbatch``, one after another; the jobs really sleep.
* **Orrery**: a throwaway PostgreSQL database with a simulated cluster of the same shape, and
  the production processes: gunicorn serving the API, a Celery worker with beat (the scheduler
  every second and whenever a submission wakes it), Redis. One client submits through
  ``POST /api/v1/jobs`` over one keep-alive connection. A simulated job starts when placed and
  ends after its sleep, without a process. The per-user submit throttle (default 1,200/min) is
  raised for the run, which the output says; the simulated nodes send no heartbeats, so the
  node lifecycle's grace is raised too.

Printed (JSON with ``--json``):

* ``slurm_submit_per_s``, ``orrery_submit_per_s`` — jobs per second, one client, one job per
  call; ``orrery_batch_submit_per_s`` — through ``POST jobs/batch``, 500 jobs a request;
* ``slurm_all_running_s``, ``orrery_all_running_s`` (and ``orrery_batch_all_running_s``) — from
  the first submission until every job has started;
* ``slurm_gpu_utilisation``, ``orrery_gpu_utilisation`` — allocated GPU-seconds over available
  GPU-seconds while jobs are pending (sampled every 0.5 s);
* the ratios (``all_running_ratio`` = Orrery / Slurm; ``submit_ratio`` = Orrery / Slurm);
* ``fleet_bound_s`` — the demanded GPU-seconds over the fleet's GPUs: the time the work takes
  at 100 % utilisation. All-running cannot come much sooner (only the last wave of jobs may
  still be running then), whatever the scheduler.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.heartbeats import wait_for_port  # noqa: E402

SAMPLE_S = 0.5


def workload(jobs: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.choice((1, 2, 4, 8)), rng.randint(1, 5)) for _ in range(jobs)]


class Sampler(threading.Thread):
    """Polls ``probe() -> (pending, allocated GPUs)`` until stopped; keeps the samples."""

    def __init__(self, probe, total_gpus: int) -> None:
        super().__init__(daemon=True)
        self.probe, self.total = probe, total_gpus
        self.samples: list[tuple[float, int, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            pending, allocated = self.probe()
            self.samples.append((time.monotonic(), pending, allocated))
            self.stop.wait(SAMPLE_S)

    def utilisation(self) -> float:
        busy = [allocated for _, pending, allocated in self.samples if pending > 0]
        return round(sum(busy) / (len(busy) * self.total), 3) if busy else 0.0


def wait_all_started(probe, submitted: threading.Event, timeout: float) -> float:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if submitted.is_set() and probe()[0] == 0:
            return time.monotonic()
        time.sleep(0.1)
    raise RuntimeError("not every job started in time")


# --- Slurm ------------------------------------------------------------------------------------


def run_slurm(args, jobs: list[tuple[int, int]], say) -> dict:
    base = Path(f"/tmp/orrery-vs-slurm-{os.getpid()}")
    env = {
        **os.environ,
        "ORRERY_SLURM_DIR": str(base),
        "ORRERY_SLURM_NODES": str(args.nodes),
        "ORRERY_SLURM_GPUS": str(args.gpus_per_node),
        "ORRERY_SLURM_CTLD_PORT": "6917",
        "ORRERY_SLURM_SLURMD_PORT": "17300",
        "ORRERY_SLURM_REST_PORT": "6921",
        "SLURM_CONF": str(base / "etc/slurm.conf"),
    }
    env.pop("SLURM_JWT", None)
    script = str(ROOT / "scripts/slurm-dev-cluster.sh")
    started = time.monotonic()
    up = subprocess.run([script, "up"], env=env, capture_output=True, text=True)
    if up.returncode != 0:
        raise RuntimeError(f"the Slurm cluster did not start: {up.stderr[-2000:]}")
    result = {"slurm_start_s": round(time.monotonic() - started, 1)}
    say(f"slurm: {args.nodes} nodes up in {result['slurm_start_s']} s")

    def probe() -> tuple[int, int]:
        out = subprocess.run(
            ["squeue", "-h", "-o", "%T %b"], env=env, capture_output=True, text=True
        ).stdout.split("\n")
        pending = allocated = 0
        for line in out:
            state, _, tres = line.partition(" ")
            if state == "PENDING":
                pending += 1
            elif state in ("RUNNING", "CONFIGURING", "COMPLETING"):
                allocated += int(tres.rsplit(":", 1)[-1] or 0)
        return pending, allocated

    sampler = Sampler(probe, args.nodes * args.gpus_per_node)
    submitted = threading.Event()
    try:
        sampler.start()
        first = time.monotonic()
        for i, (gpus, seconds) in enumerate(jobs):
            argv = ["sbatch", "--parsable", f"--job-name=bench{i}", f"--gres=gpu:a100:{gpus}", "--time=1"]
            argv += ["--output=/dev/null", "--wrap", f"sleep {seconds}"]
            done = subprocess.run(argv, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"sbatch failed: {done.stderr}")
        submit_s = time.monotonic() - first
        submitted.set()
        say(f"slurm: {len(jobs)} sbatch in {submit_s:.1f} s")
        all_running = wait_all_started(probe, submitted, args.timeout) - first
        sampler.stop.set()
        sampler.join()
        result |= {
            "slurm_submit_per_s": round(len(jobs) / submit_s, 1),
            "slurm_all_running_s": round(all_running, 1),
            "slurm_gpu_utilisation": sampler.utilisation(),
        }
    finally:
        sampler.stop.set()
        subprocess.run([script, "down"], env=env, capture_output=True)
    return result


# --- Orrery -----------------------------------------------------------------------------------


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spec(i: int, gpus: int, seconds: int, project: str) -> dict:
    return {
        "apiVersion": "orrery/v1",
        "kind": "Job",
        "metadata": {"name": f"bench{i}", "project": project},
        "spec": {
            "resources": {"gpus": f"a100:{gpus}"},
            "run": f"sleep {seconds}",
            "timeLimit": "1",
            "sim": {"duration": f"{seconds}s"},
        },
    }


def run_orrery(args, jobs: list[tuple[int, int]], say) -> dict:
    import psycopg

    base = os.environ.get("DATABASE_URL", "postgres://postgres:postgres@127.0.0.1:5432/postgres")
    db_name = f"orrery_vs_slurm_{os.getpid()}"
    env = {
        **os.environ,
        "DATABASE_URL": base.rsplit("/", 1)[0] + f"/{db_name}",
        "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        "ORRERY_REDIS_PREFIX": f"orrery-vs-slurm-{os.getpid()}:",
        "ORRERY_CELERY_QUEUE": f"vs-slurm-{uuid.uuid4().hex[:8]}",
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "ORRERY_LOG_LEVEL": "WARNING",
        "ORRERY_THROTTLE_SUBMIT": "1000000/min",
        "ORRERY_NODE_GRACE": "86400",  # the simulated nodes send no heartbeats in this run
        "ORRERY_DATA_DIR": f"/tmp/orrery-vs-slurm-data-{os.getpid()}",
    }
    os.environ.update(env)
    admin = base.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db_name}"')
    processes: list[subprocess.Popen] = []
    try:
        import django

        django.setup()
        from django.conf import settings
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        token = _fleet(args.nodes, args.gpus_per_node)
        port = _port()
        gunicorn = [
            sys.executable,
            "-m",
            "gunicorn",
            "portal.wsgi:application",
            "--bind",
            f"127.0.0.1:{port}",
        ]
        gunicorn += [
            "--workers",
            "2",
            "--worker-class",
            "gthread",
            "--threads",
            "4",
            "--log-level",
            "warning",
        ]
        worker = [sys.executable, "-m", "celery", "-A", "portal", "worker", "--beat", "--pool", "solo"]
        queues = ",".join(f"{env['ORRERY_CELERY_QUEUE']}.{role}" for role in settings.ORRERY_CELERY_ROLES)
        worker += ["--loglevel", "WARNING", "-Q", queues]
        worker += ["--schedule", f"{env['ORRERY_DATA_DIR']}/beat-schedule"]
        Path(env["ORRERY_DATA_DIR"]).mkdir(parents=True, exist_ok=True)
        log = open(Path(env["ORRERY_DATA_DIR"]) / "processes.log", "a")  # noqa: SIM115
        processes = [
            subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=log) for argv in (gunicorn, worker)
        ]
        wait_for_port(port)
        time.sleep(2)  # the worker and its beat settle
        result = {}
        for mode, project in (("single", "bench"), ("batch", "bench-batch")):
            figures = _orrery_run(args, jobs, port, token, mode, project, say)
            result |= figures
        return result
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
        from django.db import connections

        connections.close_all()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')


def _fleet(nodes: int, gpus: int) -> str:
    from django.contrib.auth import get_user_model

    from clusters.choices import ClusterKind, ClusterState, NodeState
    from clusters.models import Cluster, GpuDevice, GpuModel, Node
    from portal.choices import Role
    from portal.models import Membership, Project
    from portal.services.tokens import issue_token
    from scheduling.models import Queue

    model = GpuModel.objects.get(slug="a100-80g")
    cluster = Cluster.objects.create(name="sim", kind=ClusterKind.SIMULATED, state=ClusterState.READY)
    made = Node.objects.bulk_create(
        Node(
            cluster=cluster,
            name=f"n{i + 1}",
            state=NodeState.READY,
            cpu_millicores_capacity=8000,
            cpu_millicores_allocatable=8000,
            memory_bytes_capacity=64 << 30,
            memory_bytes_allocatable=64 << 30,
            gpu_capacity=gpus,
        )
        for i in range(nodes)
    )
    GpuDevice.objects.bulk_create(GpuDevice(node=n, index=g, model=model) for n in made for g in range(gpus))
    user = get_user_model().objects.create_user("bench", password="bench")
    for name in ("bench", "bench-batch"):
        project = Project.objects.create(name=name)
        Membership.objects.create(user=user, project=project, role=Role.MEMBER)
        Queue.objects.create(project=project, name="default")
    return issue_token(user, name="bench")[1]


def _orrery_run(args, jobs, port: int, token: str, mode: str, project: str, say) -> dict:
    from django.db import close_old_connections, connection

    def probe() -> tuple[int, int]:
        close_old_connections()
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FILTER (WHERE j.state IN ('PENDING', 'SCHEDULED')) FROM scheduling_job j"
                " JOIN portal_project p ON p.id = j.project_id WHERE p.name = %s",
                [project],
            )
            pending = cursor.fetchone()[0]
            cursor.execute("SELECT count(*) FROM scheduling_allocation WHERE active AND gpu_id IS NOT NULL")
            return pending, cursor.fetchone()[0]

    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    sampler = Sampler(probe, args.nodes * args.gpus_per_node)
    submitted = threading.Event()
    sampler.start()
    first = time.monotonic()
    try:
        if mode == "single":
            for i, (gpus, seconds) in enumerate(jobs):
                _post(client, "/api/v1/jobs", spec(i, gpus, seconds, project), headers)
        else:
            for start in range(0, len(jobs), 500):
                chunk = jobs[start : start + 500]
                body = {"jobs": [spec(start + k, g, s, project) for k, (g, s) in enumerate(chunk)]}
                _post(client, "/api/v1/jobs/batch", body, headers)
        submit_s = time.monotonic() - first
        submitted.set()
        say(f"orrery ({mode}): {len(jobs)} jobs submitted in {submit_s:.1f} s")
        all_running = wait_all_started(probe, submitted, args.timeout) - first
    finally:
        sampler.stop.set()
        sampler.join()
    # Let this run's jobs finish before the next run starts.
    end = time.monotonic() + args.timeout
    while probe()[1] and time.monotonic() < end:
        time.sleep(0.5)
    prefix = "orrery" if mode == "single" else "orrery_batch"
    return {
        f"{prefix}_submit_per_s": round(len(jobs) / submit_s, 1),
        f"{prefix}_all_running_s": round(all_running, 1),
        f"{prefix}_gpu_utilisation": sampler.utilisation(),
    }


def _post(client: http.client.HTTPConnection, path: str, body: dict, headers: dict) -> None:
    client.request("POST", path, body=json.dumps(body), headers=headers)
    response = client.getresponse()
    text = response.read()
    if response.status != 201:
        raise RuntimeError(f"POST {path}: {response.status} {text[:300]!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for all-running")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    args = parser.parse_args()
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    jobs = workload(args.jobs, args.seed)
    result: dict[str, object] = {
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "jobs": args.jobs,
        "gpu_seconds_demanded": sum(g * s for g, s in jobs),
        # running the demanded GPU-seconds on every GPU at once: no schedule finishes sooner
        "fleet_bound_s": round(sum(g * s for g, s in jobs) / (args.nodes * args.gpus_per_node), 1),
        "orrery_submit_throttle": "raised to 1000000/min for the run (default 1200/min per user)",
    }
    result |= run_slurm(args, jobs, say)
    result |= run_orrery(args, jobs, say)
    result["all_running_ratio"] = round(result["orrery_all_running_s"] / result["slurm_all_running_s"], 3)
    result["submit_ratio"] = round(result["orrery_submit_per_s"] / result["slurm_submit_per_s"], 2)
    result["batch_submit_ratio"] = round(
        result["orrery_batch_submit_per_s"] / result["slurm_submit_per_s"], 2
    )
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
