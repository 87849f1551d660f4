#!/usr/bin/env python
"""Job submission: one job per request and batched, against one ``sbatch`` client and a bare view.

    python benchmarks/submission.py --json
    python benchmarks/submission.py --profile 300      # in-process cProfile of POST /api/v1/jobs
    py-spy record -r 200 -o out.txt -f raw -- python benchmarks/submission.py --profile 40 --profile-batch --unprofiled

A throwaway PostgreSQL database with one simulated cluster, and gunicorn (2 workers × 4 threads,
production settings) serving the API on loopback. One client, one keep-alive connection:

* ``per_request_jobs_per_s`` — ``POST /api/v1/jobs``, one job a request, ``--jobs`` a sample;
* ``batched_jobs_per_s`` — ``POST /api/v1/jobs/batch``, ``--batch`` specs a request.

Yardsticks, measured in the same run before, between and after those phases (medians used):

* ``sbatch_jobs_per_s`` — one ``sbatch`` client against the dev Slurm the benchmark starts
  (``scripts/slurm-dev-cluster.sh``, its own directory and ports; the jobs are held, so no job
  runs while the controller takes submissions);
* ``bare_view_per_s`` — a Django view on the same gunicorn that inserts the request body as one
  row (the whole middleware stack, one INSERT, no Orrery code).

``submit_vs_sbatch`` = per-request rate ÷ ``sbatch`` rate; ``submit_vs_bare_view`` = per-request
rate ÷ the bare view's; ``batched_vs_sbatch`` and ``batched_vs_bare_view`` likewise. Every sample
starts with an empty queue (a fresh project): the waiting-job caps count a project's waiting jobs
on each submission, and a backlog that grows through the run would make later samples slower
than earlier ones. The per-user submit throttle (default 1,200/min) is raised for the run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BARE_PATH = "/bench/bare-insert"
BARE_TABLE = "bench_bare_row"


# --- the served application: Orrery's WSGI app plus the bare view -------------------------------


def bare_insert(request):  # pragma: no cover - runs inside gunicorn
    """The yardstick: the request body stored as one row, through Django's whole request cycle."""
    from django.db import connection
    from django.http import JsonResponse

    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {BARE_TABLE} (body) VALUES (%s) RETURNING id", [request.body.decode()])
        (pk,) = cursor.fetchone()
    return JsonResponse({"id": pk}, status=201)


def _served():  # pragma: no cover - runs inside gunicorn
    import django

    django.setup()  # before the URLs import views and models
    from django.urls import path
    from django.views.decorators.csrf import csrf_exempt

    import portal.urls
    from portal.wsgi import application

    portal.urls.urlpatterns.append(path(BARE_PATH.lstrip("/"), csrf_exempt(bare_insert)))
    return application


if os.environ.get("ORRERY_SUBMISSION_BENCH_SERVE"):
    application = _served()


# --- setup -------------------------------------------------------------------------------------


def environment(db_name: str) -> dict[str, str]:
    from cryptography.fernet import Fernet

    base = os.environ.get("DATABASE_URL", "postgres://postgres:postgres@127.0.0.1:5432/postgres")
    return {
        **os.environ,
        "DATABASE_URL": base.rsplit("/", 1)[0] + f"/{db_name}",
        "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        "ORRERY_REDIS_PREFIX": f"orrery-submission-{os.getpid()}:",
        "ORRERY_CELERY_QUEUE": f"submission-{uuid.uuid4().hex[:8]}",
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "ORRERY_ENVIRONMENT": "production",
        "ORRERY_HTTPS": "0",  # loopback, no TLS terminator in front
        "ORRERY_SECRET_KEY": secrets.token_urlsafe(50),
        "ORRERY_SECRETS_KEYS": Fernet.generate_key().decode(),
        "ORRERY_ALLOWED_HOSTS": "127.0.0.1,localhost",
        "ORRERY_LOG_LEVEL": "WARNING",
        "ORRERY_THROTTLE_SUBMIT": "1000000/min",
        "ORRERY_NODE_GRACE": "86400",
        "ORRERY_DATA_DIR": f"/tmp/orrery-submission-data-{os.getpid()}",
    }


def setup_orrery() -> str:
    """Migrate, make the fleet, the user and the bare view's table; the user's token."""
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection

    from benchmarks.fleet import simulated_fleet
    from portal.services.tokens import issue_token

    call_command("migrate", verbosity=0)
    simulated_fleet(4)
    user = get_user_model().objects.create_user("bench", password=secrets.token_urlsafe(16))
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE TABLE {BARE_TABLE} (id bigserial PRIMARY KEY, body jsonb NOT NULL)")
    return issue_token(user, name="bench")[1]


def new_project() -> str:
    """A fresh project (with its default queue) for one sample: every sample starts empty."""
    from django.contrib.auth import get_user_model

    from portal.choices import Role
    from portal.models import Membership, Project
    from scheduling.models import Queue

    name = f"p{uuid.uuid4().hex[:10]}"
    project = Project.objects.create(name=name)
    Membership.objects.create(
        user=get_user_model().objects.get(username="bench"), project=project, role=Role.MEMBER
    )
    Queue.objects.create(project=project, name="default")
    return name


def spec(i: int, project: str) -> dict:
    return {
        "apiVersion": "orrery/v1",
        "kind": "Job",
        "metadata": {"name": f"bench{i}", "project": project},
        "spec": {
            "resources": {"gpus": "a100:1"},
            "run": "sleep 1",
            "timeLimit": "1",
            "sim": {"duration": "1s"},
        },
    }


# --- the phases ----------------------------------------------------------------------------------


def _post(client: http.client.HTTPConnection, path: str, body: bytes, headers: dict) -> None:
    client.request("POST", path, body=body, headers=headers)
    response = client.getresponse()
    text = response.read()
    if response.status != 201:
        raise RuntimeError(f"POST {path}: {response.status} {text[:300]!r}")


def per_request(port: int, token: str, jobs: int) -> float:
    project = new_project()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    bodies = [json.dumps(spec(i, project)).encode() for i in range(jobs)]
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    _post(client, "/api/v1/jobs", bodies[0], headers)  # connect, warm this worker
    started = time.perf_counter()
    for body in bodies[1:]:
        _post(client, "/api/v1/jobs", body, headers)
    elapsed = time.perf_counter() - started
    client.close()
    return (jobs - 1) / elapsed


def batched(port: int, token: str, requests: int, size: int) -> float:
    project = new_project()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    bodies = [
        json.dumps({"jobs": [spec(r * size + k, project) for k in range(size)]}).encode()
        for r in range(requests + 1)
    ]
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    _post(client, "/api/v1/jobs/batch", bodies[0], headers)
    started = time.perf_counter()
    for body in bodies[1:]:
        _post(client, "/api/v1/jobs/batch", body, headers)
    elapsed = time.perf_counter() - started
    client.close()
    return requests * size / elapsed


def bare_view(port: int, requests: int) -> float:
    body = json.dumps(spec(0, "bare")).encode()
    headers = {"Content-Type": "application/json"}
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    _post(client, BARE_PATH, body, headers)
    started = time.perf_counter()
    for _ in range(requests):
        _post(client, BARE_PATH, body, headers)
    elapsed = time.perf_counter() - started
    client.close()
    return requests / elapsed


class Slurm:
    """A throwaway dev Slurm (``scripts/slurm-dev-cluster.sh``) with ports of its own."""

    def __init__(self, nodes: int) -> None:
        pid = os.getpid()
        self.base = Path(f"/tmp/orrery-submission-slurm-{pid}")
        offset = pid % 500
        self.env = {
            **os.environ,
            "ORRERY_SLURM_DIR": str(self.base),
            "ORRERY_SLURM_NODES": str(nodes),
            "ORRERY_SLURM_GPUS": "8",
            "ORRERY_SLURM_CTLD_PORT": str(30000 + offset),
            "ORRERY_SLURM_SLURMD_PORT": str(31000 + offset * 4),
            "ORRERY_SLURM_REST_PORT": str(33100 + offset),
            "SLURM_CONF": str(self.base / "etc/slurm.conf"),
        }
        self.env.pop("SLURM_JWT", None)
        self.script = str(ROOT / "scripts/slurm-dev-cluster.sh")

    def __enter__(self) -> Slurm:
        for _ in range(2):  # a loaded machine may miss the script's 32 s once
            up = subprocess.run([self.script, "up"], env=self.env, capture_output=True, text=True)
            if up.returncode == 0:
                break
            logs = "".join(p.read_text()[-1000:] for p in sorted((self.base / "log").glob("*")))
            self.__exit__()
        else:
            raise RuntimeError(f"the Slurm cluster did not start: {up.stderr[-1000:]}\n{logs}")
        self.sbatch(5)  # the controller's first RPCs are slower
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run([self.script, "down"], env=self.env, capture_output=True)
        shutil.rmtree(self.base, ignore_errors=True)

    def sbatch(self, jobs: int) -> float:
        argv = ["sbatch", "--parsable", "--hold", "--gres=gpu:a100:1", "--time=1", "--output=/dev/null"]
        started = time.perf_counter()
        for i in range(jobs):
            done = subprocess.run(
                [*argv, f"--job-name=bench{i}", "--wrap", "sleep 1"],
                env=self.env,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise RuntimeError(f"sbatch failed: {done.stderr}")
        elapsed = time.perf_counter() - started
        subprocess.run(
            ["scancel", "--user", os.environ.get("USER", "root")], env=self.env, capture_output=True
        )
        return jobs / elapsed


def median(values: list[float]) -> float:
    return round(statistics.median(values), 1)


def run(args) -> dict:
    from benchmarks.heartbeats import free_port, stop_process, wait_for_port
    from benchmarks.throwaway import create_database, drop_database

    db_name = f"orrery_submission_{os.getpid()}"
    env = environment(db_name)
    os.environ.update(env)
    admin = env["DATABASE_URL"].rsplit("/", 1)[0] + "/postgres"
    create_database(admin, db_name)
    server = None
    say = (lambda *a: print(*a, file=sys.stderr)) if not args.quiet else (lambda *a: None)
    try:
        token = setup_orrery()
        Path(env["ORRERY_DATA_DIR"]).mkdir(parents=True, exist_ok=True)
        port = free_port()
        argv = [sys.executable, "-m", "gunicorn", "benchmarks.submission:application", "--bind"]
        argv += [f"127.0.0.1:{port}", "--workers", "2", "--worker-class", "gthread", "--threads", "4"]
        argv += ["--log-level", "warning"]
        log = open(Path(env["ORRERY_DATA_DIR"]) / "gunicorn.log", "a")  # noqa: SIM115
        server = subprocess.Popen(
            argv, cwd=ROOT, env={**env, "ORRERY_SUBMISSION_BENCH_SERVE": "1"}, stdout=log, stderr=log
        )
        wait_for_port(port)
        bare_view(port, 20)  # both workers import and connect
        samples: dict[str, list[float]] = {"sbatch": [], "bare": [], "single": [], "batch": []}
        with Slurm(args.slurm_nodes) as slurm:

            def yardsticks() -> None:
                samples["sbatch"].append(slurm.sbatch(args.sbatch_jobs))
                samples["bare"].append(bare_view(port, args.jobs))
                say(
                    f"yardsticks: sbatch {samples['sbatch'][-1]:.1f}/s, bare view {samples['bare'][-1]:.1f}/s"
                )

            yardsticks()
            for _ in range(args.rounds):
                samples["single"].append(per_request(port, token, args.jobs))
                say(f"per request: {samples['single'][-1]:.1f} jobs/s")
                yardsticks()
                samples["batch"].append(batched(port, token, args.batch_requests, args.batch))
                say(f"batched: {samples['batch'][-1]:.1f} jobs/s")
                yardsticks()
    except BaseException:
        served = Path(env["ORRERY_DATA_DIR"]) / "gunicorn.log"
        if served.exists():
            print(served.read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        if server is not None:
            stop_process(server, 20)
        drop_database(admin, db_name)
        shutil.rmtree(env["ORRERY_DATA_DIR"], ignore_errors=True)
    single, batch = median(samples["single"]), median(samples["batch"])
    sbatch, bare = median(samples["sbatch"]), median(samples["bare"])
    return {
        "per_request_jobs_per_s": single,
        "batched_jobs_per_s": batch,
        "sbatch_jobs_per_s": sbatch,
        "bare_view_per_s": bare,
        "submit_vs_sbatch": round(single / sbatch, 3),
        "submit_vs_bare_view": round(single / bare, 3),
        "batched_vs_sbatch": round(batch / sbatch, 2),
        "batched_vs_bare_view": round(batch / bare, 2),
        "samples": {k: [round(v, 1) for v in vs] for k, vs in samples.items()},
        "jobs_per_sample": args.jobs,
        "batch_size": args.batch,
        "throttle_submit": "1000000/min (raised for the run)",
    }


def profile(args) -> None:
    """``--profile N``: N submissions through the WSGI application in this process, under cProfile."""
    import cProfile
    import io
    import pstats

    from benchmarks.throwaway import create_database, drop_database

    db_name = f"orrery_submission_prof_{os.getpid()}"
    env = environment(db_name)
    env["ORRERY_ENVIRONMENT"] = "development"
    os.environ.update(env)
    admin = env["DATABASE_URL"].rsplit("/", 1)[0] + "/postgres"
    create_database(admin, db_name)
    try:
        token = setup_orrery()
        project = new_project()
        from portal.wsgi import application as app

        def call(path: str, body: bytes) -> None:
            environ = {
                "REQUEST_METHOD": "POST",
                "PATH_INFO": path,
                "QUERY_STRING": "",
                "SERVER_NAME": "127.0.0.1",
                "SERVER_PORT": "80",
                "REMOTE_ADDR": "127.0.0.1",
                "HTTP_HOST": "127.0.0.1",
                "CONTENT_TYPE": "application/json",
                "CONTENT_LENGTH": str(len(body)),
                "HTTP_AUTHORIZATION": f"Bearer {token}",
                "wsgi.input": io.BytesIO(body),
                "wsgi.url_scheme": "http",
                "wsgi.errors": sys.stderr,
            }
            status = []
            b"".join(app(environ, lambda s, h, *a: status.append(s)))
            if not status[0].startswith("201"):
                raise RuntimeError(status[0])

        path, size = ("/api/v1/jobs/batch", args.batch) if args.profile_batch else ("/api/v1/jobs", 1)

        def body(i: int) -> bytes:
            if size == 1:
                return json.dumps(spec(i, project)).encode()
            return json.dumps({"jobs": [spec(i * size + k, project) for k in range(size)]}).encode()

        for i in range(10):
            call(path, body(i))
        bodies = [body(i) for i in range(args.profile)]
        profiler = cProfile.Profile()
        started = time.perf_counter()
        if not args.unprofiled:
            profiler.enable()
        for b in bodies:
            call(path, b)
        profiler.disable()
        elapsed = time.perf_counter() - started
        print(
            f"{args.profile} requests in {elapsed:.2f} s: {elapsed / args.profile * 1000:.2f} ms each",
            file=sys.stderr,
        )
        if args.unprofiled:
            return
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(60)
        print(out.getvalue(), file=sys.stderr)
        if args.profile_out:
            profiler.dump_stats(args.profile_out)
    finally:
        drop_database(admin, db_name)
        shutil.rmtree(env["ORRERY_DATA_DIR"], ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200, help="jobs per per-request sample")
    parser.add_argument("--batch", type=int, default=500, help="specs per batch request")
    parser.add_argument("--batch-requests", type=int, default=6, help="batch requests per sample")
    parser.add_argument("--sbatch-jobs", type=int, default=100, help="sbatch calls per yardstick sample")
    parser.add_argument("--rounds", type=int, default=2, help="per-request and batched samples each")
    parser.add_argument("--slurm-nodes", type=int, default=2)
    parser.add_argument("--profile", type=int, default=0, help="profile N submissions in-process instead")
    parser.add_argument("--profile-batch", action="store_true", help="profile batch requests (--batch each)")
    parser.add_argument(
        "--unprofiled",
        action="store_true",
        help="with --profile: time the requests without cProfile (to sample them from outside with py-spy)",
    )
    parser.add_argument("--profile-out", help="with --profile: also write the raw cProfile to this path")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    if args.profile:
        profile(args)
        return
    result = run(args)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
