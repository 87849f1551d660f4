"""20,000 pending jobs while 2,000 nodes report every 5 s: a new job is still placed and the API
still answers.

The backlog waits in a queue whose A100 quota is zero (``tests.faults.seed``), so it stays
pending however free the fleet is, and every cycle carries it. Measured and printed as one
JSON line: the time from a new job's acceptance to its placement, and the latency of the API's
submissions and job listings meanwhile. The figures are printed, not
bounded (no test asserts on a time): what is asserted is that every new job is placed (each is
waited for, 60 s at most, so a stalled scheduler fails), that the listings kept answering, and
the invariants.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

from tests.faults.harness import Heartbeats, Topology, job_spec, wait_for
from tests.faults.invariants import assert_invariants

TOPOLOGY = {
    "clusters": 2,
    "nodes": 1000,
    "env": {
        "ORRERY_MAX_WAITING_JOBS_PER_USER": "100000",
        "ORRERY_HEARTBEAT_INTERVAL": "5",
        "ORRERY_NODE_GRACE": "40",
        "ORRERY_NODE_FAILOVER_AFTER": "120",
    },
}
BACKLOG = 20_000
PLACEMENTS = 12  # new jobs submitted one at a time, each waited for until it is placed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def test_new_jobs_are_placed_promptly_behind_twenty_thousand_pending(topology: Topology):
    heartbeats = Heartbeats(topology.web_ports, topology.seed["clusters"], interval_s=5.0)
    heartbeats.start()
    latencies: list[float] = []
    done = threading.Event()

    def reader() -> None:
        while not done.wait(0.05):
            started = time.monotonic()
            status, _, _ = topology.api.call("GET", "/api/v1/jobs?state=PENDING")
            if status == 200:
                latencies.append(time.monotonic() - started)

    try:
        started = time.monotonic()
        for half in range(2):
            spec = job_spec(topology.project, queue="backlog", name=f"backlog{half}")
            spec["spec"]["array"] = f"0-{BACKLOG // 2 - 1}"
            topology.api.submit({"jobs": [spec]}, path="/api/v1/jobs/batch", timeout=600, deadline_s=600)
        backlog_s = time.monotonic() - started
        wait_for(lambda: topology.pending("backlog") == BACKLOG, "the backlog to be pending", 60)
        wait_for(lambda: heartbeats.rounds >= 2, "two rounds of reports", 60)
        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        placement: list[float] = []
        accepted = []
        for _ in range(PLACEMENTS):
            t0 = time.monotonic()
            _, body, _ = topology.api.submit(job_spec(topology.project, seconds=1))
            latencies.append(time.monotonic() - t0)
            accepted.append(body["id"])
            query, job = "SELECT count(*) FROM scheduling_jobattempt WHERE job_id = %s", [body["id"]]
            wait_for(lambda q=query, j=job: topology.scalar(q, j), "the new job to be placed", 60, every=0.05)
            placement.append(time.monotonic() - t0)
        done.set()
        thread.join(30)
        cycle_ms = topology.scalar(
            "SELECT extract(epoch FROM now() - last_cycle_at) * 1000 FROM scheduling_schedulerstate"
        )
    finally:
        done.set()
        heartbeats.stop()
    figures = {
        "backlog": BACKLOG,
        "nodes": sum(len(c["nodes"]) for c in topology.seed["clusters"].values()),
        "backlog_submit_s": round(backlog_s, 1),
        "new_job_placement_s": {
            "p50": round(statistics.median(placement), 2),
            "max": round(max(placement), 2),
        },
        "api_s": {"calls": len(latencies), "p50": round(statistics.median(latencies), 3)},
        "reports": {"sent": heartbeats.sent, "accepted": heartbeats.accepted, "failed": heartbeats.failed},
        "since_last_cycle_ms": round(float(cycle_ms), 1),
    }
    figures["api_s"]["p99"] = round(percentile(latencies, 0.99), 3)
    print(json.dumps({"scale": figures}))
    with topology.cursor() as cursor:
        assert_invariants(cursor, accepted_jobs=accepted)
    assert len(placement) == PLACEMENTS, figures
    assert len(latencies) > PLACEMENTS, figures  # the listings answered while the jobs were placed
