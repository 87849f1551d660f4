#!/usr/bin/env python
"""Heartbeat pipeline benchmark: ingest (batched and per node), aggregation, detection, loss.

    python benchmarks/heartbeats.py --nodes 10000 --json

Runs against PostgreSQL and Redis (``DATABASE_URL``/``REDIS_URL``, defaults on loopback) and the
production HTTP server, gunicorn, which it starts on loopback. It creates a throwaway database,
a fleet of 4 clusters with 8 GPUs per node, and credentials (as an operator would), then:

0. a yardstick sample (again between 1 and 2, and after 2);
1. batched ingest: collector processes post 1,000-node reports as fast as they can;
2. per-node ingest: client processes post one heartbeat per request as fast as they can;
3. aggregation: passes over 10,000 changed nodes, timed;
4. detection: some nodes stop reporting while the lifecycle runs every 5 s (as beat runs it);
   the time from each one's last heartbeat to ``not_ready``;
5. loss: every node's last accepted report must be the one in the database.

Each ingest figure is judged against a yardstick from the same run: a bare WSGI view
(``bare_application``: no Django, no credential, no validation) doing the same Redis write —
the buffer's own Lua script over the same keys — on a second gunicorn with the same settings,
driven by the same load generators. It is sampled three times, before, between and after the
two ingest phases, and its median is used: ``per_node_ratio`` and ``batched_ratio`` are
Orrery's figures over the bare view's.

The load generator shares the machine's cores with the server, as it does in the design
budget. It prints one JSON object. Nothing here is asserted: figures go in docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import http.client
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def gpu_report(gpus: int, seq: int) -> list[dict]:
    return [
        {
            "index": i,
            "util": float((seq * 7 + i * 13) % 100),
            "memory_used_mb": 1000 + seq % 50,
            "power_w": 300.0 + i,
            "temp_c": 55.0,
            "health": "healthy",
        }
        for i in range(gpus)
    ]


def report_body(cluster: str, nodes: list[tuple[int, str]], boot: str, seq: int, gpus: int) -> bytes:
    """One collector's report of ``nodes`` (id, name), as ``POST agent/report`` takes it."""
    return orjson.dumps(
        {
            "cluster": cluster,
            "nodes": [heartbeat(name, boot, seq, gpus) for _, name in nodes],
        }
    )


def heartbeat(name: str, boot: str, seq: int, gpus: int) -> dict:
    """One node's heartbeat, as an agent sends it."""
    return {
        "node": name,
        "boot_id": boot,
        "seq": seq,
        "cpu": 0.4,
        "memory": 2**34,
        "gpus": gpu_report(gpus, seq),
    }


def post_agent(
    conn: http.client.HTTPConnection, path: str, body: bytes, credential: str
) -> tuple[http.client.HTTPConnection, int | None, dict | None]:
    """POST one agent request on ``conn``: the connection to go on with, the status and the
    answer; on a broken connection, a fresh one to the same server and no status."""
    try:
        conn.request(
            "POST", path, body, {"Content-Type": "application/json", "Authorization": f"Bearer {credential}"}
        )
        response = conn.getresponse()
        return conn, response.status, orjson.loads(response.read())
    except (OSError, http.client.HTTPException):
        conn.close()
        return http.client.HTTPConnection(conn.host, conn.port, timeout=conn.timeout), None, None


# --- load generators (run in child processes) ---------------------------------------------------


def batched_client(
    port: int,
    jobs: list[tuple[str, str, list[tuple[int, str]]]],
    gpus: int,
    seconds: float,
    boot: str,
    start_seq: int = 0,
) -> dict:
    """Post each (cluster, credential, nodes) batch in turn until time is up."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    last: dict[int, int] = {}
    seq, accepted, requests, errors = start_seq, 0, 0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seq += 1
        for cluster, credential, nodes in jobs:
            body = report_body(cluster, nodes, boot, seq, gpus)
            conn, status, answer = post_agent(conn, "/api/v1/agent/report", body, credential)
            if status is None:
                errors += 1
                continue
            requests += 1
            if status == 200 and answer["accepted"] == len(nodes):
                accepted += len(nodes)
                last.update({node_id: seq for node_id, _ in nodes})
            else:
                errors += 1
    return {"accepted": accepted, "requests": requests, "errors": errors, "last": last}


def per_node_client(
    port: int, nodes: list[tuple[int, str, str]], gpus: int, seconds: float, boot: str, start_seq: int
) -> dict:
    """One heartbeat per request, cycling over this client's nodes, until time is up."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    last: dict[int, int] = {}
    latencies: list[float] = []
    errors = 0
    seq = start_seq
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seq += 1
        for node_id, name, credential in nodes:
            if time.monotonic() >= end:
                break
            body = orjson.dumps(heartbeat(name, boot, seq, gpus))
            started = time.perf_counter()
            conn, status, answer = post_agent(conn, "/api/v1/agent/heartbeat", body, credential)
            if status is None:
                errors += 1
                continue
            latencies.append((time.perf_counter() - started) * 1000)
            if status == 200 and answer["accepted"]:
                last[node_id] = seq
            else:
                errors += 1
    return {"latencies": latencies, "errors": errors, "last": last}


# --- the yardstick: a bare WSGI view doing the same Redis write (run by gunicorn) ---------------

_bare: dict[str, object] = {}


def bare_application(environ: dict, start_response) -> list[bytes]:
    """The bare limit of ingest on this machine: read the body, parse it, and the buffer's own
    Lua script (passed in ``ORRERY_BARE_SCRIPT``) over the report's nodes — one Redis round trip,
    the same keys and values ingest writes — then a JSON answer. No Django, no credential, no
    validation: what no ingest can do without, and nothing else."""
    if "put" not in _bare:
        import redis

        client = redis.Redis.from_url(os.environ["REDIS_URL"], socket_timeout=5)
        _bare["keys"] = [f"{os.environ['ORRERY_BARE_PREFIX']}{k}" for k in BUFFER_KEYS]
        _bare["put"] = client.register_script(os.environ["ORRERY_BARE_SCRIPT"])
    raw = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
    body = orjson.loads(raw)
    if "nodes" in body:
        args: list = []
        for item in body["nodes"]:
            name, boot, seq = item["node"], item["boot_id"], item["seq"]
            args += [name, boot, seq, orjson.dumps(item), orjson.dumps({"n": name, "b": boot, "q": seq})]
    else:
        name, boot, seq = body["node"], body["boot_id"], body["seq"]
        args = [name, boot, seq, raw, orjson.dumps({"n": name, "b": boot, "q": seq})]
    accepted, _ = _bare["put"](keys=_bare["keys"], args=args)
    payload = orjson.dumps({"accepted": accepted if "nodes" in body else bool(accepted)})
    start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))])
    return [payload]


BUFFER_KEYS = ("seq", "latest", "dirty", "counters", "slim")  # clusters.ingest.buffer.RedisBuffer


# --- the benchmark ------------------------------------------------------------------------------


def process_cpu_seconds(pids: list[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
        except (OSError, IndexError):
            pass
    return total


def server_pids(master: int) -> list[int]:
    children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    return [master, *map(int, children)]


def start_gunicorn(app: str, port: int, args: argparse.Namespace, env: dict[str, str]) -> subprocess.Popen:
    """The production server's settings; Orrery's application and the bare view get the same."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            app,
            "--pythonpath",
            str(ROOT / "benchmarks"),
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            str(args.workers),
            "--worker-class",
            "gthread",
            "--threads",
            str(args.threads),
            "--log-level",
            "warning",
            "--keep-alive",
            "30",
        ],
        cwd=ROOT,
        env=env,
    )


def batched_phase(
    port: int, jobs: list, args: argparse.Namespace, boot: str, seconds: float, start_seq: int
) -> tuple[float, list[dict]]:
    """Accepted records per second, and each load-generator process's outcome."""
    shares = [jobs[i :: args.clients] for i in range(args.clients)]
    started = time.monotonic()
    with mp.get_context("fork").Pool(args.clients) as pool:
        outcomes = pool.starmap(
            batched_client,
            [(port, share, args.gpus_per_node, seconds, boot, start_seq) for share in shares if share],
        )
    return sum(o["accepted"] for o in outcomes) / (time.monotonic() - started), outcomes


def per_node_phase(
    port: int, fleet: dict, args: argparse.Namespace, boot: str, seconds: float, start_seq: int
) -> tuple[float, list[dict]]:
    """Answered requests per second, and each load-generator process's outcome."""
    per_node = fleet["per_node"]
    shares = [per_node[i :: args.clients] for i in range(args.clients)]
    started = time.monotonic()
    with mp.get_context("fork").Pool(args.clients) as pool:
        outcomes = pool.starmap(
            per_node_client,
            [(port, share, args.gpus_per_node, seconds, boot, start_seq) for share in shares],
        )
    return sum(len(o["latencies"]) for o in outcomes) / (time.monotonic() - started), outcomes


def free_port() -> int:
    """A loopback port no one listens on now, for a server this run starts."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 30.0) -> None:
    import socket

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"the server did not start on port {port}")


def stop_process(process: subprocess.Popen, grace: float) -> None:
    """Terminate ``process`` if it still runs; killed if it has not exited within ``grace`` s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--clusters", type=int, default=4)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each ingest phase")
    parser.add_argument(
        "--yardstick-seconds", type=float, default=5.0, help="length of each bare-view load (3 samples × 2)"
    )
    parser.add_argument("--workers", type=int, default=2, help="gunicorn workers")
    parser.add_argument("--threads", type=int, default=4, help="threads per gunicorn worker")
    parser.add_argument("--clients", type=int, default=4, help="load-generator processes")
    parser.add_argument("--detect-nodes", type=int, default=200)
    parser.add_argument("--skip-detection", action="store_true", help="skip the ~50 s detection phase")
    parser.add_argument("--port", type=int, default=18_431)
    parser.add_argument(
        "--profile",
        metavar="PATH",
        help="also write cProfiles of in-process batched ingest (PATH.ingest) and of the flush passes (PATH.flush)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    args = parser.parse_args()
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))

    base_url = os.environ.get("DATABASE_URL", "postgres://postgres:postgres@127.0.0.1:5432/postgres")
    db_name = f"orrery_bench_{os.getpid()}"
    database_url = base_url.rsplit("/", 1)[0] + f"/{db_name}"
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    prefix = f"orrery-bench-{os.getpid()}:"
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "ORRERY_REDIS_PREFIX": prefix,
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "ORRERY_LOG_LEVEL": "WARNING",
    }
    os.environ.update(env)

    from benchmarks.throwaway import create_database, drop_database

    admin_dsn = base_url.rsplit("/", 1)[0] + "/postgres"
    create_database(admin_dsn, db_name)
    server = bare = None
    bare_prefix = ""
    try:
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        say(f"database {db_name} ready; building a fleet of {args.nodes} nodes")
        fleet = build_fleet(args.nodes, args.clusters, args.gpus_per_node)

        server = start_gunicorn("portal.wsgi:application", args.port, args, env)
        bare_prefix = f"orrery-bench-bare-{os.getpid()}:"
        from clusters.ingest import buffer as ingest_buffer

        bare_env = {**env, "ORRERY_BARE_PREFIX": bare_prefix, "ORRERY_BARE_SCRIPT": ingest_buffer._PUT}
        bare = start_gunicorn("heartbeats:bare_application", args.port + 1, args, bare_env)
        wait_for_port(args.port)
        wait_for_port(args.port + 1)
        time.sleep(1.0)
        pids = server_pids(server.pid)
        result: dict[str, object] = {
            "nodes": args.nodes,
            "clusters": args.clusters,
            "gpus_per_node": args.gpus_per_node,
            "server": f"gunicorn gthread {args.workers}x{args.threads}",
            "clients": args.clients,
        }
        boot = uuid.uuid4().hex
        last: dict[int, int] = {}
        jobs = [
            (c, cred, nodes[i : i + 1000])
            for c, cred, nodes in fleet["clusters"]
            for i in range(0, len(nodes), 1000)
        ]
        samples: list[dict[str, float]] = []

        def yardstick() -> None:
            # the same two loads on the bare view; bare seqs rise from sample to sample
            k = len(samples) + 1
            say(f"yardstick sample {k}: the bare view")
            seconds, seq = args.yardstick_seconds, 10**7 * k
            batched, outcomes = batched_phase(args.port + 1, jobs, args, boot, seconds, seq)
            errors = sum(o["errors"] for o in outcomes)
            # per node above the batched reports' seqs, so that every write is fresh, as in Orrery's phase
            per_node, outcomes = per_node_phase(args.port + 1, fleet, args, boot, seconds, seq + 10**6)
            errors += sum(o["errors"] for o in outcomes)
            samples.append({"batched": batched, "per_node": per_node, "errors": errors})

        yardstick()
        say("phase 1: batched ingest")
        cpu_before = process_cpu_seconds(pids)
        records_per_s, outcomes = batched_phase(args.port, jobs, args, boot, args.seconds, 0)
        cpu = process_cpu_seconds(pids) - cpu_before
        accepted = sum(o["accepted"] for o in outcomes)
        for o in outcomes:
            last.update(o["last"])
        result["batched_records_per_s"] = round(records_per_s)
        result["batched_requests"] = sum(o["requests"] for o in outcomes)
        result["batched_errors"] = sum(o["errors"] for o in outcomes)
        result["server_cpu_s_per_1000_records"] = round(cpu / max(accepted, 1) * 1000, 4)
        drain(say)

        yardstick()
        say("phase 2: per-node ingest")
        requests_per_s, outcomes = per_node_phase(args.port, fleet, args, boot, args.seconds, 10**6)
        latencies = [x for o in outcomes for x in o["latencies"]]
        for o in outcomes:
            last.update(o["last"])
        result["per_node_requests_per_s"] = round(requests_per_s)
        result["per_node_p50_ms"] = round(percentile(latencies, 0.50), 2)
        result["per_node_p99_ms"] = round(percentile(latencies, 0.99), 2)
        result["per_node_errors"] = sum(o["errors"] for o in outcomes)
        drain(say)

        yardstick()
        bare_batched = statistics.median(s["batched"] for s in samples)
        bare_per_node = statistics.median(s["per_node"] for s in samples)
        result["bare_batched_records_per_s"] = round(bare_batched)
        result["bare_batched_samples"] = [round(s["batched"]) for s in samples]
        result["bare_per_node_requests_per_s"] = round(bare_per_node)
        result["bare_per_node_samples"] = [round(s["per_node"]) for s in samples]
        result["bare_errors"] = sum(s["errors"] for s in samples)  # a stale or failed write: 0 expected
        result["batched_ratio"] = round(records_per_s / bare_batched, 3)
        result["per_node_ratio"] = round(requests_per_s / bare_per_node, 3)

        say("phase 3: aggregation passes over every node")
        with profiled(args.profile and f"{args.profile}.flush"):
            result.update(flush_passes(fleet, args.gpus_per_node, boot))
        if args.profile:
            say("profiling batched ingest in this process")
            profile_ingest(jobs, args.gpus_per_node, boot, f"{args.profile}.ingest")
            drain(say)

        say("phase 4: loss check")
        result["lost_reports"] = lost_reports(last)

        if not args.skip_detection:
            say("phase 5: detection (about a minute)")
            result.update(detection(fleet, args.detect_nodes, args.gpus_per_node))
        print(json.dumps(result, indent=None if args.json else 2))
    finally:
        for process in (server, bare):
            if process is not None:
                process.terminate()
                process.wait(10)
        if bare_prefix:
            import redis

            store = redis.Redis.from_url(redis_url)
            store.delete(*(bare_prefix + k for k in BUFFER_KEYS))
        from clusters.ingest.buffer import get_buffer

        get_buffer().clear()
        drop_database(admin_dsn, db_name)


def build_fleet(nodes: int, clusters: int, gpus: int) -> dict:
    """Clusters, nodes, GPUs and credentials, bulk-inserted as an operator's import would."""
    from django.utils import timezone

    from clusters.choices import ClusterKind, ClusterState, NodeState
    from clusters.models import Cluster, GpuDevice, GpuModel, Node, NodeCredential, NodeLastSeen
    from clusters.services.credentials import issue_cluster_credential
    from foundation.secrets import new_secret

    models = list(GpuModel.objects.filter(slug__in=["h100-80g", "a100-80g", "l40s-48g", "h200-141g"]))
    now = timezone.now()
    out: dict = {"clusters": [], "per_node": [], "node_ids": []}
    per_cluster = nodes // clusters
    for c in range(clusters):
        cluster = Cluster.objects.create(
            name=f"bench-{c}", kind=ClusterKind.SIMULATED, state=ClusterState.READY
        )
        rows = Node.objects.bulk_create(
            Node(
                cluster=cluster,
                name=f"bench-{c}-n{i:05d}",
                state=NodeState.READY,
                gpu_capacity=gpus,
                cpu_millicores_capacity=128_000,
                cpu_millicores_allocatable=128_000,
                memory_bytes_capacity=2**40,
                memory_bytes_allocatable=2**40,
            )
            for i in range(per_cluster)
        )
        model = models[c % len(models)]
        GpuDevice.objects.bulk_create(
            (
                GpuDevice(node=n, index=g, model=model, memory_mb=model.memory_mb)
                for n in rows
                for g in range(gpus)
            ),
            batch_size=5000,
        )
        NodeLastSeen.objects.bulk_create(NodeLastSeen(node=n, seen_at=now, good_since=now) for n in rows)
        _, credential = issue_cluster_credential(cluster)
        out["clusters"].append((cluster.name, credential, [(n.pk, n.name) for n in rows]))
        out["node_ids"] += [n.pk for n in rows]
    secrets = []
    for node_id, name in [x for _, _, nodes_ in out["clusters"] for x in nodes_]:
        secret = new_secret("orn_")
        secrets.append(NodeCredential(node_id=node_id, prefix=secret.prefix, digest=secret.digest))
        out["per_node"].append((node_id, name, secret.plaintext))
    NodeCredential.objects.bulk_create(secrets, batch_size=5000)
    return out


@contextlib.contextmanager
def profiled(path: str | None):
    """cProfile the block into ``path``; nothing when ``path`` is empty."""
    if not path:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        profile.dump_stats(path)


def profile_ingest(jobs: list, gpus: int, boot: str, path: str, rounds: int = 3) -> None:
    """The batched reports of phase 1 through the agent API's own handler, in this process and
    without HTTP: what a gunicorn thread spends on one, profiled."""
    from clusters.api.agent import handle

    bodies = [
        (report_body(cluster, nodes, boot, seq, gpus), credential)
        for seq in range(2 * 10**7, 2 * 10**7 + rounds)
        for cluster, credential, nodes in jobs
    ]
    with profiled(path):
        for body, credential in bodies:
            status, _ = handle("report", body, credential)
            assert status == 200, status


def drain(say) -> None:
    from clusters.services.aggregation import flush_heartbeats

    while (result := flush_heartbeats()).nodes:
        say(f"  drained {result.nodes} records in {result.seconds * 1000:.0f} ms")


def flush_passes(fleet: dict, gpus: int, boot: str, passes: int = 10) -> dict:
    from clusters.ingest.buffer import get_buffer
    from clusters.services.aggregation import flush_heartbeats

    buffer = get_buffer()
    timings, changed = [], []
    seq = 10**7
    for p in range(passes):
        seq += 1
        # every 5th pass every node also reboots: the Node and GPU rows must be written too
        this_boot = f"{boot}-{p}" if p % 5 == 4 else boot
        now = time.time()
        records = [
            {
                "n": n,
                "c": 0,
                "b": this_boot,
                "q": seq,
                "t": now,
                "s": "",
                "cpu": 0.5,
                "mem": 2**34,
                "pw": 900.0,
                "av": "bench",
                "g": [[i, "", "", 0, 1000, 50.0, 300.0, 55.0, "healthy", None] for i in range(gpus)],
                "r": [],
            }
            for n in fleet["node_ids"]
        ]
        for i in range(0, len(records), 1000):
            buffer.put(records[i : i + 1000])
        result = flush_heartbeats()
        timings.append(result.seconds * 1000)
        changed.append(result.changed)
    return {
        "flush_nodes_per_pass": len(fleet["node_ids"]),
        "flush_pass_ms_p50": round(statistics.median(timings), 1),
        "flush_pass_ms_p99": round(percentile(timings, 0.99), 1),
        "flush_pass_ms_all": [round(t, 1) for t in timings],
        "flush_passes_with_changed_facts": sum(1 for c in changed if c),
    }


def lost_reports(last: dict[int, int]) -> int:
    from clusters.models import NodeLastSeen

    stored = dict(NodeLastSeen.objects.filter(node_id__in=list(last)).values_list("node_id", "seq"))
    # phase 3 wrote higher seqs to every node: a node is lost only if the DB lags what was accepted
    return sum(1 for node_id, seq in last.items() if stored.get(node_id, -1) < seq)


def detection(fleet: dict, count: int, gpus: int) -> dict:
    """Stop ``count`` nodes at staggered times while the rest keep reporting and the lifecycle
    runs every 5 s; measure last heartbeat → not_ready."""
    from django.conf import settings

    from clusters.choices import NodeState
    from clusters.ingest.buffer import get_buffer
    from clusters.models import Node, NodeEvent
    from clusters.services.aggregation import flush_heartbeats
    from clusters.services.lifecycle import run_node_lifecycle

    buffer = get_buffer()
    ids = fleet["node_ids"]
    victims = set(ids[:: max(len(ids) // count, 1)][:count])
    Node.objects.update(state=NodeState.READY)
    last_beat: dict[int, float] = {}
    seq = 10**8
    start = time.time()
    deadline = start + settings.NODE_GRACE + 30
    next_lifecycle = start
    while time.time() < deadline:
        seq += 1
        now = time.time()
        # victims go quiet one after another over the first 10 s
        quiet = {v for i, v in enumerate(sorted(victims)) if now - start > 10 * (i + 1) / len(victims)}
        live = [n for n in ids if n not in quiet]
        records = [
            {
                "n": n,
                "c": 0,
                "b": "detect",
                "q": seq,
                "t": now,
                "s": "",
                "cpu": 0.5,
                "mem": 1,
                "pw": 1.0,
                "av": "bench",
                "g": [],
                "r": [],
            }
            for n in live
        ]
        for i in range(0, len(records), 2000):
            buffer.put(records[i : i + 2000])
        for n in live:
            if n in victims:
                last_beat[n] = now
        flush_heartbeats()
        if now >= next_lifecycle:
            run_node_lifecycle()
            next_lifecycle += 5.0
        time.sleep(max(0.0, 2.0 - (time.time() - now)))
    detected = dict(
        NodeEvent.objects.filter(node_id__in=victims, to_state=NodeState.NOT_READY).values_list(
            "node_id", "at"
        )
    )
    delays = [detected[n].timestamp() - last_beat[n] for n in victims if n in detected and n in last_beat]
    return {
        "detection_nodes": len(victims),
        "detection_detected": len(delays),
        "detection_s_p50": round(statistics.median(delays), 1) if delays else None,
        "detection_s_p99": round(percentile(delays, 0.99), 1) if delays else None,
        "node_grace_s": settings.NODE_GRACE,
    }


if __name__ == "__main__":
    main()
