#!/usr/bin/env python
"""Side by side with Slurm: the same work on a real local Slurm and through Orrery.

    python benchmarks/vs_slurm.py --mode overhead --json   # Orrery dispatching onto that Slurm
    python benchmarks/vs_slurm.py --mode short --jobs 2000 --json  # default 20,000
    python benchmarks/vs_slurm.py --mode classic --json   # the first side-by-side

Slurm is ``scripts/slurm-dev-cluster.sh``: a throwaway cluster of its own (directory and ports)
with ``--nodes`` slurmd of ``--gpus-per-node`` fake GPUs each, started for the run and stopped
after it; jobs there really sleep. Orrery runs its production processes: gunicorn serving the
API (2 workers × 4 threads), a Celery worker with beat, Redis, and a throwaway PostgreSQL
database. The per-user submit throttle is raised for the run (the output says so).

Three modes, each printing both sides and their ratio:

* ``overhead`` — the cost of the layer. ``--jobs`` jobs of 1, 2, 4 or 8 GPUs, each sleeping 1–5 s
  (seeded). Slurm alone: one client ``sbatch``-es every job. Orrery over Slurm: the same Slurm
  onboarded as a cluster of kind ``slurm`` (its adapter: Orrery places, ``sbatch`` pins each job to
  the chosen nodes, ``squeue`` reads them back), the jobs submitted through ``POST jobs/batch``;
  two more Celery workers serve the dispatch role (delivery) and the sync role (reading Slurm
  back) one each, and the per-cluster dispatch rate limit is lifted. Both sides are read from Slurm itself: ``all_running_s`` is from the first submission until Slurm runs
  or ran every job; ``gpu_utilisation`` is GPUs allocated in Slurm over the fleet's while any job
  has not started. Slurm alone is measured before and after Orrery (and between rounds with
  ``--rounds``), its median is the yardstick: ``all_running_ratio`` = Orrery / Slurm (target ≤ 1.1).
  ``placed_to_submitted_s`` and ``end_to_seen_s`` (medians) say where a job waited in between.
  Slurm's epilog rings Orrery at each job's end (``agent/ended``); ``--ring off`` polls only,
  ``--ring alternate`` rings in odd rounds and polls only in even ones (``*_polled`` figures).
* ``short`` — a scheduling-bound workload: ``--jobs`` jobs of 1, 2, 4 or 8 GPUs running 0.2–2 s.
  Every job is queued first while nothing may start (Slurm: the partition down; Orrery: the
  simulated cluster of the same shape disabled), then the fleet is opened and the clock runs until
  the last job has ended. ``completions_per_s`` = jobs / that time; ``gpu_utilisation`` as above.
  Slurm is measured before and after Orrery; ``completions_ratio`` = Orrery / Slurm (target ≥ 1.5);
  ``placed_to_started_s`` and ``end_to_seen_s`` (medians) are Orrery's latencies per job.
  ``--jobs`` above 2,500 raises Slurm's ``MaxJobCount`` for the run.
  ``fleet_bound_s`` is the demanded GPU-seconds over the fleet's GPUs: no schedule ends sooner.
* ``classic`` — Orrery on a simulated cluster against Slurm, one client submitting one job per
  call on each side (and Orrery's batch endpoint), 1–5 s jobs: submit rate, all-running,
  utilisation.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.fleet import simulated_fleet  # noqa: E402
from benchmarks.heartbeats import free_port, wait_for_port  # noqa: E402

SAMPLE_S = 0.5
SCRIPT = str(ROOT / "scripts/slurm-dev-cluster.sh")
STARTED = {"RUNNING", "CONFIGURING", "COMPLETING"}  # holding GPUs in Slurm
LIVE = {"PENDING", *STARTED}
SIM_NODE = {"cpu_millicores": 8000, "memory_bytes": 64 << 30}  # the simulated fleet's nodes
Probe = Callable[[], tuple[int, int]]  # () -> (jobs not started, GPUs allocated)


def workload(jobs: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.choice((1, 2, 4, 8)), rng.randint(1, 5)) for _ in range(jobs)]


def short_workload(jobs: int, seed: int) -> list[tuple[int, float]]:
    rng = random.Random(seed)
    return [(rng.choice((1, 2, 4, 8)), round(rng.uniform(0.2, 2.0), 1)) for _ in range(jobs)]


def median_range(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values)}


def summarise_rounds(sides: dict[str, list[dict]]) -> dict:
    """Per side, each figure as median and range over its runs (a figure some run lacks is left
    out), and the runs themselves."""
    summary: dict = {}
    for side, runs in sides.items():
        summary[side] = {
            key: median_range([run[key] for run in runs])
            for key in runs[0]
            if all(run.get(key) is not None for run in runs)
        }
        summary[f"{side}_runs"] = runs
    return summary


def median_ratio(result: dict, side: str, yardstick: str, key: str) -> float:
    return round(result[side][key]["median"] / result[yardstick][key]["median"], 3)


class Sampler(threading.Thread):
    """Polls ``probe`` until stopped; keeps the samples. As a context, it samples for the block."""

    def __init__(self, probe: Probe, total_gpus: int) -> None:
        super().__init__(daemon=True)
        self.probe, self.total = probe, total_gpus
        self.samples: list[tuple[float, int, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            pending, allocated = self.probe()
            self.samples.append((time.monotonic(), pending, allocated))
            self.stop.wait(SAMPLE_S)

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join()

    def utilisation(self) -> float:
        busy = [allocated for _, pending, allocated in self.samples if pending > 0]
        return round(sum(busy) / (len(busy) * self.total), 3) if busy else 0.0


def wait_until(done: Callable[[], bool], timeout: float, what: str) -> float:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if done():
            return time.monotonic()
        time.sleep(0.1)
    raise RuntimeError(f"{what}: not in {timeout:.0f} s")


# --- Slurm ------------------------------------------------------------------------------------


@contextmanager
def slurm_cluster(args, say) -> Iterator[dict[str, str]]:
    """A dev Slurm of the run's shape, in a directory and on ports of its own; down afterwards."""
    base = Path(f"/tmp/orrery-vs-slurm-{os.getpid()}")
    env = {
        **os.environ,
        "ORRERY_SLURM_DIR": str(base),
        "ORRERY_SLURM_NODES": str(args.nodes),
        "ORRERY_SLURM_GPUS": str(args.gpus_per_node),
        "ORRERY_SLURM_CTLD_PORT": "6917",
        "ORRERY_SLURM_SLURMD_PORT": "17300",
        "ORRERY_SLURM_REST_PORT": "6921",
        "ORRERY_SLURM_MAX_JOBS": str(max(10_000, 4 * args.jobs)),
        "SLURM_CONF": str(base / "etc/slurm.conf"),
    }
    env.pop("SLURM_JWT", None)
    started = time.monotonic()
    up = subprocess.run([SCRIPT, "up"], env=env, capture_output=True, text=True)
    try:
        if up.returncode != 0:
            raise RuntimeError(f"the Slurm cluster did not start: {up.stderr[-2000:]}")
        env |= dict(
            line.removeprefix("export ").replace("'", "").split("=", 1) for line in up.stdout.splitlines()
        )
        env["slurm_start_s"] = str(round(time.monotonic() - started, 1))
        say(f"slurm: {args.nodes} nodes up in {env['slurm_start_s']} s")
        yield env
    finally:
        subprocess.run([SCRIPT, "down"], env=env, capture_output=True)
        for _ in range(50):  # slurmctld saves its state as it stops: remove the directory after
            if subprocess.run(["pgrep", "-f", str(base)], capture_output=True).returncode:
                break
            time.sleep(0.2)
        shutil.rmtree(base, ignore_errors=True)


def squeue(env: dict[str, str]) -> list[tuple[int, str, int]]:
    """Every job Slurm still knows (ended ones too): (id, state, GPUs per node)."""
    out = subprocess.run(
        ["squeue", "-h", "-t", "all", "-o", "%i %T %b"], env=env, capture_output=True, text=True
    ).stdout
    jobs = []
    for line in out.splitlines():
        job_id, state, tres = [*line.split(" "), "", ""][:3]
        if job_id.isdigit():
            jobs.append((int(job_id), state, int(tres.rsplit(":", 1)[-1] or 0) if tres[-1:].isdigit() else 0))
    return jobs


def last_job_id(env: dict[str, str]) -> int:
    return max((job_id for job_id, _, _ in squeue(env)), default=0)


def slurm_probe(env: dict[str, str], after: int, count: int) -> Probe:
    """Jobs of this round (Slurm ids above ``after``, ``count`` of them, some perhaps not yet
    submitted) not started yet, and GPUs allocated in Slurm. Started jobs are remembered: Slurm
    forgets ended ones after ``MinJobAge``."""
    started: set[int] = set()

    def probe() -> tuple[int, int]:
        jobs = squeue(env)
        started.update(job_id for job_id, state, _ in jobs if job_id > after and state != "PENDING")
        return count - len(started), sum(gpus for _, state, gpus in jobs if state in STARTED)

    return probe


def slurm_idle(env: dict[str, str]) -> bool:
    return not any(state in LIVE for _, state, _ in squeue(env))


def sbatch(env: dict[str, str], i: int, gpus: int, seconds: float) -> None:
    argv = ["sbatch", "--parsable", f"--job-name=bench{i}", f"--gres=gpu:a100:{gpus}", "--time=10"]
    argv += ["--output=/dev/null", "--wrap", f"sleep {seconds}"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"sbatch failed: {done.stderr}")


def slurm_alone(args, env: dict[str, str], jobs: list[tuple[int, int]], say) -> dict:
    """One client ``sbatch``-es every job; until Slurm has started them all."""
    after = last_job_id(env)
    probe = slurm_probe(env, after, len(jobs))
    with Sampler(probe, args.nodes * args.gpus_per_node) as sampler:
        first = time.monotonic()
        for i, (gpus, seconds) in enumerate(jobs):
            sbatch(env, i, gpus, seconds)
        submit_s = time.monotonic() - first
        all_running = wait_until(lambda: probe()[0] == 0, args.timeout, "Slurm alone: all running") - first
    wait_until(lambda: slurm_idle(env), args.timeout, "Slurm alone: every job ended")
    say(f"slurm alone: submitted in {submit_s:.1f} s, all running at {all_running:.1f} s")
    return {
        "submit_per_s": round(len(jobs) / submit_s, 1),
        "all_running_s": round(all_running, 1),
        "gpu_utilisation": sampler.utilisation(),
    }


def slurm_short(args, env: dict[str, str], jobs: list[tuple[int, float]], say) -> dict:
    """Queue every job with the partition down, open it, and time until the last has ended."""
    partition = ["scontrol", "update", "partitionname=gpu"]
    subprocess.run([*partition, "state=down"], env=env, check=True, capture_output=True)
    after = last_job_id(env)
    try:
        with ThreadPoolExecutor(4) as pool:  # submission is not what is measured here
            list(pool.map(lambda item: sbatch(env, item[0], *item[1]), enumerate(jobs)))
    finally:
        subprocess.run([*partition, "state=up"], env=env, check=True, capture_output=True)
    opened = time.monotonic()

    def ended() -> bool:
        return not any(job_id > after and state in LIVE for job_id, state, _ in squeue(env))

    with Sampler(slurm_probe(env, after, len(jobs)), args.nodes * args.gpus_per_node) as sampler:
        elapsed = wait_until(ended, args.timeout, "Slurm: every short job ended") - opened
    failed = sum(1 for job_id, state, _ in squeue(env) if job_id > after and state != "COMPLETED")
    say(f"slurm: {len(jobs)} short jobs in {elapsed:.1f} s ({failed} not completed)")
    return {
        "elapsed_s": round(elapsed, 1),
        "completions_per_s": round(len(jobs) / elapsed, 1),
        "gpu_utilisation": sampler.utilisation(),
        "not_completed": failed,
    }


# --- Orrery -----------------------------------------------------------------------------------


@contextmanager
def orrery_stack(extra_env: dict[str, str] | None = None, own: tuple[str, ...] = ()) -> Iterator[int]:
    """A throwaway database, migrated, and the production processes on it: gunicorn, one Celery
    worker with beat, and a worker of its own for each role in ``own`` (``dispatch``: delivery;
    ``sync``: reading clusters back), which the first worker then does not serve. Yields the
    API's port once Django is set up here too. Everything is stopped and dropped afterwards."""
    from benchmarks.throwaway import create_database, drop_database

    base = os.environ.get("DATABASE_URL", "postgres://postgres:postgres@127.0.0.1:5432/postgres")
    db_name = f"orrery_vs_slurm_{os.getpid()}"
    data_dir = f"/tmp/orrery-vs-slurm-data-{os.getpid()}"
    env = {
        **os.environ,
        "DATABASE_URL": base.rsplit("/", 1)[0] + f"/{db_name}",
        "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        "ORRERY_REDIS_PREFIX": f"orrery-vs-slurm-{os.getpid()}:",
        "ORRERY_CELERY_QUEUE": f"vs-slurm-{uuid.uuid4().hex[:8]}",
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "ORRERY_LOG_LEVEL": "WARNING",
        "ORRERY_THROTTLE_SUBMIT": "1000000/min",
        "ORRERY_NODE_GRACE": "86400",  # simulated nodes send no heartbeats in this run
        "ORRERY_DATA_DIR": data_dir,
        **(extra_env or {}),
    }
    env.pop("SLURM_JWT", None)
    os.environ.update(env)
    admin = base.rsplit("/", 1)[0] + "/postgres"
    create_database(admin, db_name)
    processes: list[subprocess.Popen] = []
    try:
        import django

        django.setup()
        from django.conf import settings
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        port = free_port()
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
        celery = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "portal",
            "worker",
            "--pool",
            "solo",
            "--loglevel",
            "WARNING",
        ]
        roles = [r for r in settings.ORRERY_CELERY_ROLES if r not in own]
        queue = env["ORRERY_CELERY_QUEUE"]
        main_queues = ",".join(f"{queue}.{role}" for role in roles)
        workers = [
            [*celery, "-n", f"main-{queue}@%h", "-Q", main_queues, "--beat", "--schedule", f"{data_dir}/beat"]
        ]
        workers += [[*celery, "-n", f"{role}-{queue}@%h", "-Q", f"{queue}.{role}"] for role in own]
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        log = open(Path(data_dir) / "processes.log", "a")  # noqa: SIM115
        processes = [
            subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=log) for argv in (gunicorn, *workers)
        ]
        wait_for_port(port)
        _wait_for_workers(1 + len(own))
        yield port
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:  # a worker in the middle of a long delivery
                process.kill()
                process.wait()
        drop_database(admin, db_name)
        shutil.rmtree(data_dir, ignore_errors=True)


def _wait_for_workers(count: int, timeout: float = 120.0) -> None:
    """Until ``count`` Celery workers answer a ping (started and consuming), then a little more
    for the beat's first sends."""
    from celery import current_app

    end = time.monotonic() + timeout
    while len(current_app.control.ping(timeout=1.0)) < count:
        if time.monotonic() > end:
            raise RuntimeError(f"fewer than {count} Celery workers answer")
    time.sleep(2)


def submitter(username: str, projects: list[str]) -> str:
    """An API token of a user who is a member of ``projects`` (each with a default queue)."""
    from django.contrib.auth import get_user_model

    from portal.choices import Role
    from portal.models import Membership, Project
    from portal.services.tokens import issue_token
    from scheduling.models import Queue

    user = get_user_model().objects.create_user(username, password="bench")
    for name in projects:
        project = Project.objects.create(name=name)
        Membership.objects.create(user=user, project=project, role=Role.MEMBER)
        Queue.objects.create(project=project, name="default")
    return issue_token(user, name="bench")[1]


def spec(i: int, gpus: int, seconds: float, project: str, cluster: str | None = None) -> dict:
    body = {
        "apiVersion": "orrery/v1",
        "kind": "Job",
        "metadata": {"name": f"bench{i}", "project": project},
        "spec": {
            "resources": {"gpus": f"a100:{gpus}"},
            "run": f"sleep {seconds}",
            "timeLimit": "10",
            "sim": {"duration": f"{seconds}s"},
        },
    }
    if cluster:
        body["spec"]["placement"] = {"clusters": [cluster]}
    return body


class Api:
    """One keep-alive client of the API."""

    def __init__(self, port: int, token: str) -> None:
        self.client = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        for _ in range(8):  # every gunicorn worker has loaded the application before the clock runs
            warm = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            warm.request("GET", "/api/v1/jobs?limit=1", headers=self.headers)
            warm.getresponse().read()
            warm.close()

    def post(self, path: str, body: dict) -> None:
        self.client.request("POST", path, body=json.dumps(body), headers=self.headers)
        response = self.client.getresponse()
        text = response.read()
        if response.status != 201:
            raise RuntimeError(f"POST {path}: {response.status} {text[:300]!r}")

    def submit_batches(self, specs: list[dict], size: int = 500) -> None:
        # A fresh connection: the server closes one left idle (as it is through a Slurm round).
        self.client.close()
        for start in range(0, len(specs), size):
            self.post("/api/v1/jobs/batch", {"jobs": specs[start : start + size]})


def _sql(query: str, params: list) -> tuple:
    from django.db import close_old_connections, connection

    close_old_connections()
    with connection.cursor() as cursor:
        cursor.execute(query, params)
        return cursor.fetchone()


def _sql_or_none(query: str, params: list) -> tuple:
    """``_sql`` for a figure on the side: a failure is printed, not the end of the run."""
    try:
        return _sql(query, params)
    except Exception as exc:
        print(f"could not measure: {exc}", file=sys.stderr)
        return (None, None)


def orrery_probe(project: str) -> Probe:
    """Jobs of ``project`` not started yet, and GPUs allocated, as Orrery's database has them."""

    def probe() -> tuple[int, int]:
        pending = _sql(
            "SELECT count(*) FILTER (WHERE j.state IN ('PENDING', 'SCHEDULED')) FROM scheduling_job j"
            " JOIN portal_project p ON p.id = j.project_id WHERE p.name = %s",
            [project],
        )[0]
        allocated = _sql(
            "SELECT count(*) FROM scheduling_allocation WHERE active AND gpu_id IS NOT NULL", []
        )[0]
        return pending, allocated

    return probe


# --- overhead: Orrery over Slurm --------------------------------------------------------------


@contextmanager
def unix_account() -> Iterator[str]:
    """A throwaway Unix account for the jobs Orrery dispatches (never root); removed after."""
    name = f"orrbench{os.getpid() % 100_000}"
    subprocess.run(["useradd", "-m", "-s", "/bin/sh", name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
        subprocess.run(["userdel", "-r", name], capture_output=True)


def orrery_over_slurm(args, env: dict[str, str], api: Api, project: str, jobs, say) -> dict:
    after = last_job_id(env)
    probe = slurm_probe(env, after, len(jobs))
    with Sampler(probe, args.nodes * args.gpus_per_node) as sampler:
        first = time.monotonic()
        api.submit_batches([spec(i, g, s, project, "hpc") for i, (g, s) in enumerate(jobs)])
        submit_s = time.monotonic() - first
        all_running = (
            wait_until(lambda: probe()[0] == 0, args.timeout, "Orrery over Slurm: all running") - first
        )
    wait_until(lambda: slurm_idle(env), args.timeout, "Orrery over Slurm: every job ended")
    say(f"orrery over slurm: submitted in {submit_s:.1f} s, all running at {all_running:.1f} s")
    return {
        "submit_per_s": round(len(jobs) / submit_s, 1),
        "all_running_s": round(all_running, 1),
        "gpu_utilisation": sampler.utilisation(),
        **_layer_latency(env, project),
    }


def _layer_latency(env: dict[str, str], project: str) -> dict:
    """Medians, over the round's jobs, of placed in Orrery → submitted to Slurm, and ended in
    Slurm → seen ended by Orrery (Slurm's times are whole seconds)."""
    try:
        return _latencies(env, project)
    except Exception as exc:  # a figure on the side: never the end of the run
        print(f"could not measure the layer's latency: {exc}", file=sys.stderr)
        return {}


def _latencies(env: dict[str, str], project: str) -> dict:
    from datetime import datetime

    from scheduling.models import JobAttempt

    out = subprocess.run(
        ["squeue", "-h", "-t", "all", "-o", "%i %V %e"], env=env, capture_output=True, text=True
    ).stdout
    slurm = {}
    for line in out.splitlines():
        job_id, submitted, ended = line.split(" ")
        try:
            slurm[job_id] = (
                datetime.fromisoformat(submitted).timestamp(),
                datetime.fromisoformat(ended).timestamp(),
            )
        except ValueError:
            continue
    placed, seen = [], []
    for remote_id, created, finished in JobAttempt.objects.filter(job__project__name=project).values_list(
        "remote_id", "created_at", "finished_at"
    ):
        if remote_id in slurm and finished:
            submitted, ended = slurm[remote_id]
            placed.append(submitted - created.timestamp())
            seen.append(finished.timestamp() - ended)
    if not placed:
        return {}
    return {
        "placed_to_submitted_s": round(statistics.median(placed), 2),
        "end_to_seen_s": round(statistics.median(seen), 2),
    }


def ring_on_end(cluster, env: dict[str, str], port: int) -> Callable[[bool], None]:
    """A switch for the dev Slurm's epilog (``orrery-epilog``): on, it rings this Orrery when a
    job of its ends, with a collector credential of the cluster, as an operator sets it up."""
    from django.core.cache import cache

    from clusters.services.credentials import issue_cluster_credential
    from scheduling.wakeup import ringing_key

    etc = Path(env["SLURM_CONF"]).parent
    _, credential = issue_cluster_credential(cluster, name="epilog")
    (etc / "orrery-hpc.credential").write_text(credential)
    (etc / "orrery-hpc.credential").chmod(0o600)
    text = (
        f"url=http://127.0.0.1:{port}\ncluster={cluster.name}\ncredential_file={etc}/orrery-hpc.credential\n"
    )

    def switch(on: bool) -> None:
        conf = etc / "orrery-epilog.conf"
        if on:
            conf.write_text(text)
        else:
            conf.unlink(missing_ok=True)
            cache.delete(ringing_key(cluster.pk))  # polled at its own pace from the first job

    return switch


def run_overhead(args, say) -> dict:
    jobs = workload(args.jobs, args.seed)
    result: dict = {
        "job_end": {
            "on": "rung by Slurm's EpilogSlurmctld, and polled",
            "off": "polled only (orrery_over_slurm_polled)",
            "alternate": "rung in rounds 1, 3, ...; polled only in rounds 2, 4, ... (orrery_over_slurm_polled)",
        }[args.ring],
        "gpu_seconds_demanded": sum(g * s for g, s in jobs),
        "fleet_bound_s": round(sum(g * s for g, s in jobs) / (args.nodes * args.gpus_per_node), 1),
        "orrery_dispatch_rate": "ORRERY_DISPATCH_PER_S_BY_KIND slurm=0 (no limit) for the run",
    }
    slurm_runs, orrery_runs, polled_runs = [], [], []
    with slurm_cluster(args, say) as env, unix_account() as account:
        result["slurm_start_s"] = float(env["slurm_start_s"])
        slurm_runs.append(slurm_alone(args, env, jobs, say))
        extra = {
            "ORRERY_DISPATCH_PER_S_BY_KIND": "simulated=0,native=0,slurm=0",
            "SLURM_CONF": env["SLURM_CONF"],
        }
        with orrery_stack(extra, own=("dispatch", "sync")) as port:
            from clusters.choices import NodeState
            from clusters.models import Node
            from clusters.services.onboarding import onboard_slurm

            token = Path(env["ORRERY_SLURM_TOKEN_FILE"]).read_text().strip()
            cluster, _ = onboard_slurm(
                "hpc", env["ORRERY_SLURM_URL"], token, slurm_conf=env["SLURM_CONF"], identity="same_name"
            )
            Node.objects.filter(cluster=cluster).update(state=NodeState.READY)
            ring_conf = ring_on_end(cluster, env, port)
            projects = [f"over-slurm-{r}" for r in range(args.rounds)]
            api = Api(port, submitter(account, projects))
            for r, project in enumerate(projects):
                rung = args.ring == "on" or (args.ring == "alternate" and r % 2 == 0)
                ring_conf(rung)
                (orrery_runs if rung else polled_runs).append(
                    orrery_over_slurm(args, env, api, project, jobs, say)
                )
                if r + 1 < args.rounds:
                    slurm_runs.append(slurm_alone(args, env, jobs, say))
        slurm_runs.append(slurm_alone(args, env, jobs, say))
    sides = {"slurm": slurm_runs, "orrery_over_slurm": orrery_runs, "orrery_over_slurm_polled": polled_runs}
    result |= summarise_rounds({side: runs for side, runs in sides.items() if runs})
    for side, suffix in (("orrery_over_slurm", ""), ("orrery_over_slurm_polled", "_polled")):
        if sides[side]:
            result[f"all_running_ratio{suffix}"] = median_ratio(result, side, "slurm", "all_running_s")
            result[f"utilisation_ratio{suffix}"] = median_ratio(result, side, "slurm", "gpu_utilisation")
    return result


# --- short: a scheduling-bound workload --------------------------------------------------------


def orrery_short(args, api: Api, cluster, project: str, jobs, say) -> dict:
    """Queue every job on the disabled simulated cluster, enable it, time until the last ended."""
    from celery import current_app

    from clusters.choices import ClusterState
    from clusters.models import Cluster
    from scheduling.wakeup import CYCLE_TASK

    Cluster.objects.filter(pk=cluster.pk).update(state=ClusterState.DISABLED)
    api.submit_batches([spec(i, g, s, project) for i, (g, s) in enumerate(jobs)])
    Cluster.objects.filter(pk=cluster.pk).update(state=ClusterState.READY)
    current_app.send_task(CYCLE_TASK)
    opened = time.monotonic()
    live = (
        "SELECT count(*) FILTER (WHERE j.state IN ('PENDING', 'SCHEDULED', 'RUNNING')),"
        " count(*) FILTER (WHERE j.state <> 'SUCCEEDED') FROM scheduling_job j"
        " JOIN portal_project p ON p.id = j.project_id WHERE p.name = %s"
    )
    with Sampler(orrery_probe(project), args.nodes * args.gpus_per_node) as sampler:
        elapsed = wait_until(lambda: _sql(live, [project])[0] == 0, args.timeout, "Orrery: every job ended")
        elapsed -= opened
    failed = _sql(live, [project])[1]
    # Where a job's GPUs wait beyond its run: placed → started (delivery), run over → seen ended.
    delivered, seen = _sql_or_none(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM a.started_at - a.created_at)),"
        " percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM a.finished_at - a.started_at)"
        " - (j.spec->'sim'->>'durationSeconds')::float) FROM scheduling_jobattempt a"
        " JOIN scheduling_job j ON j.id = a.job_id JOIN portal_project p ON p.id = j.project_id WHERE p.name = %s",
        [project],
    )
    say(f"orrery: {len(jobs)} short jobs in {elapsed:.1f} s ({failed} not succeeded)")
    return {
        "elapsed_s": round(elapsed, 1),
        "completions_per_s": round(len(jobs) / elapsed, 1),
        "gpu_utilisation": sampler.utilisation(),
        "not_completed": failed,
        "placed_to_started_s": delivered if delivered is None else round(delivered, 3),
        "end_to_seen_s": seen if seen is None else round(seen, 3),
    }


def run_short(args, say) -> dict:
    jobs = short_workload(args.jobs, args.seed)
    demanded = sum(g * s for g, s in jobs)
    result: dict = {
        "gpu_seconds_demanded": round(demanded, 1),
        "fleet_bound_s": round(demanded / (args.nodes * args.gpus_per_node), 1),
    }
    slurm_runs, orrery_runs = [], []
    with slurm_cluster(args, say) as env:
        result["slurm_start_s"] = float(env["slurm_start_s"])
        slurm_runs.append(slurm_short(args, env, jobs, say))
        with orrery_stack() as port:
            cluster = simulated_fleet(args.nodes, args.gpus_per_node, **SIM_NODE)
            projects = [f"short-{r}" for r in range(args.rounds)]
            api = Api(port, submitter("bench", projects))
            for r, project in enumerate(projects):
                orrery_runs.append(orrery_short(args, api, cluster, project, jobs, say))
                if r + 1 < args.rounds:
                    slurm_runs.append(slurm_short(args, env, jobs, say))
        slurm_runs.append(slurm_short(args, env, jobs, say))
    result |= summarise_rounds({"slurm": slurm_runs, "orrery": orrery_runs})
    result["completions_ratio"] = median_ratio(result, "orrery", "slurm", "completions_per_s")
    result["utilisation_ratio"] = median_ratio(result, "orrery", "slurm", "gpu_utilisation")
    return result


# --- classic: Orrery on a simulated cluster, one job per call ----------------------------------


def orrery_classic(args, api: Api, jobs, mode: str, project: str, say) -> dict:
    probe = orrery_probe(project)
    with Sampler(probe, args.nodes * args.gpus_per_node) as sampler:
        first = time.monotonic()
        specs = [spec(i, g, s, project) for i, (g, s) in enumerate(jobs)]
        if mode == "single":
            for body in specs:
                api.post("/api/v1/jobs", body)
        else:
            api.submit_batches(specs)
        submit_s = time.monotonic() - first
        say(f"orrery ({mode}): {len(jobs)} jobs submitted in {submit_s:.1f} s")
        all_running = wait_until(lambda: probe()[0] == 0, args.timeout, "Orrery: all running") - first
    # Let this run's jobs finish before the next run starts.
    wait_until(lambda: not probe()[1], args.timeout, "Orrery: every job ended")
    prefix = "orrery" if mode == "single" else "orrery_batch"
    return {
        f"{prefix}_submit_per_s": round(len(jobs) / submit_s, 1),
        f"{prefix}_all_running_s": round(all_running, 1),
        f"{prefix}_gpu_utilisation": sampler.utilisation(),
    }


def run_classic(args, say) -> dict:
    jobs = workload(args.jobs, args.seed)
    result: dict = {
        "gpu_seconds_demanded": sum(g * s for g, s in jobs),
        # running the demanded GPU-seconds on every GPU at once: no schedule finishes sooner
        "fleet_bound_s": round(sum(g * s for g, s in jobs) / (args.nodes * args.gpus_per_node), 1),
    }
    with slurm_cluster(args, say) as env:
        result["slurm_start_s"] = float(env["slurm_start_s"])
        result |= {f"slurm_{k}": v for k, v in slurm_alone(args, env, jobs, say).items()}
    with orrery_stack() as port:
        simulated_fleet(args.nodes, args.gpus_per_node, **SIM_NODE)
        api = Api(port, submitter("bench", ["bench", "bench-batch"]))
        result |= orrery_classic(args, api, jobs, "single", "bench", say)
        result |= orrery_classic(args, api, jobs, "batch", "bench-batch", say)
    result["all_running_ratio"] = round(result["orrery_all_running_s"] / result["slurm_all_running_s"], 3)
    result["submit_ratio"] = round(result["orrery_submit_per_s"] / result["slurm_submit_per_s"], 2)
    result["batch_submit_ratio"] = round(
        result["orrery_batch_submit_per_s"] / result["slurm_submit_per_s"], 2
    )
    return result


MODES = {"overhead": run_overhead, "short": run_short, "classic": run_classic}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, default="overhead")
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--jobs", type=int, help="default: 2,000 (overhead, classic), 20,000 (short)")
    parser.add_argument("--rounds", type=int, default=1, help="Orrery runs; Slurm alone runs one more")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for each phase")
    parser.add_argument(
        "--ring",
        choices=("on", "off", "alternate"),
        default="on",
        help="overhead: whether Slurm's epilog rings Orrery at a job's end (alternate: by round)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    args = parser.parse_args()
    args.jobs = args.jobs or (20_000 if args.mode == "short" else 2000)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the way an error does: cleaned up
    if os.geteuid() != 0:
        raise SystemExit("run as root: the dev Slurm runs as root, and Orrery submits with sbatch --uid")
    result: dict = {
        "mode": args.mode,
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "jobs": args.jobs,
        "orrery_submit_throttle": "raised to 1000000/min for the run (default 1200/min per user)",
    }
    result |= MODES[args.mode](args, say)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
