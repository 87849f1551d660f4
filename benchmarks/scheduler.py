#!/usr/bin/env python
"""Scheduler benchmark: decisions and their durable commit, end to end, at fleet scale.

    python benchmarks/scheduler.py --nodes 10000 --jobs 100000 --json

A throwaway PostgreSQL database gets 10,000 nodes in 4 clusters (8 GPUs each, mixed models)
and 100,000 pending jobs (1/2/4/8 GPUs, some 2–16-node gangs) in several projects and queues
with quotas and a cohort. Then cycles run until nothing more fits. Reported:

* ``placements_per_s`` — placed jobs / wall time of the cycles that placed them (sync, decide,
  one-transaction commit with COPY);
* ``cycle_ms_p50``/``cycle_ms_p99`` over those cycles, and ``placing_phases_ms``: their time
  per phase, summed;
* ``no_capacity_cycle_ms`` — a cycle over the full fleet with everything left pending, in the
  steady state: after the cycles that first tell the waiting jobs why (``EXPLAIN_BUDGET`` rows
  a cycle), whose median is ``no_capacity_telling_ms``;
* ``cache_build_ms`` — building the cache from the database (once per process);
* ``preempted``, ``reservations`` — with ``--policies on`` (the default profile: backfill and
  preemption; every queue may preempt lower priorities and reclaim lent quota), the jobs
  preempted once the fleet was full and the reservations the last cycle held; ``--policies
  off`` leaves both plugins out, for the same run's comparison (``benchmarks/policies.py``);
* ``rss_mb``; ``invariants_ok`` (checked in the database afterwards);
* ``limit_placements_per_s`` — as many jobs of the same mix of shapes (drawn apart, so every
  mode gets the same list) through a bare numpy best-fit loop, no framework, no database: the
  yardstick (the median of three passes).

``--fine-grained on`` makes the fleet and the workload fine-grained: in each cluster a quarter of
the nodes have their GPUs in MIG mode (GPUs 0–3 as seven 1g instances, GPUs 4–7 as 3g + 2g + 1g;
on the quarter whose model has MIG — not l40s-48g), another quarter's GPUs are shareable, and
every GPU reports fresh telemetry averages (utilisation, memory, temperature; a tenth of the
nodes hot) and every cluster an energy price and carbon intensity. 15 % of the jobs ask for
1–2 MIG instances of a profile their model has (``gpu_slice``), 15 % for a fraction of a
shareable GPU (``gpu_memory_mb`` 10–40 GiB, or ``gpu_share`` ¼ or ½). The profile adds
``load_aware`` and ``energy`` (weight 1 each). The invariants checked afterwards add: no MIG
instance held twice, each under the GPU its allocation names and of the job's profile; no
shareable GPU's memory handed out past its ``memory_mb``; no fraction of a GPU that is not
shareable; no GPU held whole while any fraction of it is held; no MIG-mode GPU held whole.
The yardstick times the same list of whole-GPU jobs on the same whole fleet in both modes (its
rate depends on how many of its jobs fit, so it must not follow the workload's mix).

``--fine-grained compare`` runs the benchmark twice, each in a fresh process and database —
``off`` (today's profile, the plain workload) and ``on`` — and prints both with their
placements per second as ratios to their own yardstick, and fine-grained ÷ plain of those ratios.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import random
import resource
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODELS = ["h100-80g", "a100-80g", "h200-141g", "l40s-48g"]
LIMITS = [3600, 4 * 3600, 12 * 3600, 24 * 3600]  # time limits users pick: backfill's timeline reads them
PROFILE_OVERRIDE: dict = {}
# MIG layouts per model: GPUs 0–3 all of the smallest profile, GPUs 4–7 one each of three.
MIG_LAYOUTS = {
    "h100-80g": (["1g.10gb"] * 7, ["3g.40gb", "2g.20gb", "1g.10gb"]),
    "a100-80g": (["1g.10gb"] * 7, ["3g.40gb", "2g.20gb", "1g.10gb"]),
    "h200-141g": (["1g.18gb"] * 7, ["3g.71gb", "2g.35gb", "1g.18gb"]),
}
MIG_MEMORY = {"1g.10gb": 9856, "2g.20gb": 19968, "3g.40gb": 40192, "1g.18gb": 16384, "2g.35gb": 32768}
MIG_MEMORY |= {"3g.71gb": 71424}
FINE_GRAINED_PROFILE_EXTRA = {"load_aware": 1.0, "energy": 1.0}
# The yardstick's jobs come from a generator of their own, so every run — plain or fine-grained —
# times the same list on the same fleet: it measures the machine, not the workload.
YARDSTICK_SEED = 11


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
    parser.add_argument(
        "--fine-grained",
        choices=["on", "off", "compare"],
        default="off",
        help="MIG, shareable GPUs, telemetry and their jobs, with load_aware and energy (on); "
        "both, each in its own process (compare)",
    )
    parser.add_argument(
        "--pipeline",
        choices=["on", "off"],
        default="on",
        help="commit each cycle on a second connection while the next decides (on), or not",
    )
    parser.add_argument("--profile", metavar="PATH", help="cProfile the placing cycles into PATH (pstats)")
    parser.add_argument(
        "--profile-idle", metavar="PATH", help="cProfile the steady no-capacity cycles into PATH (pstats)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # On a shared machine one cycle's decide phase can run past the production stall bound (10 s)
    # and be cut by the database; the benchmark measures throughput, not the bound.
    os.environ.setdefault("ORRERY_SCHEDULER_STALL_S", "120")
    if args.fine_grained == "compare":
        print(json.dumps(compare(args), indent=None if args.json else 2))
        return
    fine = args.fine_grained == "on"
    if args.policies == "off":
        from scheduling.engine.policies import DEFAULT_PROFILE

        plugins = [p for p in DEFAULT_PROFILE["plugins"] if p not in ("backfill", "preemption")]
        PROFILE_OVERRIDE.update(DEFAULT_PROFILE | {"plugins": plugins})
    if fine:
        from scheduling.engine.policies import DEFAULT_PROFILE

        base = PROFILE_OVERRIDE or DEFAULT_PROFILE
        PROFILE_OVERRIDE.update(
            base
            | {
                "plugins": [*base["plugins"], *FINE_GRAINED_PROFILE_EXTRA],
                "weights": base["weights"] | FINE_GRAINED_PROFILE_EXTRA,
            }
        )
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    random.seed(args.seed)

    from benchmarks.throwaway import throwaway_database

    with throwaway_database("orrery_sched") as url:
        import psycopg

        say("building the fleet and the queue")
        workload = build(args.nodes, args.jobs, args.clusters, fine)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
        result = {"nodes": args.nodes, "jobs": args.jobs, "gpus": args.nodes * 8}
        result["per_cycle_limit"] = args.per_cycle
        result["policies"] = args.policies
        result["fine_grained"] = args.fine_grained
        if fine:
            result |= {k: workload[k] for k in ("mig_nodes", "shareable_nodes", "mig_instances")}
            result |= {k: workload[k] for k in ("mig_jobs", "shared_jobs")}
        result["pipeline"] = args.pipeline
        # The yardstick is sampled before, between and after the measured phases and its median
        # used, so a burst on the shared machine during one pass does not swing the ratios.
        samples = [bare_numpy(workload)]
        result.update(
            run(
                workload,
                say,
                args.per_cycle,
                fine,
                args.pipeline == "on",
                samples,
                args.profile,
                args.profile_idle,
            )
        )
        samples.append(bare_numpy(workload))
        limit = statistics.median(samples)
        result["limit_placements_per_s"] = round(limit)
        result["yardstick_samples"] = [round(x) for x in samples]
        result["placements_ratio"] = round(result["placements_per_s"] / limit, 4)
        # how many yardstick placements fit in the time of one cycle that can place nothing
        result["no_capacity_cost"] = round(result["no_capacity_cycle_ms"] * limit / 1000)
        result["rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        print(json.dumps(result, indent=None if args.json else 2))


def compare(args: argparse.Namespace) -> dict:
    """The benchmark with ``--fine-grained off`` and ``on``, each in its own process and
    database; placements per second as ratios to each run's own yardstick."""
    import subprocess

    runs = {}
    for mode in ("off", "on"):
        argv = [sys.executable, str(Path(__file__)), "--nodes", str(args.nodes), "--jobs", str(args.jobs)]
        argv += [
            "--clusters",
            str(args.clusters),
            "--seed",
            str(args.seed),
            "--per-cycle",
            str(args.per_cycle),
        ]
        argv += ["--policies", args.policies, "--fine-grained", mode, "--pipeline", args.pipeline, "--json"]
        out = subprocess.run(argv, capture_output=True, text=True, check=True, env=os.environ.copy())
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        runs[mode]["vs_yardstick"] = runs[mode]["placements_ratio"]
    return {
        "plain": runs["off"],
        "fine_grained": runs["on"],
        "fine_vs_plain_vs_yardstick": round(runs["on"]["vs_yardstick"] / runs["off"]["vs_yardstick"], 3),
        "fine_vs_plain": round(runs["on"]["placements_per_s"] / runs["off"]["placements_per_s"], 3),
    }


def build(nodes: int, jobs: int, clusters: int, fine: bool = False) -> dict:
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from clusters.models import Cluster, GpuDevice, GpuModel, Node
    from scheduling.models import Job

    models = {m.slug: m for m in GpuModel.objects.filter(slug__in=MODELS)}
    node_model: list[str] = []
    node_kind: list[str] = []  # "", "mig" or "shared"
    instances = 0
    now = timezone.now()
    for c in range(clusters):
        cluster = Cluster.objects.create(
            name=f"c{c}",
            kind="simulated",
            state="ready",
            energy_price_per_kwh=(0.08, 0.20, 0.12, 0.30)[c % 4] if fine else None,
            carbon_g_per_kwh=(60, 450, 200, 350)[c % 4] if fine else None,
        )
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
        # fine-grained: a quarter of the nodes in MIG mode (of the two residues 0 and 1 mod 4, the
        # one whose model has MIG), a quarter shareable (the other)
        mig_residue = 0 if MODELS[c % len(MODELS)] in MIG_LAYOUTS else 1
        kinds = [
            "" if not fine or i % 4 > 1 else ("mig" if i % 4 == mig_residue else "shared") for i in range(per)
        ]
        node_kind.extend(kinds)
        devices = GpuDevice.objects.bulk_create(
            (
                GpuDevice(
                    node=n,
                    index=g,
                    model=models[node_model[len(node_model) - per + i]],
                    memory_mb=models[node_model[len(node_model) - per + i]].memory_mb if fine else 1,
                    topology_group=f"nvl{g // 4}",
                    mig_enabled=kinds[i] == "mig",
                    shareable=kinds[i] == "shared",
                    **(telemetry(i, g, now) if fine else {}),
                )
                for i, n in enumerate(rows)
                for g in range(8)
            ),
            batch_size=10_000,
        )
        if fine:
            instances += mig_instances(devices)
    user = get_user_model().objects.create_user("bench", password="x")
    queues = quota_queues(models, nodes)
    rows = []
    counts = {"mig_jobs": 0, "shared_jobs": 0}
    for j in range(jobs):
        queue = queues[j % len(queues)]
        model, n_nodes, gpus = draw_shape(random)
        fraction = fine_grained_request(model) if fine else {}
        if fraction:
            n_nodes, gpus = 1, fraction.pop("gpus")
            counts["mig_jobs" if fraction.get("gpu_slice") else "shared_jobs"] += 1
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
                **fraction,
            )
        )
    Job.objects.bulk_create(rows, batch_size=10_000)
    return {
        "node_model": node_model,
        "node_kind": node_kind,
        "shapes": yardstick_shapes(jobs),
        "mig_nodes": node_kind.count("mig"),
        "shareable_nodes": node_kind.count("shared"),
        "mig_instances": instances,
        **counts,
    }


def quota_queues(models: dict, nodes: int) -> list:
    """4 projects × 2 queues in one cohort, each with a quota per GPU model sized to ``nodes``;
    the queues the scheduler and scale benchmarks fill, in submission order."""
    from portal.models import Project
    from scheduling.models import Queue, QueueQuota

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
    return queues


def draw_shape(rng: Any) -> tuple[str, int, int]:
    """One job's model, nodes and GPUs per node, drawn from ``rng`` (``random`` or a
    ``random.Random``): 2 % are 2–16-node gangs of 8 GPUs, the rest 1, 2, 4 or 8 GPUs."""
    model = MODELS[rng.randrange(len(MODELS))]
    if rng.random() < 0.02:
        return model, rng.choice([2, 4, 8, 16]), 8
    return model, 1, rng.choice([1, 1, 2, 2, 4, 8])


def yardstick_shapes(jobs: int) -> list[tuple[str, int, int]]:
    rng = random.Random(YARDSTICK_SEED)
    return [draw_shape(rng) for _ in range(jobs)]


def telemetry(node: int, gpu: int, now: datetime) -> dict:
    """Fresh averages for one GPU: a tenth of the nodes run hot, the rest spread out."""
    hot = node % 10 == 3
    return {
        "utilization_avg": 95.0 if hot else float(random.randrange(0, 90)),
        "memory_used_avg_mb": float(random.randrange(0, 60_000)),
        "temperature_avg_c": 90.0 if hot else float(random.randrange(35, 80)),
        "telemetry_at": now,
    }


def mig_instances(devices: list) -> int:
    """The MIG layout of every GPU in MIG mode (``MIG_LAYOUTS``); returns how many instances."""
    from clusters.models import MigInstance

    rows = [
        MigInstance(gpu=d, slot=slot, profile=profile, memory_mb=MIG_MEMORY[profile], slices=int(profile[0]))
        for d in devices
        if d.mig_enabled
        for slot, profile in enumerate(MIG_LAYOUTS[d.model.slug][0 if d.index < 4 else 1])
    ]
    MigInstance.objects.bulk_create(rows, batch_size=10_000)
    return len(rows)


def fine_grained_request(model: str) -> dict:
    """15 % of jobs ask for MIG instances (of a profile their model has), 15 % for a fraction
    of a shareable GPU; {} for the rest. ``gpus`` is per node: instances, or 1 for a fraction."""
    draw = random.random()
    if draw < 0.15 and model in MIG_LAYOUTS:
        profiles = sorted(set(MIG_LAYOUTS[model][1]))
        return {"gpus": random.choice([1, 1, 2]), "gpu_slice": random.choice(profiles)}
    if draw < 0.30:
        if random.random() < 0.5:
            return {"gpus": 1, "gpu_memory_mb": random.choice([10_240, 20_480, 40_960])}
        return {"gpus": 1, "gpu_share": random.choice([0.25, 0.5])}
    return {}


def run(
    workload: dict,
    say,
    per_cycle: int,
    fine: bool,
    pipelined: bool,
    yardstick: list[float],
    profile: str | None = None,
    profile_idle: str | None = None,
) -> dict:
    """Cycles until nothing more fits, then until preemptions settle, then idle ones; a yardstick
    sample is appended to ``yardstick`` between the placing cycles and the rest."""
    from django.conf import settings

    from scheduling.engine import policies
    from scheduling.engine.cache import SchedulerCache
    from scheduling.engine.cycle import CyclePipeline, run_cycle

    if PROFILE_OVERRIDE:
        settings.ORRERY_SCHEDULER_PROFILE = PROFILE_OVERRIDE
        policies._profile = None

    cache = SchedulerCache()
    started = time.perf_counter()
    cache.rebuild()
    build_ms = (time.perf_counter() - started) * 1000
    say(f"cache built in {build_ms:.0f} ms; {len(cache.queue)} pending in {len(cache.queue.classes)} classes")
    cycles, reports = [], []
    pipeline = CyclePipeline(cache, limit=per_cycle) if pipelined else None
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    began = time.perf_counter()
    while True:
        started = time.perf_counter()
        report = pipeline.run() if pipeline else run_cycle(cache, limit=per_cycle, pipelined=False)
        elapsed = time.perf_counter() - started
        if not report.placed:
            break
        cycles.append(elapsed * 1000)
        reports.append(report)
        say(f"cycle: decided {report.placed} in {elapsed * 1000:.0f} ms {report.phases_ms}")
    if pipeline:
        pipeline.drain()
        # pipelined: wall time from the first cycle until the last placing cycle's commit landed
        placing_s = max(r.landed_at for r in reports) - began if reports else 0.0
    else:
        placing_s = sum(cycles) / 1000
    if profiler:
        profiler.disable()
        profiler.dump_stats(profile)
    placed = sum(r.placed for r in reports)  # what committed
    phases: dict[str, float] = {}  # per phase, ms over the placing cycles
    for r in reports:
        for phase, ms in r.phases_ms.items():
            phases[phase] = round(phases.get(phase, 0.0) + ms, 1)
    yardstick.append(bare_numpy(workload))
    if placing_s:
        ratio = placed / placing_s / statistics.median(yardstick)
        say(f"placed {placed} at {placed / placing_s:.0f}/s; yardstick so far {yardstick}: ratio {ratio:.4f}")
    preempted = 0
    for _ in range(200):  # preemptions settle (each cycle preempts at most 16 jobs' victims)
        report = run_cycle(cache, pipelined=pipelined)
        preempted += report.preempted
        if not report.preempted:
            break
    say(f"preempted {preempted} jobs before the fleet settled")
    # The first no-capacity cycles tell the waiting jobs why, EXPLAIN_BUDGET rows a cycle: a
    # transient, timed apart; the figure is the steady state that follows.
    telling = []
    for _ in range(-(-report.pending // settings.ORRERY_SCHEDULER_EXPLAIN_BUDGET) + 1):
        started = time.perf_counter()
        report = run_cycle(cache, pipelined=pipelined)
        telling.append((time.perf_counter() - started) * 1000)
    say(
        f"{len(telling)} cycles telling {report.pending} waiting jobs why: median {statistics.median(telling):.1f} ms"
    )
    idle = []
    profiler = cProfile.Profile() if profile_idle else None
    for _ in range(5):
        started = time.perf_counter()
        if profiler:
            profiler.enable()
        report = run_cycle(cache, pipelined=pipelined)
        if profiler:
            profiler.disable()
        idle.append((time.perf_counter() - started) * 1000)
    if profiler:
        profiler.dump_stats(profile_idle)
    say(f"no-capacity cycles: {[round(x, 1) for x in idle]} ms, {report.pending} pending")
    return {
        "placed": placed,
        "cycles": len(cycles),
        "placements_per_s": round(placed / placing_s) if cycles else 0,
        "cycle_ms_p50": round(statistics.median(cycles), 1) if cycles else None,
        "cycle_ms_p99": round(max(cycles), 1) if cycles else None,
        "placing_phases_ms": phases,
        "no_capacity_cycle_ms": round(statistics.median(idle), 1),
        "no_capacity_phases_ms": report.phases_ms,
        "no_capacity_telling_ms": round(statistics.median(telling), 1),
        "preempted": preempted,
        "reservations": report.reserved,
        "pending_after": report.pending,
        "cache_build_ms": round(build_ms),
        "invariants_ok": check_invariants(fine),
    }


WHOLE = "a.mig_instance_id IS NULL AND a.gpu_memory_mb = 0"  # an allocation of a whole GPU
FINE_GRAINED_CHECKS = {
    "MIG instance held twice": """
        SELECT count(*) FROM (SELECT mig_instance_id FROM scheduling_allocation WHERE active
        AND mig_instance_id IS NOT NULL GROUP BY mig_instance_id HAVING count(*) > 1) x""",
    "MIG instance not under its GPU, or of another profile": """
        SELECT count(*) FROM scheduling_allocation a JOIN clusters_miginstance m ON m.id = a.mig_instance_id
        JOIN scheduling_job j ON j.id = a.job_id WHERE a.active AND (m.gpu_id <> a.gpu_id OR m.profile <> j.gpu_slice)""",
    "shared GPU memory handed out past its size": """
        SELECT count(*) FROM (SELECT a.gpu_id FROM scheduling_allocation a JOIN clusters_gpudevice d ON d.id = a.gpu_id
        WHERE a.active AND a.gpu_memory_mb > 0 GROUP BY a.gpu_id, d.memory_mb HAVING sum(a.gpu_memory_mb) > d.memory_mb) x""",
    "a fraction of a GPU that is not shareable": """
        SELECT count(*) FROM scheduling_allocation a JOIN clusters_gpudevice d ON d.id = a.gpu_id
        WHERE a.active AND a.gpu_memory_mb > 0 AND NOT d.shareable""",
    "GPU held whole while a fraction of it is held": f"""
        SELECT count(*) FROM (SELECT a.gpu_id FROM scheduling_allocation a WHERE a.active AND a.gpu_id IS NOT NULL
        GROUP BY a.gpu_id HAVING bool_or({WHOLE}) AND bool_or(NOT ({WHOLE}))) x""",
    "MIG-mode GPU held whole": f"""
        SELECT count(*) FROM scheduling_allocation a JOIN clusters_gpudevice d ON d.id = a.gpu_id
        WHERE a.active AND d.mig_enabled AND {WHOLE}""",
}


def check_invariants(fine: bool = False) -> bool:
    from django.db import connection

    checks = {
        "gpu held twice": f"SELECT count(*) FROM (SELECT gpu_id FROM scheduling_allocation a WHERE active AND gpu_id IS NOT NULL AND {WHOLE} GROUP BY gpu_id HAVING count(*) > 1) x",
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
    if fine:
        checks |= FINE_GRAINED_CHECKS
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
    """Best fit with no framework and no database: as many whole-GPU jobs as the workload has,
    of its shapes' mix but drawn by a generator of their own (``YARDSTICK_SEED``), on every node's
    8 GPUs — the same list in every mode, so the yardstick measures the machine."""
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
