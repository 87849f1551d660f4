#!/usr/bin/env python
"""Soak: a simulated fleet reporting to the production topology for a long while, with one
SIGKILL of each control-plane process along the way.

    python benchmarks/soak.py --nodes 10000 --seconds 600 --json

The topology of the fault suite (``tests/faults/harness.py``): two gunicorns, two daphnes, two
Celery workers and two Celery beats, supervised (a killed process is restarted a second
later), on a PostgreSQL and a Redis started for the run in a temporary directory. The fleet:
``--nodes`` simulated nodes of 8 GPUs in ``--clusters`` clusters, each cluster's collector
posting every node every ``--interval`` seconds through ``agent/report`` on alternating
gunicorns, sending a refused or unanswered batch again until it is answered.

1. **Yardstick**, in the same run, before anything is killed: the bare rate of reports the
   topology takes when posted as fast as the sender can, for ``--yardstick`` seconds.
2. **Soak**: reports every ``--interval`` for ``--seconds``; the eight processes are killed in
   turn at even spacing (the second copy of a role only once the first serves again); keyed
   job submissions every second run alongside.
3. **Checks**: reports lost (sent, less those the server answered as accepted, stale or
   unknown: a stale one is a retry of a report the server took but whose answer was lost with
   a killed process), the server's own count
   of accepted reports, every node's last acknowledged report found in the database, node
   flaps, every accepted job present; each process's resident memory (its process group)
   sampled every ``--sample`` seconds: first, peak and last.

Prints one JSON object. Nothing here is asserted; ``tests/faults/test_soak.py`` runs a short
variant and asserts on it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.faults.harness import (  # noqa: E402
    Heartbeats,
    PrivatePostgres,
    PrivateRedis,
    Submitter,
    Topology,
    group_members,
    private_root,
    rss_mib,
    wait_for,
)

KILL_ORDER = ("web-1", "worker-1", "ws-1", "beat-1", "web-2", "worker-2", "ws-2", "beat-2")


class MemorySampler(threading.Thread):
    """Every ``every_s``, the resident memory of each process's group, in MiB."""

    def __init__(self, topology: Topology, every_s: float) -> None:
        super().__init__(daemon=True, name="memory")
        self.topology, self.every = topology, every_s
        self.samples: dict[str, list[float]] = {name: [] for name in topology.processes}
        self.halted = threading.Event()

    def run(self) -> None:
        while True:
            for name, process in self.topology.processes.items():
                if process.alive():
                    self.samples[name].append(rss_mib(group_members(process.pid)))
            if self.halted.wait(self.every):
                return

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            name: {"first": s[0], "peak": max(s), "last": s[-1], "samples": len(s)}
            for name, s in self.samples.items()
            if s
        }


def yardstick(topology: Topology, seconds: float) -> tuple[float, Heartbeats]:
    """Reports per second the topology takes when posted back to back (4 sender threads)."""
    sender = Heartbeats(topology.web_ports, topology.seed["clusters"], interval_s=0.0, threads=4)
    sender.start()
    time.sleep(seconds)
    sender.stop()
    return sender.accepted / seconds, sender


def soak(
    topology: Topology, *, seconds: float, interval_s: float, yardstick_s: float, sample_s: float, say
) -> dict:
    say(f"yardstick: reports posted back to back for {yardstick_s:g} s")
    rate, warm = yardstick(topology, yardstick_s)
    counters_key = f"{topology.env['ORRERY_REDIS_PREFIX']}hb:counters"
    server_before = int(topology.redis.client().hget(counters_key, "accepted") or 0)
    sampler = MemorySampler(topology, sample_s)
    sampler.start()
    heartbeats = Heartbeats(topology.web_ports, topology.seed["clusters"], interval_s=interval_s, after=warm)
    heartbeats.start()
    submitter = Submitter(topology.api, topology.project, every_s=1.0, seconds=5).start()
    since = time.time()
    kills: list[dict] = []
    spacing = seconds * 0.8 / len(KILL_ORDER)
    try:
        for i, name in enumerate(KILL_ORDER):
            _sleep_until(since + seconds * 0.1 + i * spacing)
            sibling = next(s for pair in _roles() for s in pair if name in pair and s != name)
            topology.processes[sibling].wait_up(180)
            at = topology.kill(name)
            say(f"killed {name} at {at - since:.0f} s")
            kills.append({"process": name, "at_s": round(at - since, 1), "_at": at})
        _sleep_until(since + seconds)
        for kill in kills:
            process = topology.processes[kill["process"]]
            wait_for(lambda p=process, k=kill: p.alive() and p.started_at > k["_at"], "a restart", 120)
            process.wait_up(180)
    finally:
        submitter.stop()
        heartbeats.stop()
        sampler.halted.set()
        sampler.join(30)
    elapsed = time.time() - since
    say("checking: every node's last acknowledged report in the database")
    missing = _caught_up(topology, heartbeats)
    server_accepted = int(topology.redis.client().hget(counters_key, "accepted") or 0) - server_before
    with topology.cursor() as cursor:
        from tests.faults.invariants import database_violations

        violations = database_violations(cursor, accepted_jobs=submitter.accepted.values())
    return {
        "nodes": sum(len(c["nodes"]) for c in topology.seed["clusters"].values()),
        "seconds": round(elapsed, 1),
        "interval_s": interval_s,
        "yardstick_reports_per_s": round(rate, 1),
        "reports_per_s": round(heartbeats.accepted / elapsed, 1),
        "reports": {
            "sent": heartbeats.sent,
            "accepted": heartbeats.accepted,
            "stale": heartbeats.stale,
            "unknown": heartbeats.unknown,
            "lost": heartbeats.lost,
            "retried_requests": heartbeats.failed,
            "server_counted_accepted": server_accepted,
            "not_in_database": missing,
        },
        "jobs_accepted": len(submitter.accepted),
        "submission_failures": submitter.failures,
        "node_flaps": topology.node_flaps(since),
        "unplanned_deaths": [d.name for d in topology.supervisor.unplanned(since)],
        "kills": [{k: v for k, v in kill.items() if not k.startswith("_")} for kill in kills],
        "memory_mib": sampler.summary(),
        "invariants_broken": violations,
    }


def _roles() -> tuple[tuple[str, str], ...]:
    return (Topology.WEB, Topology.WS, Topology.WORKERS, Topology.BEATS)


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


def _caught_up(topology: Topology, heartbeats: Heartbeats, timeout: float = 120) -> int:
    """How many nodes' last acknowledged report is still not in the database after the flush
    has had ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        rows = topology.query(
            "SELECT n.name, coalesce(s.seq, 0) FROM clusters_node n"
            " LEFT JOIN clusters_nodelastseen s ON s.node_id = n.id"
        )
        behind = sum(1 for name, seq in rows if seq < heartbeats.acked.get(name, 0))
        if not behind or time.monotonic() >= end:
            return behind
        time.sleep(1)


def run_private(args: argparse.Namespace, say: Callable[..., None]) -> dict:
    """Start private servers and the topology, soak, tear everything down."""
    root = private_root("orrery-soak-")
    pg, rds = PrivatePostgres(root), PrivateRedis(root)
    topology = None
    try:
        pg.init()
        pg.start()
        migrate_s = pg.migrate_template()
        rds.start()
        say(f"seeding {args.nodes} nodes")
        env = {
            "ORRERY_HEARTBEAT_INTERVAL": str(int(args.interval)),
            "ORRERY_NODE_GRACE": str(int(args.interval * 4)),
        }
        env["ORRERY_NODE_FAILOVER_AFTER"] = str(int(args.interval * 12))
        per_cluster = args.nodes // args.clusters
        topology = Topology(pg, rds, root / "soak", clusters=args.clusters, nodes=per_cluster, env=env)
        say("starting the topology")
        topology.start()
        result = soak(
            topology,
            seconds=args.seconds,
            interval_s=args.interval,
            yardstick_s=args.yardstick,
            sample_s=args.sample,
            say=say,
        )
        return {"migrate_s": round(migrate_s, 1), "seed_s": round(topology.seed_s, 1), **result}
    finally:
        if topology is not None:
            topology.stop()
        rds.stop()
        if pg.running():
            pg.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--clusters", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between a node's reports")
    parser.add_argument("--yardstick", type=float, default=20.0, help="seconds of back-to-back reports first")
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between memory samples")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    print(json.dumps(run_private(args, say)))


if __name__ == "__main__":
    main()
