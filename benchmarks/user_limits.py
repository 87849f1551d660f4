#!/usr/bin/env python
"""What per-user limits cost the decide phase: one cycle, in memory, with and without them.

    python benchmarks/user_limits.py --json

A fleet of ``--nodes`` 8-GPU nodes (two models, four clusters) and ``--jobs`` pending jobs
(1, 2, 4 or 8 GPUs, two time limits) of ``--owners`` users in four queues; one cycle places up
to ``--per-cycle`` jobs. Each configuration is decided ``--repeats`` times on a fresh world and
the least process time is kept (the decide phase alone: no database):

* ``without_plugins`` — the default profile less ``user_limits`` and ``array_throttle``;
* ``no_limits`` — the default profile, no queue with limits: what the plugins cost when unused;
* ``limits_habits`` — two of the four queues limit users; each user submits two shapes of
  their own (the usual case: classes barely split);
* ``limits_uniform`` — the same limits, every user submitting every shape (the worst case:
  one class per owner and shape in the limited queues).

The yardstick is ``without_plugins``, the same cycle without the two plugins, decided in turn with
the others (each repeat decides every configuration once). Printed: per configuration the
milliseconds, placements, classes and ``vs_yardstick`` (its time ÷ the yardstick's). Nothing is
asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CONFIGS = ("without_plugins", "no_limits", "limits_habits", "limits_uniform")


def world(config: str, nodes: int, jobs: int, owners: int, seed: int):  # -> SchedulerCache
    from scheduling.engine.cache import SchedulerCache
    from scheduling.engine.framework import JobView
    from scheduling.engine.queue import PendingQueue
    from scheduling.engine.snapshot import Snapshot

    rnd = random.Random(seed)
    snap = Snapshot(
        node_id=np.arange(1, nodes + 1, dtype=np.int64),
        cluster=np.arange(nodes, dtype=np.int32) % 4,
        model=np.arange(nodes, dtype=np.int32) % 2,
        ready=np.ones(nodes, dtype=bool),
        gpu_total=np.full(nodes, 8, dtype=np.int32),
        gpu_free=np.full(nodes, 8, dtype=np.int32),
        free_bits=np.full(nodes, 255, dtype=np.uint64),
        cpu_free=np.full(nodes, 128_000, dtype=np.int64),
        mem_free=np.full(nodes, 2**40, dtype=np.int64),
        cluster_ids=[1, 2, 3, 4],
        cluster_names=["a", "b", "c", "d"],
        model_ids=[1, 2],
        model_names=["h100-80g", "a100-80g"],
        gpu_ids=[{i: 8 * r + i for i in range(8)} for r in range(nodes)],
        groups=[{} for _ in range(nodes)],
        labels=[{} for _ in range(nodes)],
        names=[f"n{r}" for r in range(nodes)],
    )
    limited = config.startswith("limits")
    if limited:
        snap.limits.max_jobs |= {1: 200, 2: 100}
        snap.limits.max_gpus |= {1: 400}

    def shape() -> tuple[int, int, float, int]:
        return rnd.choice([1, 2, 4, 8]), rnd.choice([0, 1]), rnd.choice([3600.0, 14400.0]), rnd.randint(1, 4)

    habits = {o: [shape(), shape()] for o in range(1, owners + 1)}
    views = []
    for i in range(jobs):
        owner = rnd.randint(1, owners)
        gpus, model, limit, queue = rnd.choice(habits[owner]) if config != "limits_uniform" else shape()
        views.append(
            JobView(
                id=i + 1,
                queue_id=queue,
                project_id=queue,
                priority=rnd.randint(0, 3),
                submitted_at=float(i),
                nodes=1,
                gpus=gpus,
                model=model,
                cpu=1000,
                memory=0,
                time_limit=limit,
                owner=owner,
                per_user=snap.limits.limits_users(queue),
            )
        )
    cache = SchedulerCache()
    cache.snap = snap
    cache.queue = PendingQueue()
    cache.queue.load(views)
    return cache


def measure_once(config: str, args: argparse.Namespace, repeat: int) -> tuple[float, int, int]:
    """One decide of a fresh world: (process seconds, placed, classes)."""
    from scheduling.engine.cycle.decide import decide
    from scheduling.engine.policies import DEFAULT_PROFILE, build_profile

    plugins = DEFAULT_PROFILE["plugins"]
    if config == "without_plugins":
        plugins = [p for p in plugins if p not in ("user_limits", "array_throttle")]
    profile = build_profile(DEFAULT_PROFILE | {"plugins": plugins})
    queues = {q: (0, 1.0, q) for q in (1, 2, 3, 4)}
    cache = world(config, args.nodes, args.jobs, args.owners, args.seed + repeat)
    started = time.process_time()
    decided = decide(profile, cache, cache.snap, 1, args.per_cycle, queues=queues, now=1e9, policies={})
    return time.process_time() - started, len(decided.placements), len(cache.queue.classes)


def measure(args: argparse.Namespace) -> dict:
    """Every configuration once per repeat, in turn, so that the yardstick (``without_plugins``)
    is sampled between the others; least time per configuration, ratios to the yardstick's."""
    runs: dict[str, list[tuple[float, int, int]]] = {config: [] for config in CONFIGS}
    for repeat in range(args.repeats):
        for config in CONFIGS:
            runs[config].append(measure_once(config, args, repeat))
    yardstick = min(seconds for seconds, _, _ in runs["without_plugins"])
    result = {}
    for config, samples in runs.items():
        best = min(seconds for seconds, _, _ in samples)
        _, placed, classes = samples[-1]
        result[config] = {
            "ms": round(best * 1000, 1),
            "placed": placed,
            "classes": classes,
            "vs_yardstick": round(best / yardstick, 2),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--owners", type=int, default=20)
    parser.add_argument("--per-cycle", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    os.environ.pop("REDIS_URL", None)
    import django

    django.setup()
    result = {"nodes": args.nodes, "jobs": args.jobs, "owners": args.owners, "per_cycle": args.per_cycle}
    result |= measure(args)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
