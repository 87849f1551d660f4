#!/usr/bin/env python
"""Websocket fan-out benchmark: live dashboards of a 10,000-node fleet, 1,000 open sockets.

    python benchmarks/websockets.py --sockets 1000 --json

Runs against PostgreSQL and Redis (``DATABASE_URL``/``REDIS_URL``, defaults on loopback) and the
production websocket server, Daphne with the Redis channel layer — one process, or ``--servers``
of them with the sockets spread round-robin as a load balancer would — which it starts on
loopback. It creates a throwaway database with users in projects and a signed-in session for
each, then opens, from load-generator processes:

- the subscribers: half of ``--sockets`` on ``/ws/fleet/``, half on ``/ws/jobs/`` (each user a
  member of one of ``--projects`` projects), through Orrery's consumers (session, origin check,
  access, re-authorisation every 3 s, coalescing);
- the yardstick: as many sockets on a bare Channels consumer served by the same Daphne, which
  joins one group and echoes what the group is sent, with no Orrery code in the way.

Phases, the yardstick sampled before, between and after the measured ones:

1. yardstick: ``group_send`` of a timestamped message to the bare group, five rounds 1 s apart; each
   subscriber's latency from the send to its receipt (the channel layer's own fan-out);
2. live: for ``--seconds``, the events a busy fleet publishes, on the groups the services publish
   them to (``scheduling.events``, ``clusters.events``): every scheduling cycle (1 s) each
   project's submitted and scheduled jobs as one batch event, each job's start and end as its
   own event, node state changes one by one and a lifecycle pass every 10 s. Every job and node
   id is fresh, so each receipt is matched to the event it carries: the delivery latency of an
   event is from its publication to the first delta that carries it or a later state of the
   same id. Events no delta had carried 2.5 s after the phase (late behind a backlog, or never
   sent), leaks across projects and messages per subscriber are counted.

It prints one JSON object, with the absolute figures and their ratios to the yardstick (its
median over the samples). Nothing here is asserted: figures go in docs/performance.md. The load
generator shares the machine's cores with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder comes first on the path, and its name would shadow the
# `websockets` package for anything that imports it: put the repository there instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]
sys.path.insert(0, str(ROOT))

from benchmarks.heartbeats import free_port, percentile, stop_process, wait_for_port  # noqa: E402

RUN = os.environ.get("ORRERY_BENCH_RUN", str(os.getpid()))
# The run's own channel-layer prefix: groups and channels left in Redis by an earlier run (a
# server killed before it left its groups) are not this run's members, backlogs or refusals.
LAYER_PREFIX = f"asgi-bench-{RUN}"
BARE_GROUP = "bench.bare"
BARE_PATH = "/bench/bare/"
DRAIN_S = 2.5  # after a live phase: the last deltas leave (one interval and some)
RANKS = {"PENDING": 0, "SCHEDULED": 1, "RUNNING": 2, "SUCCEEDED": 3}  # a job's states, in order


def __getattr__(name: str) -> Any:
    """``benchmarks.websockets:application``, the app Daphne serves here: Orrery's, plus the bare
    echo consumer of the yardstick on ``/bench/bare/``. Built on first access, so that importing
    this module for the benchmark itself loads no Django."""
    if name != "application":
        raise AttributeError(name)
    if os.environ.get("ORRERY_BENCH_PROFILE"):  # --profile: the server's own time, written at exit
        import atexit
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
        atexit.register(profile.dump_stats, os.environ["ORRERY_BENCH_PROFILE"])
    from channels.generic.websocket import AsyncWebsocketConsumer
    from django.conf import settings

    from portal.asgi import application as orrery

    settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"] = LAYER_PREFIX  # before the layer is made

    class BareEcho(AsyncWebsocketConsumer):
        """Joins one group and sends each message's text as it comes."""

        async def connect(self) -> None:
            await self.channel_layer.group_add(BARE_GROUP, self.channel_name)
            await self.accept()

        async def disconnect(self, code: int) -> None:
            await self.channel_layer.group_discard(BARE_GROUP, self.channel_name)

        async def bench_echo(self, message: dict[str, Any]) -> None:
            await self.send(text_data=message["text"])

    bare = BareEcho.as_asgi()

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket" and scope["path"] == BARE_PATH:
            return await bare(scope, receive, send)
        return await orrery(scope, receive, send)

    return app


# --- load generator (child processes) -----------------------------------------------------------


def subscriber_process(sockets: list[tuple[int, str, str]], control: Any) -> None:
    """Hold ``sockets`` ((server port, path, cookie) each) open, time-stamping every frame
    received, until told to stop; then send back [(socket index, receipt time, text)]."""
    asyncio.run(_subscribe(sockets, control))


async def _subscribe(sockets: list[tuple[int, str, str]], control: Any) -> None:
    import aiohttp

    received: list[tuple[int, float, str]] = []
    opened = asyncio.Semaphore(25)  # connect a few at a time, as pages do after a deploy
    ready = [0, 0]  # open, refused

    async def hold(index: int, port: int, path: str, cookie: str, session: aiohttp.ClientSession) -> None:
        headers = {"Origin": f"http://127.0.0.1:{port}"}
        if cookie:
            headers["Cookie"] = cookie
        wait = 1.0
        while True:  # a refused page tries again after 1 s, doubling to 15 s (portal/live.js)
            async with opened:
                try:
                    ws = await session.ws_connect(
                        f"http://127.0.0.1:{port}{path}", headers=headers, heartbeat=None
                    )
                    break
                except aiohttp.ClientError:
                    ready[1] += 1
            await asyncio.sleep(wait)
            wait = min(wait * 2, 15.0)
        ready[0] += 1
        async for message in ws:
            if message.type == aiohttp.WSMsgType.TEXT:
                received.append((index, time.time(), message.data))
            else:
                break

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.ensure_future(hold(i, *socket, session)) for i, socket in enumerate(sockets)]
        while ready[0] < len(sockets):
            await asyncio.sleep(0.2)
        control.send(tuple(ready))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, control.recv)  # "stop"
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    control.send(received)


# --- the fleet's events -------------------------------------------------------------------------


@dataclasses.dataclass
class Published:
    """What one live phase sent: per project, (job id, rank, time) per job event; (node id, time)
    per node event; new jobs announced per project."""

    jobs: dict[int, list[tuple[int, int, float]]]
    nodes: list[tuple[int, float]]
    new_jobs: dict[int, int]
    started: float = 0.0
    ended: float = 0.0
    events: int = 0


def plan_events(
    args: argparse.Namespace, projects: list[int], first_job: int, first_node: int, seed: int
) -> list[tuple[float, str, list[str], Any]]:
    """The events of one live phase as (offset s, kind, groups, event), sorted by offset: a fleet
    of ``--nodes`` nodes as the scheduler, the agents and the lifecycle pass publish it."""
    from clusters.events import NodesStateChanged, NodeStateChanged
    from scheduling.events import JobsScheduled, JobsSubmitted, JobStateChanged, job_groups

    rng = random.Random(seed)
    plan: list[tuple[float, str, list[str], Any]] = []
    job_id, node_id = first_job, first_node
    clusters = 4
    for cycle in range(int(args.seconds)):
        t = float(cycle)
        # One cycle: each project's new jobs arrive as one batch, the previous batch is placed as
        # one batch, and each placed job starts (the agent reports) and later ends on its own.
        per_project = max(1, round(args.job_starts_per_s / len(projects)))
        for project in projects:
            ids = list(range(job_id, job_id + per_project))
            job_id += per_project
            at = t + rng.uniform(0, 0.2)
            plan.append((at, "job", [f"project.{project}"], JobsSubmitted(project, ids, len(ids))))
            plan.append((at + 0.5, "job", [f"project.{project}"], JobsScheduled(project, ids, len(ids), 1)))
            for i in ids:
                start = at + 0.5 + rng.uniform(0.1, 1.0)
                end = start + rng.uniform(1.0, 5.0)
                for when, frm, to in ((start, "SCHEDULED", "RUNNING"), (end, "RUNNING", "SUCCEEDED")):
                    if when < args.seconds:
                        event = JobStateChanged(i, project, frm, to, "", "")
                        plan.append((when, "job", job_groups(i, project), event))
        for _ in range(round(args.node_changes_per_s)):
            cluster = rng.randrange(clusters)
            event = NodeStateChanged(node_id, cluster, f"n{node_id}", "ready", "not_ready", "", "")
            plan.append((t + rng.uniform(0, 1), "node", [f"cluster.{cluster}", "fleet"], event))
            node_id += 1
        if cycle % 10 == 5:  # a lifecycle pass finds a rack silent
            ids = list(range(node_id, node_id + args.lifecycle_batch))
            node_id += args.lifecycle_batch
            event = NodesStateChanged(0, ids, len(ids), "not_ready", "heartbeat timeout", "")
            plan.append((t + rng.uniform(0, 1), "node", ["cluster.0", "fleet"], event))
    plan.sort(key=lambda item: item[0])
    return plan


async def publish_plan(layer: Any, plan: list[tuple[float, str, list[str], Any]]) -> Published:
    """Send each planned event at its offset, as ``foundation.live.publish`` sends it."""
    out = Published(jobs={}, nodes=[], new_jobs={})
    loop = asyncio.get_running_loop()
    start = loop.time()
    out.started = time.time()
    for offset, kind, groups, event in plan:
        delay = start + offset - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        data = dataclasses.asdict(event)
        payload = {"type": "live.event", "event": type(event).__name__, "data": data}
        now = time.time()
        for group in groups:
            await layer.group_send(group, payload)
        out.events += 1
        if kind == "node":
            ids = data["node_ids"] if "node_ids" in data else [data["node_id"]]
            out.nodes.extend((i, now) for i in ids)
            continue
        project = data["project_id"]
        name = type(event).__name__
        if name == "JobStateChanged":
            out.jobs.setdefault(project, []).append((data["job_id"], RANKS[data["to_state"]], now))
        else:
            rank = RANKS["PENDING" if name == "JobsSubmitted" else "SCHEDULED"]
            out.jobs.setdefault(project, []).extend((i, rank, now) for i in data["job_ids"])
            if name == "JobsSubmitted":
                out.new_jobs[project] = out.new_jobs.get(project, 0) + data["count"]
    out.ended = time.time()
    return out


async def drained(layer: Any, limit_s: float = 30.0) -> float:
    """Wait until the server has taken every message off its channel in Redis (a yardstick sent
    into a backlog would measure the backlog); the seconds waited."""
    connection = layer.connection(0)
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        keys = await connection.keys(f"{layer.prefix}specific.*")
        if not keys or all([await connection.zcard(k) == 0 for k in keys]):
            break
        await asyncio.sleep(0.2)
    return time.monotonic() - started


async def sample_yardstick(layer: Any, rounds: int) -> tuple[float, float]:
    """Send ``rounds`` timestamped messages to the bare group; (first, last) send time."""
    first = time.time()
    for r in range(rounds):
        await layer.group_send(BARE_GROUP, {"type": "bench.echo", "text": f"{r} {time.time()!r}"})
        await asyncio.sleep(1.0)  # a round apart, so that rounds do not queue behind each other
    return first, time.time()


# --- analysis -----------------------------------------------------------------------------------


def yardstick_figures(bare: list[tuple[float, str]], window: tuple[float, float]) -> dict[str, float]:
    """Latency of every receipt of a bare message sent within ``window``."""
    latencies = []
    for received_at, text in bare:
        sent = float(text.split()[1])
        if window[0] <= sent <= window[1]:
            latencies.append(received_at - sent)
    return {
        "p50_ms": round(percentile(latencies, 0.50) * 1000, 1),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 1),
        "receipts": len(latencies),
    }


def live_figures(
    published: Published,
    subscribers: list[tuple[str, int | None, list[tuple[float, dict]]]],
    flush_s: float,
    project_of: dict[int, int],
) -> dict[str, Any]:
    """Delivery latency of every (subscriber, event), events undelivered, leaks, messages per second."""
    latencies: list[float] = []
    lost = leaks = new_jobs_missing = 0
    rates: list[float] = []
    gaps: list[float] = []
    span = published.ended + DRAIN_S - published.started
    for kind, project, deltas in subscribers:
        deltas = [(t, d) for t, d in deltas if t >= published.started]
        rates.append(len(deltas) / span)
        gaps.extend(b[0] - a[0] for a, b in itertools.pairwise(deltas))
        seen: dict[int, list[tuple[float, int]]] = {}
        if kind == "fleet":
            for t, d in deltas:
                for node_id in d["nodes"]:
                    seen.setdefault(int(node_id), []).append((t, 0))
            expected = [(node_id, 0, at) for node_id, at in published.nodes]
        else:
            heard_new = 0
            for t, d in deltas:
                heard_new += d["newJobs"]
                for job_id, state in d["jobs"].items():
                    if project_of.get(int(job_id)) != project:
                        leaks += 1
                    seen.setdefault(int(job_id), []).append((t, RANKS[state]))
            expected = published.jobs.get(project, [])
            new_jobs_missing += published.new_jobs.get(project, 0) - heard_new
        for ident, rank, at in expected:
            receipt = next((t for t, r in seen.get(ident, ()) if r >= rank and t >= at), None)
            if receipt is None:
                lost += 1
            else:
                latencies.append(receipt - at)
    return {
        "events_published": published.events,
        "deliveries": len(latencies),
        "delivery_p50_ms": round(percentile(latencies, 0.50) * 1000, 1),
        "delivery_p99_ms": round(percentile(latencies, 0.99) * 1000, 1),
        "delivery_max_ms": round(max(latencies, default=float("nan")) * 1000, 1),
        "undelivered": lost,
        "new_jobs_missing": new_jobs_missing,
        "leaks_across_projects": leaks,
        "messages_per_subscriber_per_s_max": round(max(rates, default=0), 3),
        "messages_per_subscriber_per_s_mean": round(statistics.fmean(rates) if rates else 0, 3),
        "gap_between_messages_min_s": round(min(gaps, default=float("nan")), 3),
        "gaps_under_interval": sum(1 for g in gaps if g < flush_s * 0.95),
    }


# --- the run ------------------------------------------------------------------------------------


def make_world(sockets: int, projects: int) -> tuple[list[int], list[tuple[str, str, int | None]]]:
    """Projects, one user per jobs socket (each in one project), one operator-less user for the
    fleet sockets; a signed-in session each. Returns the project ids and (kind, cookie,
    project) per Orrery socket."""
    from django.conf import settings
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY, get_user_model
    from django.contrib.sessions.backends.db import SessionStore

    from portal.models import Membership, Project

    user_model = get_user_model()
    made = Project.objects.bulk_create([Project(name=f"bench{i}") for i in range(projects)])
    project_ids = [p.pk for p in made]
    jobs_sockets, fleet_sockets = sockets // 2, sockets - sockets // 2
    users = user_model.objects.bulk_create(
        [user_model(username=f"viewer{i}", password="!") for i in range(jobs_sockets + fleet_sockets)]
    )
    Membership.objects.bulk_create(
        [Membership(user=u, project_id=project_ids[i % projects]) for i, u in enumerate(users[:jobs_sockets])]
    )
    backend = "django.contrib.auth.backends.ModelBackend"
    specs: list[tuple[str, str, int | None]] = []
    for i, user in enumerate(users):
        session = SessionStore()
        session[SESSION_KEY] = str(user.pk)
        session[BACKEND_SESSION_KEY] = backend
        session[HASH_SESSION_KEY] = user.get_session_auth_hash()
        session.create()
        cookie = f"{settings.SESSION_COOKIE_NAME}={session.session_key}"
        if i < jobs_sockets:
            specs.append(("jobs", cookie, project_ids[i % projects]))
        else:
            specs.append(("fleet", cookie, None))
    return project_ids, specs


class OverCapacity(logging.Handler):
    """Counts the group sends channels-redis refused for some members: a process's channel held
    ``capacity`` (100) messages not yet received, so the newest was dropped for its sockets."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.groups = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "over capacity" in record.getMessage():
            self.groups += 1


def rss_mb(pid: int) -> dict[str, float]:
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return {k: round(int(fields[k].split()[0]) / 1024, 1) for k in ("VmRSS", "VmHWM")}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sockets", type=int, default=1000, help="Orrery subscribers (half fleet, half jobs)"
    )
    parser.add_argument("--projects", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=10_000, help="the fleet the events are about")
    parser.add_argument("--job-starts-per-s", type=float, default=20.0)
    parser.add_argument("--node-changes-per-s", type=float, default=2.0)
    parser.add_argument("--lifecycle-batch", type=int, default=50, help="nodes a lifecycle pass marks")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each live phase")
    parser.add_argument(
        "--phases", type=int, default=2, help="live phases (yardstick before, between, after)"
    )
    parser.add_argument("--clients", type=int, default=2, help="load-generator processes")
    parser.add_argument("--port", type=int, default=0, help="first server's port (0: any free ones)")
    parser.add_argument(
        "--servers", type=int, default=1, help="Daphne processes, the sockets spread over them"
    )
    parser.add_argument("--profile", help="write the server's cProfile statistics to this file")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    args = parser.parse_args()
    # A time limit ends the run cleanly (the server stopped, the database dropped); the cleanup
    # itself is not interrupted by a second signal.
    signal.signal(signal.SIGTERM, lambda *_: (signal.signal(signal.SIGTERM, signal.SIG_IGN), sys.exit(143)))
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))

    base_url = os.environ.get("DATABASE_URL", "postgres://postgres:postgres@127.0.0.1:5432/postgres")
    db_name = f"orrery_bench_ws_{os.getpid()}"
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    env = {
        **os.environ,
        "DATABASE_URL": base_url.rsplit("/", 1)[0] + f"/{db_name}",
        "REDIS_URL": redis_url,
        "ORRERY_REDIS_PREFIX": f"orrery-bench-{os.getpid()}:",
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "ORRERY_LOG_LEVEL": "WARNING",
        "ORRERY_ALLOWED_HOSTS": "127.0.0.1,localhost",
        "ORRERY_BENCH_RUN": str(os.getpid()),
    }
    os.environ.update(env)
    ports = [args.port + i if args.port else free_port() for i in range(args.servers)]

    from benchmarks.throwaway import create_database, drop_database

    admin_dsn = base_url.rsplit("/", 1)[0] + "/postgres"
    create_database(admin_dsn, db_name)
    servers: list[subprocess.Popen] = []
    clients: list[tuple[Any, Any]] = []
    try:
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import connections

        from foundation.live import RedisChannelLayer
        from portal.consumers import FLUSH_S

        call_command("migrate", verbosity=0)
        project_ids, specs = make_world(args.sockets, args.projects)
        connections.close_all()  # the load generators are forked next
        say(f"database {db_name} ready: {len(specs)} sessions in {len(project_ids)} projects")

        for i, port in enumerate(ports):  # the profile, if asked for, is the first server's
            profile = (
                {"ORRERY_BENCH_PROFILE": str(Path(args.profile).resolve())} if args.profile and not i else {}
            )
            argv = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port)]
            servers.append(
                subprocess.Popen(
                    [*argv, "benchmarks.websockets:application"],
                    cwd=ROOT,
                    env=env | profile,
                    stdout=subprocess.DEVNULL,
                )
            )
        for port, server in zip(ports, servers, strict=True):
            wait_for_port(port, timeout=60.0)
            if server.poll() is not None:
                raise SystemExit(f"daphne exited ({server.returncode}): is port {port} taken?")

        # Socket i of the whole run: the Orrery ones first, then the bare ones; socket i is
        # served by server i mod --servers (a load balancer's round robin).
        paths = [("/ws/fleet/" if kind == "fleet" else "/ws/jobs/", cookie) for kind, cookie, _ in specs]
        paths += [(BARE_PATH, "")] * args.sockets
        paths = [(ports[i % len(ports)], path, cookie) for i, (path, cookie) in enumerate(paths)]
        shares = [list(range(i, len(paths), args.clients)) for i in range(args.clients)]
        context = mp.get_context("fork")
        connect_started = time.monotonic()
        for share in shares:
            mine, theirs = context.Pipe()
            process = context.Process(target=subscriber_process, args=([paths[i] for i in share], theirs))
            process.start()
            clients.append((process, mine))
        opened = [conn.recv() for _, conn in clients]
        connect_s = time.monotonic() - connect_started
        say(
            f"sockets open: {sum(o[0] for o in opened)}, refused {sum(o[1] for o in opened)} in {connect_s:.1f} s"
        )
        time.sleep(2.0)
        rss_open = [rss_mb(server.pid) for server in servers]

        layer = RedisChannelLayer(hosts=[{"address": redis_url}], prefix=LAYER_PREFIX)
        over_capacity = OverCapacity()
        logging.getLogger("channels_redis.core").addHandler(over_capacity)
        logging.getLogger("channels_redis.core").setLevel(logging.INFO)
        windows: list[tuple[float, float]] = []
        phases: list[Published] = []
        cpu: list[float] = []
        waited: list[float] = []

        async def run() -> None:
            next_job, next_node = 1_000_000, 0
            for phase in range(args.phases + 1):
                waited.append(round(await drained(layer), 1))
                say(f"yardstick sample {phase + 1}")
                windows.append(await sample_yardstick(layer, 5))
                await asyncio.sleep(1.0)
                if phase == args.phases:
                    break
                say(f"live phase {phase + 1}: {args.seconds:.0f} s")
                plan = plan_events(args, project_ids, next_job, next_node, seed=phase)
                next_job += 10_000_000
                next_node = (next_node + 5_000) % args.nodes
                before = sum(cpu_seconds(server.pid) for server in servers)
                phases.append(await publish_plan(layer, plan))
                await asyncio.sleep(DRAIN_S)
                used = sum(cpu_seconds(server.pid) for server in servers) - before
                cpu.append(used / (args.seconds + DRAIN_S))

        asyncio.run(run())
        rss_end = [rss_mb(server.pid) for server in servers]
        received: list[tuple[int, float, str]] = []
        for share, (_, conn) in zip(shares, clients, strict=True):
            conn.send("stop")
            received.extend((share[i], t, text) for i, t, text in conn.recv())

        # Sort the receipts out by socket: Orrery deltas per subscriber, bare echoes together.
        orrery: list[list[tuple[float, dict]]] = [[] for _ in specs]
        bare: list[tuple[float, str]] = []
        for index, t, text in sorted(received, key=lambda r: r[1]):
            if index < len(specs):
                message = json.loads(text)
                if message["type"] == "delta":
                    orrery[index].append((t, message))
            else:
                bare.append((t, text))
        project_of = {}
        for published in phases:
            for project, events in published.jobs.items():
                project_of.update((job_id, project) for job_id, _, _ in events)

        samples = [yardstick_figures(bare, w) for w in windows]
        yard_p50 = statistics.median(s["p50_ms"] for s in samples)
        yard_p99 = statistics.median(s["p99_ms"] for s in samples)
        live = []
        for published in phases:
            subscribers = [
                (kind, project, [(t, d) for t, d in orrery[i] if t <= published.ended + DRAIN_S])
                for i, (kind, _, project) in enumerate(specs)
            ]
            live.append(live_figures(published, subscribers, FLUSH_S, project_of))
        p99 = statistics.median(p["delivery_p99_ms"] for p in live)
        p50 = statistics.median(p["delivery_p50_ms"] for p in live)
        result = {
            "subscribers": {
                "fleet": sum(1 for s in specs if s[0] == "fleet"),
                "jobs": sum(1 for s in specs if s[0] == "jobs"),
            },
            "bare_sockets": args.sockets,
            "projects": args.projects,
            "rates": {
                "job_starts_per_s": args.job_starts_per_s,
                "node_changes_per_s": args.node_changes_per_s,
                "lifecycle_batch_every_10_s": args.lifecycle_batch,
                "events_per_s": round(
                    statistics.fmean(p["events_published"] for p in live) / args.seconds, 1
                ),
            },
            "flush_s": FLUSH_S,
            "connect_s": round(connect_s, 1),
            "refused": sum(o[1] for o in opened),
            "yardstick_samples": samples,
            "drain_wait_s": waited,
            "yardstick_p50_ms": yard_p50,
            "yardstick_p99_ms": yard_p99,
            "phases": live,
            "delivery_p50_ms": p50,
            "delivery_p99_ms": p99,
            "delivery_p99_ratio": round(p99 / yard_p99, 2),
            "delivery_p50_ratio": round(p50 / yard_p50, 2),
            "undelivered": sum(p["undelivered"] for p in live) + sum(p["new_jobs_missing"] for p in live),
            "dropped_by_channel_layer": over_capacity.groups,
            "leaks_across_projects": sum(p["leaks_across_projects"] for p in live),
            "messages_per_subscriber_per_s_max": max(p["messages_per_subscriber_per_s_max"] for p in live),
            "servers": len(servers),
            "server_cpu_share": [round(c, 2) for c in cpu],  # of one core, all servers together
            "server_rss_mb": {  # per server
                "sockets_open": [r["VmRSS"] for r in rss_open],
                "end": [r["VmRSS"] for r in rss_end],
                "peak": [r["VmHWM"] for r in rss_end],
            },
        }
        print(json.dumps(result, indent=None if args.json else 2))
    finally:
        for process, _ in clients:
            if process.is_alive():
                process.terminate()
            process.join(5)
        for server in servers:
            stop_process(server, 5)  # past that, still closing a thousand sockets: no need to wait
        drop_database(admin_dsn, db_name)


if __name__ == "__main__":
    main()
