#!/usr/bin/env python
"""Scheduling policies compared on replayed workloads: FIFO, backfill, backfill + preemption.

    python benchmarks/policies.py --json

Each policy is the real scheduler (``scheduling.engine.replay``: the decide phase, its plugins
and the cache, in virtual time on a simulated fleet) with a different profile:

* ``fifo`` — priority order as before backfill: nothing is held for a blocked job (predicted
  starts are still computed, with no reservation behind them);
* ``backfill`` — reservations for the first 16 blocked jobs, backfill around them;
* ``backfill_preemption`` — the same, and queues may preempt (lower priority within a queue,
  any priority up to their own to reclaim quota they lent their cohort).

Three workloads, each replayed under every policy:

* ``synthetic`` — a trace shaped like shared GPU clusters' (most jobs 1 GPU, a tail of 8-GPU
  and multi-node jobs, heavy-tailed run times, time limits longer than run times, 10 % urgent
  jobs, 20 % any-model requests), two queues lending each other quota, offered load 0.95;
* ``stress`` — a 64-GPU gang (8 nodes × 8) arriving, at a higher priority, into a fleet kept
  full by a stream of 1-GPU jobs: ``gang_wait_s``;
* ``reclaim`` — queue B borrows all of queue A's idle quota with long jobs; then A asks for its
  quota back: ``reclaim_s`` is how long until A holds it.

Printed: one JSON object with a key per policy (utilisation, waits by size class, gang wait,
preemptions, preempted GPU-seconds, predicted-start error median and p90, reclaim time), and at
the top level ``reclaim_s`` (with preemption) and ``placements_ratio_with_policies``: the
scheduler benchmark (``benchmarks/scheduler.py``, on PostgreSQL) run twice in this run, with
backfill and preemption on and off, its placements per second on ÷ off — each with its own
numpy yardstick — and the same for its no-capacity cycle. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def profile_for(policy: str):  # -> Profile
    from scheduling.engine.replay import policy_profile

    return policy_profile(policy)


def queues_for(policy: str, quota: dict[int, int], ids=(1, 2)):
    from scheduling.engine.replay import policy_queues

    return policy_queues(policy, quota, ids)


def synthetic(policy: str, hours: float, seed: int) -> dict:
    from scheduling.engine.replay import Fleet, Replay, synthetic_trace

    fleet = Fleet()
    per_model = fleet.total_gpus // len(fleet.models)
    replay = Replay(fleet, profile_for(policy), queues_for(policy, {0: per_model // 2, 1: per_model // 2}))
    trace = synthetic_trace(fleet, hours=hours, seed=seed, load=1.1)
    started = time.perf_counter()
    figures = replay.run(trace)
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    figures["virtual_s_per_wall_s"] = round(hours * 3600 / max(figures["wall_s"], 1e-3))
    return figures


def stress(policy: str, hours: float, seed: int) -> dict:
    """A fleet kept full of short 1-GPU jobs (run times log-normal around 20 minutes, at most 2
    hours; limits up to twice that, at most 4 hours: a backlog at t=0, then arrivals at 1.5 ×
    capacity), and after half an hour a 64-GPU gang of a higher priority."""
    import math
    import random

    from scheduling.engine.replay import Fleet, Replay, TraceJob

    fleet = Fleet(nodes=16, models=("h100-80g",))
    replay = Replay(fleet, profile_for(policy), queues_for(policy, {}, ids=(1,)))
    rnd = random.Random(seed)

    def small(job_id: int, at: float) -> TraceJob:
        run = min(math.exp(rnd.gauss(math.log(1200), 1.0)), 7200.0)
        return TraceJob(
            job_id, at, 1, 1, 1, 0, run, float(min(math.ceil(run / rnd.uniform(0.5, 0.9) / 900) * 900, 14400))
        )

    jobs = [small(10**5 + i, 0.0) for i in range(fleet.total_gpus * 2)]
    mean_run = sum(j.runtime for j in jobs) / len(jobs)
    rate, at = 1.5 * fleet.total_gpus / mean_run, 0.0
    while (at := at + rnd.expovariate(rate)) < hours * 3600:
        jobs.append(small(len(jobs) + 1, at))
    gang = TraceJob(10**6, 1800.0, 1, 8, 8, 0, 3600.0, 7200.0, priority=10)
    figures = replay.run([*jobs, gang], until=hours * 3600 * 3)
    wait = replay.wait_of(gang.id)
    return {
        "gang_wait_s": round(wait, 1) if wait is not None else None,
        "gang_started": wait is not None,
        "preemptions": figures["preemptions"],
        "utilisation": figures["utilisation"],
    }  # fmt: skip


def reclaim(policy: str) -> dict:
    from scheduling.engine.replay import Fleet, Replay, TraceJob

    fleet = Fleet(clusters=("sim-a",), nodes=32, models=("h100-80g",))
    replay = Replay(fleet, profile_for(policy), queues_for(policy, {0: 128}))
    borrower = [TraceJob(i, float(i), 2, 1, 8, 0, 6 * 3600.0, 8 * 3600.0) for i in range(1, 33)]
    lender = [TraceJob(100 + i, 600.0, 1, 1, 8, 0, 3600.0, 7200.0) for i in range(16)]
    replay.watch_reclaim(1, 0, 128, since=600.0)
    replay.run([*borrower, *lender], until=12 * 3600.0)
    got = replay.reclaimed.get((1, 0))
    return {"reclaim_s": round(got, 1) if got is not None else None}


def scheduler_ratio(nodes: int, jobs: int) -> dict:
    """The scheduler benchmark with policies off and on, in this run."""
    runs = {}
    for mode in ("off", "on"):
        out = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "scheduler.py"), "--nodes", str(nodes), "--jobs", str(jobs),
             "--policies", mode, "--json"],
            capture_output=True, text=True, check=True, env=os.environ.copy(),
        )  # fmt: skip
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    on, off = runs["on"], runs["off"]
    return {
        "placements_ratio_with_policies": round(on["placements_per_s"] / off["placements_per_s"], 3),
        "no_capacity_ratio_with_policies": round(on["no_capacity_cycle_ms"] / max(off["no_capacity_cycle_ms"], 0.01), 3),
        "scheduler": {
            mode: {
                k: r.get(k)
                for k in ("placements_per_s", "limit_placements_per_s", "no_capacity_cycle_ms", "placed", "invariants_ok")
            }
            | {"placements_vs_yardstick": round(r["placements_per_s"] / r["limit_placements_per_s"], 4)}
            for mode, r in runs.items()
        },
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=8.0, help="fleet time of the synthetic trace")
    parser.add_argument(
        "--stress-hours", type=float, default=8.0, help="how long the stream of 1-GPU jobs lasts"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--scheduler-nodes", type=int, default=10_000)
    parser.add_argument("--scheduler-jobs", type=int, default=100_000)
    parser.add_argument("--no-scheduler", action="store_true", help="skip the scheduler benchmark ratio")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    os.environ.setdefault("ORRERY_LOG_LEVEL", "WARNING")
    import django

    django.setup()
    result: dict = {}
    from scheduling.engine.replay import POLICIES

    for policy in POLICIES:
        say(f"{policy}: synthetic trace")
        figures = synthetic(policy, args.hours, args.seed)
        say(f"{policy}: stress (64-GPU gang)")
        gang = stress(policy, args.stress_hours, args.seed)
        figures["gang_wait_s"] = gang["gang_wait_s"]
        figures["gang_started"] = gang["gang_started"]
        figures["stress"] = gang
        say(f"{policy}: reclaim")
        figures.update(reclaim(policy))
        result[policy] = figures
    result["reclaim_s"] = result["backfill_preemption"]["reclaim_s"]
    result["reclaim_bound_s"] = 30 + 1.0  # one grace period plus one cycle
    if not args.no_scheduler:
        say("scheduler benchmark, policies off then on")
        result.update(scheduler_ratio(args.scheduler_nodes, args.scheduler_jobs))
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
