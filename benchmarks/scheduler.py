#!/usr/bin/env python
"""Scheduler benchmark: decisions and their durable commit, end to end, at fleet scale.

    python benchmarks/scheduler.py --nodes 10000 --jobs 100000 --json

A throwaway PostgreSQL database gets 10,000 nodes in 4 clusters (8 GPUs each, mixed models)
and 100,000 pending jobs (1/2/4/8 GPUs, some 2–16-node gangs) in several projects and queues
with quotas and a cohort. Then cycles run until nothing more fits. Reported:

* ``placements_per_s`` — placed jobs / wall time of the cycles that placed them (sync, decide,
  one-transaction commit with COPY);
* ``cycle_ms_p50``/``cycle_ms_p99`` over those cycles;
* ``no_capacity_cycle_ms`` — a cycle over the full fleet with everything left pending;
* ``cache_build_ms`` — building the cache from the database (once per process);
* ``preempted``, ``reservations`` — with ``--policies on`` (the default profile: backfill and
  preemption; every queue may preempt lower priorities and reclaim lent quota), the jobs
  preempted once the fleet was full and the reservations the last cycle held; ``--policies
  off`` leaves both plugins out, for the same run's comparison (``benchmarks/policies.py``);
* ``rss_mb``; ``invariants_ok`` (checked in the database afterwards);
* ``limit_placements_per_s`` — the same workload through a bare numpy best-fit loop, no
  framework, no database: the yardstick.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODELS = ["h100-80g", "a100-80g", "h200-141g", "l40s-48g"]
LIMITS = [3600, 4 * 3600, 12 * 3600, 24 * 3600]  # time limits users pick: backfill's timeline reads them
PROFILE_OVERRIDE: dict = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--clusters", type=int, default=4)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--per-cycle", type=int, default=5000, help="placement limit of one cycle")
    parser.add_argument(
        "--policies",
        choices=["on", "off"],
        default="on",
        help="backfill and preemption in the profile (on, the default profile) or not (off)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.policies == "off":
        from scheduling.engine.policies import DEFAULT_PROFILE

        plugins = [p for p in DEFAULT_PROFILE["plugins"] if p not in ("backfill", "preemption")]
        PROFILE_OVERRIDE.update(DEFAULT_PROFILE | {"plugins": plugins})
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    random.seed(args.seed)

    from benchmarks.throwaway import throwaway_database

    with throwaway_database("orrery_sched") as url:
        import psycopg

        say("building the fleet and the queue")
        workload = build(args.nodes, args.jobs, args.clusters)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
        result = {"nodes": args.nodes, "jobs": args.jobs, "gpus": args.nodes * 8}
        result["per_cycle_limit"] = args.per_cycle
        result["policies"] = args.policies
        result.update(run(workload, say, args.per_cycle))
        result["limit_placements_per_s"] = bare_numpy(workload)
        result["rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        print(json.dumps(result, indent=None if args.json else 2))


def build(nodes: int, jobs: int, clusters: int) -> dict:
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from clusters.models import Cluster, GpuDevice, GpuModel, Node
    from portal.models import Project
    from scheduling.models import Job, Queue, QueueQuota

    models = {m.slug: m for m in GpuModel.objects.filter(slug__in=MODELS)}
    node_model: list[str] = []
    for c in range(clusters):
        cluster = Cluster.objects.create(name=f"c{c}", kind="simulated", state="ready")
        per = nodes // clusters
        rows = Node.objects.bulk_create(
            Node(
                cluster=cluster,
                name=f"c{c}-n{i:05d}",
                state="ready",
                gpu_capacity=8,
                cpu_millicores_capacity=128_000,
                cpu_millicores_allocatable=128_000,
                memory_bytes_capacity=2**40,
                memory_bytes_allocatable=2**40,
                labels={"rack": f"r{i % 40}"},
            )
            for i in range(per)
        )
        # two models per cluster, half the nodes each
        for i in range(len(rows)):
            node_model.append(MODELS[(c + (i % 2)) % len(MODELS)])
        GpuDevice.objects.bulk_create(
            (
                GpuDevice(
                    node=n,
                    index=g,
                    model=models[node_model[len(node_model) - per + i]],
                    memory_mb=1,
                    topology_group=f"nvl{g // 4}",
                )
                for i, n in enumerate(rows)
                for g in range(8)
            ),
            batch_size=10_000,
        )
    user = get_user_model().objects.create_user("bench", password="x")
    queues = []
    for p in range(4):
        project = Project.objects.create(name=f"p{p}")
        for q in range(2):
            queue = Queue.objects.create(
                project=project,
                name=f"q{q}",
                priority=q * 10,
                cohort="all",
                fair_share_weight=1 + p % 2,
                preempt_within_queue="lower_priority",
                reclaim_within_cohort="lower_priority",
            )
            for model in models.values():
                QueueQuota.objects.create(
                    queue=queue,
                    gpu_model=model,
                    gpus=nodes * 8 // 8 // 4 * (1 + q),
                    borrowing_limit=None if p else nodes // 2,
                )
            queues.append(queue)
    now = timezone.now()
    shapes = []
    rows = []
    for j in range(jobs):
        queue = queues[j % len(queues)]
        model = MODELS[random.randrange(len(MODELS))]
        if random.random() < 0.02:
            n_nodes, gpus = random.choice([2, 4, 8, 16]), 8
        else:
            n_nodes, gpus = 1, random.choice([1, 1, 2, 2, 4, 8])
        shapes.append((model, n_nodes, gpus))
        rows.append(
            Job(
                owner=user,
                project_id=queue.project_id,
                queue=queue,
                name=f"j{j}",
                state="PENDING",
                priority=random.choice([0, 0, 0, 100]),
                nodes=n_nodes,
                gpu_model=models[model],
                gpus_per_node=gpus,
                cpu_millicores_per_node=4000 * gpus,
                memory_bytes_per_node=2**33 * gpus,
                time_limit_s=random.choice(LIMITS),
                submitted_at=now,
            )
        )
    Job.objects.bulk_create(rows, batch_size=10_000)
    return {"node_model": node_model, "shapes": shapes}


def run(workload: dict, say, per_cycle: int) -> dict:
    from django.conf import settings

    from scheduling.engine import policies
    from scheduling.engine.cache import SchedulerCache
    from scheduling.engine.cycle import run_cycle

    if PROFILE_OVERRIDE:
        settings.ORRERY_SCHEDULER_PROFILE = PROFILE_OVERRIDE
        policies._profile = None

    cache = SchedulerCache()
    started = time.perf_counter()
    cache.rebuild()
    build_ms = (time.perf_counter() - started) * 1000
    say(f"cache built in {build_ms:.0f} ms; {len(cache.queue)} pending in {len(cache.queue.classes)} classes")
    cycles, placed = [], 0
    while True:
        started = time.perf_counter()
        report = run_cycle(cache, limit=per_cycle)
        elapsed = time.perf_counter() - started
        if not report.placed:
            break
        cycles.append(elapsed * 1000)
        placed += report.placed
        say(f"cycle: placed {report.placed} in {elapsed * 1000:.0f} ms {report.phases_ms}")
    preempted = 0
    for _ in range(200):  # preemptions settle (each cycle preempts at most 16 jobs' victims)
        report = run_cycle(cache)
        preempted += report.preempted
        if not report.preempted:
            break
    say(f"preempted {preempted} jobs before the fleet settled")
    idle = []
    for _ in range(5):
        started = time.perf_counter()
        report = run_cycle(cache)
        idle.append((time.perf_counter() - started) * 1000)
    say(f"no-capacity cycles: {[round(x, 1) for x in idle]} ms, {report.pending} pending")
    return {
        "placed": placed,
        "cycles": len(cycles),
        "placements_per_s": round(placed / (sum(cycles) / 1000)) if cycles else 0,
        "cycle_ms_p50": round(statistics.median(cycles), 1) if cycles else None,
        "cycle_ms_p99": round(max(cycles), 1) if cycles else None,
        "no_capacity_cycle_ms": round(statistics.median(idle), 1),
        "preempted": preempted,
        "reservations": report.reserved,
        "pending_after": report.pending,
        "cache_build_ms": round(build_ms),
        "invariants_ok": check_invariants(),
    }


def check_invariants() -> bool:
    from django.db import connection

    checks = {
        "gpu held twice": "SELECT count(*) FROM (SELECT gpu_id FROM scheduling_allocation WHERE active AND gpu_id IS NOT NULL GROUP BY gpu_id HAVING count(*) > 1) x",
        "cpu or memory overcommitted": """
            SELECT count(*) FROM (SELECT a.node_id FROM scheduling_allocation a JOIN clusters_node n ON n.id = a.node_id
            WHERE a.active GROUP BY a.node_id, n.cpu_millicores_allocatable, n.memory_bytes_allocatable
            HAVING sum(a.cpu_millicores) > n.cpu_millicores_allocatable OR sum(a.memory_bytes) > n.memory_bytes_allocatable) x""",
        "gang split or partial": """
            SELECT count(*) FROM scheduling_job j WHERE j.state = 'SCHEDULED' AND (
              (SELECT count(*) FROM scheduling_allocation a WHERE a.job_id = j.id AND a.active AND a.gpu_id IS NULL) <> j.nodes
              OR (SELECT count(*) FROM scheduling_allocation a WHERE a.job_id = j.id AND a.active AND a.gpu_id IS NOT NULL) <> j.nodes * j.gpus_per_node
              OR (SELECT count(DISTINCT n.cluster_id) FROM scheduling_allocation a JOIN clusters_node n ON n.id = a.node_id WHERE a.job_id = j.id AND a.active) <> 1)""",
        "model mismatch": """
            SELECT count(*) FROM scheduling_allocation a JOIN clusters_gpudevice d ON d.id = a.gpu_id JOIN scheduling_job j ON j.id = a.job_id
            WHERE a.active AND d.model_id <> j.gpu_model_id""",
        "quota past nominal plus cohort": """
            SELECT count(*) FROM (SELECT j.queue_id, d.model_id, count(*) AS used FROM scheduling_allocation a
              JOIN scheduling_job j ON j.id = a.job_id JOIN clusters_gpudevice d ON d.id = a.gpu_id WHERE a.active
              GROUP BY j.queue_id, d.model_id) u
            JOIN scheduling_queuequota q ON q.queue_id = u.queue_id AND q.gpu_model_id = u.model_id
            WHERE u.used > q.gpus + COALESCE(q.borrowing_limit, (SELECT sum(gpus) FROM scheduling_queuequota o WHERE o.gpu_model_id = u.model_id))""",
    }
    ok = True
    with connection.cursor() as cursor:
        for name, sql in checks.items():
            cursor.execute(sql)
            bad = cursor.fetchone()[0]
            if bad:
                print(f"invariant broken: {name}: {bad}", file=sys.stderr)
                ok = False
    return ok


def bare_numpy(workload: dict) -> int:
    """Best fit with no framework and no database: the same jobs, in the same order."""
    model_of = {m: i for i, m in enumerate(MODELS)}
    node_model = np.array([model_of[m] for m in workload["node_model"]])
    free = np.full(len(node_model), 8, dtype=np.int32)
    placed = 0
    started = time.perf_counter()
    for model, nodes, gpus in workload["shapes"]:
        fits = np.flatnonzero((node_model == model_of[model]) & (free >= gpus))
        if len(fits) < nodes:
            continue
        best = fits[np.argsort(free[fits], kind="stable")[:nodes]]
        free[best] -= gpus
        placed += 1
    return round(placed / (time.perf_counter() - started))


if __name__ == "__main__":
    main()
