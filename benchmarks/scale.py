#!/usr/bin/env python
"""Fleet-scale benchmark: 100,000 nodes reporting, aggregated and scheduled on, in one run.

    python benchmarks/scale.py --nodes 100000 --jobs 1000000 --json     # ~12 minutes

A throwaway PostgreSQL database gets the fleet (100,000 nodes of 8 GPUs in 20 clusters, two GPU
models per cluster) and the queue (1,000,000 pending jobs of ``benchmarks/scheduler.py``'s mix in
4 projects × 2 queues with quotas and a cohort), written with ``COPY`` into staging tables and
one ``INSERT … SELECT`` each that takes every other column from a row the ORM made. Then:

1. **ingest and flush** — the production processes, 2 + 2: gunicorn with ``--web-workers`` (2)
   workers × 4 threads, and a Celery worker with ``--worker-processes`` (2) consuming the ingest
   queue, to which this process sends ``flush_heartbeats_task`` every 2 s as beat would. Load
   generators post every node's report once per ``--interval`` (10 s) in 1,000-node batches,
   for ``--rounds`` rounds. Reported: ``ingest_records_per_s`` (accepted over the phase),
   ``ingest_round_s`` (wall time to post one round of the whole fleet; the fleet keeps up while
   it is below the interval), ``ingest_ceiling_records_per_s`` (nodes ÷ that time: the rate the
   same processes reach posting back to back), the flushes' durations as Celery logged them
   (``flush_steady_*``: the passes after every node's first report, which rewrites every Node
   row), CPU seconds per 1,000 records of the web and worker processes (what carries over from
   a busy machine), ``redis_buffer_mb``, ``lost_reports`` (the database must hold every node's
   last accepted report), RSS per process;
2. **scheduling** — a separate process (no Redis, as ``benchmarks/scheduler.py`` runs) builds
   the scheduler's cache over the whole fleet and queue and runs cycles of ``--per-cycle``
   placements until the fleet is full or ``--cycle-budget-s`` has passed: ``placements_per_s``,
   ``cycle_ms_p50``/``p99``, ``no_capacity_cycle_ms`` (once full), ``aborted_cycles`` (rolled
   back past ``ORRERY_SCHEDULER_STALL_S``), ``cache_build_ms``, RSS. Without ``--json`` one more
   cycle runs under cProfile and its profile goes to stderr;
3. **the yardstick** — ``benchmarks/scheduler.py``'s bare numpy best-fit loop over this fleet
   (``--yardstick-jobs`` whole-GPU jobs of the same mix: the loop costs one pass over 100,000
   nodes a job, so a million would take minutes), sampled before ingest, between the phases
   and after scheduling; ``placements_ratio`` is placements per second ÷ its median.

Nothing here is asserted; figures go in docs/scaling.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.heartbeats import (  # noqa: E402
    free_port,
    gpu_report,
    percentile,
    post_agent,
    process_cpu_seconds,
    server_pids,
    stop_process,
    wait_for_port,
)
from benchmarks.scheduler import (  # noqa: E402
    LIMITS,
    MODELS,
    bare_numpy,
    draw_shape,
    quota_queues,
    yardstick_shapes,
)

# Celery's own line for each task it ran: when it ended, how long it took, what it returned
FLUSH_LINE = re.compile(
    r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}):[^\]]*\] Task clusters\.tasks\.flush_heartbeats_task"
    r"\[[^\]]+\] succeeded in ([0-9.]+)s: (\d+)"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100_000)
    parser.add_argument("--clusters", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between a node's reports")
    parser.add_argument("--rounds", type=int, default=3, help="reports per node in the ingest phase")
    parser.add_argument("--flush-every", type=float, default=2.0)
    parser.add_argument("--web-workers", type=int, default=2)
    parser.add_argument("--worker-processes", type=int, default=2)
    parser.add_argument("--clients", type=int, default=2, help="load-generator processes")
    # A cycle must end well inside ORRERY_SCHEDULER_STALL_S (10 s) or it is rolled back; over
    # 100,000 nodes on the busy reference machine 5,000 placements took 11 s, 1,000 took 3–11 s.
    parser.add_argument("--per-cycle", type=int, default=2500)
    parser.add_argument("--cycle-budget-s", type=float, default=180.0)
    parser.add_argument("--yardstick-jobs", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--port", type=int, default=0, help="gunicorn's port (0: a free one)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--scheduler-phase", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--progress", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    quiet = args.json and not args.progress
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    if args.scheduler_phase:
        import django

        django.setup()
        print(json.dumps(schedule(args.per_cycle, args.cycle_budget_s, say, args.progress)))
        return

    base_url = os.environ.get("DATABASE_URL", "postgres://postgres:postgres@127.0.0.1:5432/postgres")
    db_name = f"orrery_scale_{os.getpid()}"
    server_url = base_url.rsplit("/", 1)[0]
    tag = f"orrery-scale-{os.getpid()}"
    env = {
        **os.environ,
        "DATABASE_URL": f"{server_url}/{db_name}",
        "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        "ORRERY_REDIS_PREFIX": f"{tag}:",
        "ORRERY_CELERY_QUEUE": tag,  # this run's queues only: a shared Redis may hold others
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "ORRERY_LOG_LEVEL": "WARNING",
        "ORRERY_SCHEDULER_RESYNC_S": "3600",
    }
    os.environ.update(env)
    import psycopg

    from benchmarks.throwaway import create_database, drop_database

    admin = f"{server_url}/postgres"
    create_database(admin, db_name)
    processes: list[subprocess.Popen] = []
    try:
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        random.seed(args.seed)
        started = time.perf_counter()
        fleet = build_fleet(args.nodes, args.clusters)
        say(f"fleet of {args.nodes} nodes in {time.perf_counter() - started:.0f} s")
        started = time.perf_counter()
        build_queue(args.jobs, args.nodes)
        jobs_s = time.perf_counter() - started
        say(f"{args.jobs} pending jobs in {jobs_s:.0f} s")
        with psycopg.connect(env["DATABASE_URL"], autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
        result: dict = {
            "nodes": args.nodes,
            "clusters": args.clusters,
            "gpus": args.nodes * 8,
            "jobs": args.jobs,
            "jobs_copy_s": round(jobs_s, 1),
            "web": f"gunicorn gthread {args.web_workers}x4",
            "workers": f"celery prefork x{args.worker_processes}",
            "per_cycle_limit": args.per_cycle,
        }
        yardstick = {"node_model": fleet["node_model"], "shapes": yardstick_shapes(args.yardstick_jobs)}
        samples = [bare_numpy(yardstick)]
        say(f"yardstick {samples[-1]}/s")

        say("phase 1: the fleet reports, the workers flush")
        result.update(ingest(args, env, fleet, processes, say))
        samples.append(bare_numpy(yardstick))
        say(f"yardstick {samples[-1]}/s")

        say("phase 2: scheduling over the whole fleet and queue")
        scheduler_env = {k: v for k, v in env.items() if k != "REDIS_URL"}
        argv = [sys.executable, str(Path(__file__)), "--scheduler-phase", "--json"]
        argv += ["--per-cycle", str(args.per_cycle), "--cycle-budget-s", str(args.cycle_budget_s)]
        argv += [] if args.json else ["--progress"]
        out = subprocess.run(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if args.json else None,
            text=True,
            env=scheduler_env,
            cwd=ROOT,
        )
        if out.returncode:
            raise SystemExit(f"the scheduler phase failed:\n{(out.stderr or '')[-4000:]}")
        result.update(json.loads(out.stdout.strip().splitlines()[-1]))
        samples.append(bare_numpy(yardstick))
        say(f"yardstick {samples[-1]}/s")

        limit = statistics.median(samples)
        result["limit_placements_per_s"] = round(limit)
        result["limit_samples"] = samples
        result["placements_ratio"] = round(result["placements_per_s"] / limit, 4)
        result["rss_mb_build"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        print(json.dumps(result, indent=None if args.json else 2))
    finally:
        for process in processes:
            stop_process(process, 20)
        forget_redis(env["REDIS_URL"], tag)
        drop_database(admin, db_name)


# --- the fleet and the queue, by COPY -----------------------------------------------------------


def copy_like(model, template_id: int, varying: list[tuple[str, str]], rows: Iterable[tuple]) -> None:
    """Insert ``rows`` of ``model``'s table: the ``varying`` columns (name, SQL type) from the
    rows, COPYed into a staging table, every other column from the row ``template_id``, which
    is then deleted. The ORM makes the template, so defaults stay the model's."""
    from django.db import connection

    table = model._meta.db_table
    names = [name for name, _ in varying]
    others = [f.column for f in model._meta.concrete_fields if not f.primary_key and f.column not in names]
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE TEMP TABLE stage ({', '.join(f'{n} {t}' for n, t in varying)})")
        with cursor.cursor.copy(f"COPY stage ({', '.join(names)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
        cursor.execute(
            f"INSERT INTO {table} ({', '.join(others + names)}) "
            f"SELECT {', '.join(f't.{c}' for c in others)}, {', '.join(f's.{n}' for n in names)} "
            f"FROM stage s CROSS JOIN (SELECT * FROM {table} WHERE id = %s) t",
            [template_id],
        )
        cursor.execute(f"DELETE FROM {table} WHERE id = %s", [template_id])
        cursor.execute("DROP TABLE stage")


def build_fleet(nodes: int, clusters: int) -> dict:
    """Clusters, nodes (two models per cluster, half the nodes each), GPUs, last-seen rows and a
    collector credential per cluster."""
    from django.db import connection
    from django.utils import timezone

    from clusters.choices import ClusterKind, ClusterState, NodeState
    from clusters.models import Cluster, GpuDevice, GpuModel, Node, NodeLastSeen
    from clusters.services.credentials import issue_cluster_credential

    models = {m.slug: m for m in GpuModel.objects.filter(slug__in=MODELS)}
    made = [
        Cluster.objects.create(name=f"c{c}", kind=ClusterKind.SIMULATED, state=ClusterState.READY)
        for c in range(clusters)
    ]
    template = Node.objects.create(
        cluster=made[0],
        name="template",
        state=NodeState.READY,
        gpu_capacity=8,
        cpu_millicores_capacity=128_000,
        cpu_millicores_allocatable=128_000,
        memory_bytes_capacity=2**40,
        memory_bytes_allocatable=2**40,
    )
    per = nodes // clusters
    names = [(cluster.pk, f"c{c}-n{i:06d}") for c, cluster in enumerate(made) for i in range(per)]
    copy_like(Node, template.pk, [("cluster_id", "bigint"), ("name", "text")], names)
    ids = {name: pk for pk, name in Node.objects.values_list("pk", "name")}
    node_model = [MODELS[(c + (i % 2)) % len(MODELS)] for c in range(clusters) for i in range(per)]
    gpu = GpuDevice.objects.create(
        node=Node.objects.get(name="c0-n000000"), index=99, model=models[MODELS[0]]
    )
    copy_like(
        GpuDevice,
        gpu.pk,
        [("node_id", "bigint"), ("index", "int"), ("model_id", "bigint"), ("memory_mb", "int")],
        (
            (ids[name], g, models[model].pk, models[model].memory_mb)
            for (_, name), model in zip(names, node_model, strict=True)
            for g in range(8)
        ),
    )
    now = timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {NodeLastSeen._meta.db_table} (node_id, seen_at, good_since, boot_id, seq, fingerprint) "
            "SELECT id, %s, %s, '', 0, '' FROM clusters_node",
            [now, now],
        )
    by_cluster: dict[int, list[tuple[int, str]]] = {}
    for cluster_id, name in names:
        by_cluster.setdefault(cluster_id, []).append((ids[name], name))
    return {
        "clusters": [
            (c.name, issue_cluster_credential(c)[1], by_cluster[c.pk]) for c in made if c.pk in by_cluster
        ],
        "node_model": node_model,
    }


def build_queue(jobs: int, nodes: int) -> None:
    """``jobs`` pending jobs of ``benchmarks/scheduler.py``'s mix, quotas as it sets them."""
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from clusters.models import GpuModel
    from scheduling.models import Job

    models = {m.slug: m for m in GpuModel.objects.filter(slug__in=MODELS)}
    user = get_user_model().objects.create_user("bench", password="x")
    queues = quota_queues(models, nodes)
    template = Job.objects.create(
        owner=user,
        project_id=queues[0].project_id,
        queue=queues[0],
        name="template",
        state="PENDING",
        nodes=1,
        gpu_model=models[MODELS[0]],
        gpus_per_node=1,
        submitted_at=timezone.now(),
    )

    def rows():
        for j in range(jobs):
            queue = queues[j % len(queues)]
            model, n_nodes, gpus = draw_shape(random)
            yield (
                queue.project_id,
                queue.pk,
                f"j{j}",
                random.choice((0, 0, 0, 100)),
                n_nodes,
                models[model].pk,
                gpus,
                4000 * gpus,
                2**33 * gpus,
                random.choice(LIMITS),
            )

    varying = [("project_id", "bigint"), ("queue_id", "bigint"), ("name", "text"), ("priority", "int")]
    varying += [("nodes", "int"), ("gpu_model_id", "bigint"), ("gpus_per_node", "int")]
    varying += [("cpu_millicores_per_node", "int"), ("memory_bytes_per_node", "bigint")]
    varying += [("time_limit_s", "int")]
    copy_like(Job, template.pk, varying, rows())


# --- phase 1: ingest and flush ------------------------------------------------------------------


def post_rounds(
    port: int, batches: list[tuple[str, str, list[tuple[int, str]]]], rounds: int, interval: float, t0: float
) -> dict:
    """Post every batch once per round, round k starting at ``t0 + k × interval``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    boot = uuid.uuid4().hex
    accepted, errors, round_s, last = 0, 0, [], {}
    for seq in range(1, rounds + 1):
        time.sleep(max(0.0, t0 + (seq - 1) * interval - time.time()))
        started = time.time()
        gpus = gpu_report(8, seq)  # the same for every node of the round: the generator stays cheap
        for cluster, credential, nodes in batches:
            body = orjson.dumps(
                {
                    "cluster": cluster,
                    "nodes": [
                        {"node": name, "boot_id": boot, "seq": seq, "cpu": 0.4, "memory": 2**34, "gpus": gpus}
                        for _, name in nodes
                    ],
                }
            )
            conn, status, answer = post_agent(conn, "/api/v1/agent/report", body, credential)
            if status is None:
                errors += 1
                continue
            if status == 200 and answer["accepted"] == len(nodes):
                accepted += len(nodes)
                last.update({node_id: seq for node_id, _ in nodes})
            else:
                errors += 1
        round_s.append(time.time() - started)
    return {"accepted": accepted, "errors": errors, "round_s": round_s, "last": last}


def ingest(args, env: dict, fleet: dict, processes: list, say) -> dict:
    from clusters.models import NodeLastSeen
    from clusters.tasks import flush_heartbeats_task

    log = Path(tempfile.mkdtemp(prefix="orrery-scale-")) / "worker.log"
    args.port = args.port or free_port()
    gunicorn = [
        sys.executable,
        "-m",
        "gunicorn",
        "portal.wsgi:application",
        "--bind",
        f"127.0.0.1:{args.port}",
    ]
    gunicorn += ["--workers", str(args.web_workers), "--worker-class", "gthread", "--threads", "4"]
    web = subprocess.Popen(
        [*gunicorn, "--log-level", "warning", "--keep-alive", "30"],
        cwd=ROOT,
        env=env,
    )
    processes.append(web)
    with log.open("w") as sink:
        celery = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "portal",
            "worker",
            "-Q",
            f"{env['ORRERY_CELERY_QUEUE']}.ingest",
        ]
        celery += [
            "--concurrency",
            str(args.worker_processes),
            "--loglevel",
            "INFO",
            "-n",
            f"scale{os.getpid()}@%h",
        ]
        worker = subprocess.Popen(
            [*celery, "--without-gossip", "--without-mingle", "--without-heartbeat"],
            cwd=ROOT,
            env=env | {"ORRERY_LOG_LEVEL": "INFO"},
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    processes.append(worker)
    wait_for_port(args.port)
    end = time.monotonic() + 60
    while "ready." not in log.read_text() and time.monotonic() < end:  # the worker's pool is up
        time.sleep(0.5)
    if web.poll() is not None:
        raise SystemExit(f"gunicorn exited ({web.returncode})")  # the Celery worker's pool starts
    batches = [
        (cluster, credential, nodes[i : i + 1000])
        for cluster, credential, nodes in fleet["clusters"]
        for i in range(0, len(nodes), 1000)
    ]
    shares = [batches[i :: args.clients] for i in range(args.clients)]
    web_pids, worker_pids = server_pids(web.pid), server_pids(worker.pid)
    cpu = {"web": process_cpu_seconds(web_pids), "workers": process_cpu_seconds(worker_pids)}
    load = [os.getloadavg()[0]]
    t0 = time.time() + 1.0
    with mp.get_context("fork").Pool(args.clients) as pool:
        pending = pool.starmap_async(
            post_rounds, [(args.port, share, args.rounds, args.interval, t0) for share in shares]
        )
        tick = t0
        while not pending.ready():  # beat's part: a flush every 2 s
            flush_heartbeats_task.apply_async(expires=args.flush_every)
            tick += args.flush_every
            pending.wait(max(0.0, tick - time.time()))
        outcomes = pending.get()
    ended = time.time()
    for _ in range(3):  # the last reports flushed
        flush_heartbeats_task.apply_async(expires=args.flush_every)
        time.sleep(args.flush_every)
    load.append(os.getloadavg()[0])
    buffer_mb = redis_mb(env["REDIS_URL"], f"{env['ORRERY_REDIS_PREFIX']}hb:")
    rss = {"web": rss_mb(web_pids), "workers": rss_mb(worker_pids)}
    cpu = {
        "web": process_cpu_seconds(web_pids) - cpu["web"],
        "workers": process_cpu_seconds(worker_pids) - cpu["workers"],
    }
    web.terminate()
    worker.terminate()
    web.wait(30)
    worker.wait(30)
    flushes = []  # (started, ms, nodes) of each pass that took nodes
    for at, took, nodes in FLUSH_LINE.findall(log.read_text()):
        ended = datetime.strptime(at, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if int(nodes):
            flushes.append((ended - float(took), float(took) * 1000, int(nodes)))
    shutil.rmtree(log.parent)
    busy = [ms for _, ms, _ in flushes]
    # Steady state: passes that began once every node's first report was in. The first
    # reports change every node's fingerprint (new boot, GPUs first seen), so the passes that
    # take them also write every Node row and read every GPU row, as after a fleet-wide reboot.
    first_round_in = t0 + max(o["round_s"][0] for o in outcomes)
    steady = [ms for started, ms, _ in flushes if started > first_round_in]
    last = {node: seq for o in outcomes for node, seq in o["last"].items()}
    stored = dict(NodeLastSeen.objects.values_list("node_id", "seq"))
    accepted = sum(o["accepted"] for o in outcomes)
    flushed = sum(n for _, _, n in flushes)
    rounds = [max(o["round_s"][k] for o in outcomes) for k in range(args.rounds)]
    say(f"rounds {[round(r, 2) for r in rounds]} s; flushes {[(round(ms), n) for _, ms, n in flushes]} ms")
    return {
        "offered_records_per_s": round(args.nodes / args.interval),
        "ingest_records_per_s": round(accepted / (ended - t0)),
        "ingest_errors": sum(o["errors"] for o in outcomes),
        "ingest_round_s_p50": round(statistics.median(rounds), 2),
        "ingest_round_s_max": round(max(rounds), 2),
        "ingest_ceiling_records_per_s": round(args.nodes / statistics.median(rounds)),
        "web_cpu_s_per_1000_records": round(cpu["web"] / max(accepted, 1) * 1000, 4),
        "load_average": [round(x, 1) for x in load],
        "flushes": len(busy),
        "flush_nodes_p50": round(statistics.median(n for _, _, n in flushes)) if busy else 0,
        "flush_ms_p50": round(statistics.median(busy), 1) if busy else None,
        "flush_ms_p99": round(percentile(busy, 0.99), 1) if busy else None,
        "flush_ms_max": round(max(busy), 1) if busy else None,
        "flush_steady_ms_p50": round(statistics.median(steady), 1) if steady else None,
        "flush_steady_ms_p99": round(percentile(steady, 0.99), 1) if steady else None,
        "flush_nodes_per_s": round(flushed / (sum(busy) / 1000)) if busy else None,
        "worker_cpu_s_per_1000_records": round(cpu["workers"] / max(flushed, 1) * 1000, 4),
        "lost_reports": sum(1 for node, seq in last.items() if stored.get(node, -1) < seq),
        "redis_buffer_mb": buffer_mb,
        "rss_mb_web": rss["web"],
        "rss_mb_workers": rss["workers"],
    }


def rss_mb(pids: list[int]) -> list[int]:
    """Each process's peak resident set (VmHWM), in MB."""
    out = []
    for pid in pids:
        try:
            line = next(
                x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM")
            )
            out.append(round(int(line.split()[1]) / 1024))
        except (OSError, StopIteration):
            pass
    return out


def redis_mb(url: str, prefix: str) -> float:
    """What the heartbeat buffer's keys hold in Redis (every field counted), in MiB."""
    import redis

    client = redis.Redis.from_url(url)
    keys = [f"{prefix}{k}" for k in ("seq", "latest", "slim", "dirty", "counters")]
    return round(sum(client.memory_usage(k, samples=0) or 0 for k in keys) / 2**20, 1)


def forget_redis(url: str, tag: str) -> None:
    """This run's buffer, broker queues and bindings out of the shared Redis."""
    import redis

    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=f"*{tag}*", count=10_000))
    if keys:
        client.delete(*keys)
    # kombu's bookkeeping for this run's queues, which name no queue in the key
    client.delete("_kombu.binding_deadlines")


# --- phase 2: scheduling (its own process) ------------------------------------------------------


def schedule(per_cycle: int, budget_s: float, say, profile: bool = False) -> dict:
    from scheduling.engine.cache import SchedulerCache
    from scheduling.engine.cycle import run_cycle

    cache = SchedulerCache()
    started = time.perf_counter()
    cache.rebuild()
    build_ms = (time.perf_counter() - started) * 1000
    rss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    say(f"cache built in {build_ms:.0f} ms; {len(cache.queue)} pending in {len(cache.queue.classes)} classes")
    cycles, placed, full, aborted = [], 0, False, 0
    phases: dict[str, float] = {}
    end = time.perf_counter() + budget_s
    while time.perf_counter() < end:
        started = time.perf_counter()
        report = run_cycle(cache, limit=per_cycle)
        elapsed = time.perf_counter() - started
        if report.aborted:  # past the stall bound: rolled back, and the cache is rebuilt
            aborted += 1
            say(f"cycle aborted ({report.aborted}) after {elapsed * 1000:.0f} ms")
            continue
        if not report.placed:
            full = True
            break
        cycles.append(elapsed * 1000)
        placed += report.placed
        for phase, ms in report.phases_ms.items():
            phases[phase] = round(phases.get(phase, 0.0) + ms, 1)
        say(f"cycle: placed {report.placed} in {elapsed * 1000:.0f} ms")
    if profile and not full:  # one more cycle, not counted, under cProfile: where a cycle's time goes
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        run_cycle(cache, limit=per_cycle)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(35)
        say(text.getvalue())
    preempted = 0
    settle_end = time.perf_counter() + budget_s / 4
    while full and time.perf_counter() < settle_end:  # preemptions settle, as in benchmarks/scheduler.py
        report = run_cycle(cache)
        preempted += report.preempted
        if not report.preempted:
            break
    idle = []
    for _ in range(3 if full else 0):
        started = time.perf_counter()
        report = run_cycle(cache)
        idle.append((time.perf_counter() - started) * 1000)
    return {
        "placed": placed,
        "fleet_full": full,
        "cycles": len(cycles),
        "placements_per_s": round(placed / (sum(cycles) / 1000)) if cycles else 0,
        "cycle_ms_p50": round(statistics.median(cycles), 1) if cycles else None,
        "cycle_ms_p99": round(percentile(cycles, 0.99), 1) if cycles else None,
        "placing_phases_ms": phases,
        "no_capacity_cycle_ms": round(statistics.median(idle), 1) if idle else None,
        "preempted": preempted,
        "aborted_cycles": aborted,
        "pending_after": len(cache.queue),
        "cache_build_ms": round(build_ms),
        "rss_mb_scheduler_built": round(rss_built),
        "rss_mb_scheduler": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


if __name__ == "__main__":
    main()
