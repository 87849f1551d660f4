#!/usr/bin/env python
"""Per-tenant fairness benchmark: does tenant A's burst raise tenant B's latency?

    python benchmarks/fairness.py --json

Runs the production HTTP server, gunicorn (2 workers x 4 threads by default), on loopback
against PostgreSQL and Redis (``DATABASE_URL``/``REDIS_URL``, defaults on loopback) in a
throwaway database with a small simulated fleet and two users in two projects. Tenant B runs a
steady trickle of job requests (each client alternates ``POST /api/v1/jobs`` and
``GET /api/v1/jobs``, pausing between requests); tenant A bursts with many concurrent clients
doing the same as fast as they can. The per-minute rates are raised out of the way so that only
the per-tenant concurrency limit (``ORRERY_API_TENANT_CONCURRENCY``) is measured.

For each limit (off = 0, then ``--limit``) it starts a fresh gunicorn and measures B's p50/p99
per method alone (the yardstick, same run, same server) and then during A's burst; with the
limit on, twice: A ignoring ``Retry-After`` (hammering) and A honouring it. It prints one JSON
object with the figures and the ratio of each to its yardstick. The load generator shares the
machine's cores with the server. Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.fleet import simulated_fleet  # noqa: E402
from benchmarks.heartbeats import percentile, stop_process, wait_for_port  # noqa: E402
from benchmarks.throwaway import throwaway_database  # noqa: E402

SPEC = {
    "apiVersion": "orrery/v1",
    "kind": "Job",
    "metadata": {"name": "bench", "project": ""},
    "spec": {"queue": "default", "resources": {"gpus": "a100:1"}, "timeLimit": "1h", "run": "true"},
}


# --- load generators (child processes; no Django here) -----------------------------------------


def client_loop(
    port: int, token: str, project: str, until: float, pause_s: float, honour_retry: bool
) -> dict[str, object]:
    """One client: alternate a submission and a list read until ``until``; latency per method."""
    body = json.dumps({**SPEC, "metadata": {"name": "bench", "project": project}}).encode()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    latencies: dict[str, list[float]] = {"POST": [], "GET": []}
    codes: Counter[str] = Counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    turn = 0
    while time.monotonic() < until:
        method = ("POST", "GET")[turn % 2]
        turn += 1
        started = time.perf_counter()
        try:
            if method == "POST":
                conn.request("POST", "/api/v1/jobs", body=body, headers=headers)
            else:
                conn.request("GET", "/api/v1/jobs?limit=20", headers=headers)
            response = conn.getresponse()
            response.read()
        except (OSError, http.client.HTTPException):
            codes["error"] += 1
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            continue
        elapsed_ms = (time.perf_counter() - started) * 1000
        codes[str(response.status)] += 1
        if response.status < 400:
            latencies[method].append(elapsed_ms)
        if response.status == 429 and honour_retry:
            time.sleep(float(response.getheader("Retry-After", "1")))
        elif pause_s:
            time.sleep(pause_s)
    conn.close()
    return {"latencies": latencies, "codes": dict(codes)}


def client_process(
    port: int, token: str, project: str, threads: int, until: float, pause_s: float, honour_retry: bool
) -> list[dict[str, object]]:
    results: list[dict[str, object]] = []

    def run() -> None:
        results.append(client_loop(port, token, project, until, pause_s, honour_retry))

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return results


def summary(outcomes: list[dict], seconds: float) -> dict[str, object]:
    out: dict[str, object] = {}
    for method in ("GET", "POST"):
        values = [x for o in outcomes for x in o["latencies"][method]]
        out[method.lower()] = {
            "n": len(values),
            "p50_ms": round(percentile(values, 0.50), 1),
            "p99_ms": round(percentile(values, 0.99), 1),
        }
    codes: Counter[str] = Counter()
    for o in outcomes:
        codes.update(o["codes"])
    out["codes"] = dict(sorted(codes.items()))
    out["requests_per_s"] = round(sum(codes.values()) / seconds, 1)
    return out


def phase(args, tenants: dict, burst: str | None) -> dict[str, object]:
    """B's trickle for ``args.seconds``; with ``burst`` ("ignore" or "honour"), A's burst beside it."""
    until = time.monotonic() + args.seconds + (args.warmup if burst else 0)
    b_from = time.monotonic() + (args.warmup if burst else 0)  # let A's burst reach full pressure
    ctx = mp.get_context("fork")
    with ctx.Pool(args.a_processes + 1) as pool:
        b_job = pool.apply_async(
            delayed_client,
            (b_from, args.port, *tenants["b"], args.b_clients, until, args.b_pause_ms / 1000, True),
        )
        a_jobs = []
        if burst:
            per = args.a_clients // args.a_processes
            a_jobs = [
                pool.apply_async(
                    client_process, (args.port, *tenants["a"], per, until, 0.0, burst == "honour")
                )
                for _ in range(args.a_processes)
            ]
        b = summary(b_job.get(), args.seconds)
        result: dict[str, object] = {"b": b}
        if burst:
            a = summary([o for j in a_jobs for o in j.get()], args.seconds + args.warmup)
            result["a"] = {"codes": a["codes"], "requests_per_s": a["requests_per_s"]}
    return result


def delayed_client(start_at: float, *rest) -> list[dict[str, object]]:
    time.sleep(max(0.0, start_at - time.monotonic()))
    return client_process(*rest)


def ratios(during: dict, alone: dict) -> dict[str, float]:
    return {
        f"{method}_{q}": round(during[method][q] / alone[method][q], 2)
        for method in ("get", "post")
        for q in ("p50_ms", "p99_ms")
        if alone[method]["n"] and during[method]["n"]
    }


# --- set-up and servers (Django in this process) ------------------------------------------------


def build_world() -> dict[str, tuple[str, str]]:
    """A simulated cluster of 16 nodes with 8 A100s, and tenants a and b, each alone in a project."""
    from django.contrib.auth import get_user_model

    from portal.choices import Role
    from portal.models import Membership, Project
    from portal.services.tokens import issue_token
    from scheduling.models import Queue

    simulated_fleet(16)
    tenants = {}
    for name in ("a", "b"):
        user = get_user_model().objects.create_user(f"tenant-{name}", password=f"tenant-{name}")
        project = Project.objects.create(name=f"project-{name}")
        Membership.objects.create(user=user, project=project, role=Role.MEMBER)
        Queue.objects.create(project=project, name="default")
        tenants[name] = (issue_token(user, name="bench")[1], project.name)
    return tenants


def start_server(args, env: dict[str, str], limit: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "gunicorn", "portal.wsgi:application", "--bind", f"127.0.0.1:{args.port}"]
    argv += ["--workers", str(args.workers), "--worker-class", "gthread", "--threads", str(args.threads)]
    argv += ["--log-level", "warning", "--keep-alive", "30"]
    server = subprocess.Popen(argv, cwd=ROOT, env={**env, "ORRERY_API_TENANT_CONCURRENCY": str(limit)})
    wait_for_port(args.port, timeout=60.0)
    time.sleep(1.0)
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=4, help="ORRERY_API_TENANT_CONCURRENCY when on")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each measured phase")
    parser.add_argument(
        "--warmup", type=float, default=3.0, help="a fresh server's warm-up, and A's head start on B"
    )
    parser.add_argument("--workers", type=int, default=2, help="gunicorn workers")
    parser.add_argument("--threads", type=int, default=4, help="threads per gunicorn worker")
    parser.add_argument("--a-clients", type=int, default=32, help="tenant A's concurrent clients")
    parser.add_argument("--a-processes", type=int, default=4, help="processes A's clients run in")
    parser.add_argument("--b-clients", type=int, default=2, help="tenant B's concurrent clients")
    parser.add_argument("--b-pause-ms", type=float, default=50.0, help="B's pause between requests")
    parser.add_argument("--port", type=int, default=18_433)
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    args = parser.parse_args()
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))

    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    with throwaway_database("orrery_fairness") as database_url:
        tenants = build_world()
        env = {
            **os.environ,
            "DATABASE_URL": database_url,
            "REDIS_URL": redis_url,
            "ORRERY_REDIS_PREFIX": f"orrery-fairness-{os.getpid()}:",
            "ORRERY_LOG_LEVEL": "ERROR",  # not a line per 429
            # the per-minute rates out of the way: only the concurrency limit is measured
            "ORRERY_THROTTLE_SUBMIT": "10000000/min",
            "ORRERY_THROTTLE_READ": "10000000/min",
        }
        result: dict[str, object] = {
            "server": f"gunicorn gthread {args.workers}x{args.threads}",
            "a_clients": args.a_clients,
            "b_clients": args.b_clients,
            "b_pause_ms": args.b_pause_ms,
            "seconds": args.seconds,
            "cpus": os.cpu_count(),
        }
        runs = [("off", 0, ["ignore"]), ("on", args.limit, ["ignore", "honour"])]
        for label, limit, bursts in runs:
            say(f"limit {label} ({limit}): B alone")
            server = start_server(args, env, limit)
            try:
                warm = time.monotonic() + args.warmup  # every worker thread imports and connects
                client_process(args.port, *tenants["b"], args.workers * args.threads, warm, 0.0, True)
                alone = phase(args, tenants, None)["b"]
                block: dict[str, object] = {"limit": limit, "b_alone": alone}
                for burst in bursts:
                    say(f"limit {label}: B while A bursts ({burst} Retry-After)")
                    during = phase(args, tenants, burst)
                    block[f"a_burst_{burst}s_retry_after"] = {
                        "b": during["b"],
                        "a": during["a"],
                        "b_ratio_to_alone": ratios(during["b"], alone),
                    }
            finally:
                stop_process(server, 30)
            result[label] = block
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
