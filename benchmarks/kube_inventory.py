#!/usr/bin/env python
"""Kubernetes inventory benchmark: a 5,000-GPU-node cluster in the fake API server, read through
the official client by the informers and fed into Orrery's nodes and the scheduler's snapshot.

    python benchmarks/kube_inventory.py --nodes 5000 --changes 7 --json

A throwaway PostgreSQL database; the fake API server (``tests/kubefake``) on loopback with TLS,
its nodes registered as kubelets with GPU feature discovery would. Reported:

* ``yardstick_list_s`` — the bare work: LIST the same nodes in pages of 500 through the official
  client (``_preload_content=False``) and parse the JSON with orjson; no Orrery code at all;
* ``informer_sync_s`` — an informer started until its store holds every node (the same list,
  plus the store), and ``sync_vs_yardstick``;
* ``first_pass_s`` — the first inventory pass: 5,000 nodes and 40,000 GPUs created, heartbeats
  put and aggregated; ``onboard_s`` = sync + first pass, and ``onboard_vs_yardstick``;
* ``steady_pass_s`` — the median full pass once nothing changes (what the refresh every 10 s
  costs), and ``skipped_pass_ms`` — the median pass that finds the stores unchanged and returns
  (what the 2 s pace costs in between);
* ``event_ms_p50`` — a node cordoned in the server until the informer's store has it;
* ``time_to_see_s_p50``/``max`` — a node cordoned in the server until the scheduler's snapshot
  no longer offers it, passes run back to back (the periodic task adds up to its 2 s pace);
* ``rss_mb``.

The fake and the client share this process and the machine's cores, so the server's own work is
counted in every figure, the yardstick's included. Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--changes", type=int, default=7, help="cordons timed to the scheduler's snapshot")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))

    from benchmarks.throwaway import throwaway_database

    with throwaway_database("orrery_kubeinv"):
        result = run(args.nodes, args.changes, say)
        result["rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        print(json.dumps(result, indent=None if args.json else 2))


def run(nodes: int, changes: int, say) -> dict:
    from datetime import timedelta

    from django.conf import settings
    from django.db import transaction
    from django.db.models import F
    from django.utils import timezone
    from kubernetes import client

    from clusters.adapters.kubernetes.informer import Informer, forget_all
    from clusters.adapters.kubernetes.inventory import _last_pass, informers_for, take_inventory
    from clusters.models import Cluster, NodeLastSeen
    from clusters.services.aggregation import flush_heartbeats
    from clusters.services.lifecycle import run_node_lifecycle
    from scheduling.engine.cache import SchedulerCache
    from tests.kubefake.server import FakeKube

    def inventory_pass(cluster: Cluster, api: client.ApiClient) -> None:
        with transaction.atomic():
            take_inventory(cluster, api)
        flush_heartbeats()

    with FakeKube() as fake:
        say(f"registering {nodes} GPU nodes in the fake")
        for i in range(nodes):
            fake.add_gpu_node(f"gpu-{i:05}")
        configuration = client.Configuration()
        configuration.host = fake.url
        configuration.ssl_ca_cert = fake.ca_file
        configuration.api_key = {"authorization": f"Bearer {fake.token_for('admin')}"}
        api = client.ApiClient(configuration)
        core = client.CoreV1Api(api)

        say("yardstick: bare paged LIST + orjson")
        yardsticks = []
        for _ in range(3):
            began = time.perf_counter()
            token, count = None, 0
            while True:
                response = core.list_node(limit=500, _continue=token, _preload_content=False)
                body = orjson.loads(response.data)
                count += len(body["items"])
                token = body["metadata"].get("continue")
                if not token:
                    break
            yardsticks.append(time.perf_counter() - began)
            assert count == nodes
        yardstick = statistics.median(yardsticks)

        say("informer sync")
        syncs = []
        for _ in range(3):
            began = time.perf_counter()
            informer = Informer(core.list_node).start()
            informer.wait_synced(300)
            syncs.append(time.perf_counter() - began)
            assert len(informer.objects()) == nodes
            informer.stop()
        sync = statistics.median(syncs)

        cluster = Cluster.objects.create(name="kube-bench", kind="kubernetes", state="ready")
        say("first inventory pass")
        began = time.perf_counter()
        informers_for(cluster, api)[0].wait_synced(300)
        registry_sync = time.perf_counter() - began
        began = time.perf_counter()
        inventory_pass(cluster, api)
        first_pass = time.perf_counter() - began
        # the nodes have reported on time for NODE_RECOVERY seconds, up to now: they are ready
        NodeLastSeen.objects.update(good_since=F("seen_at") - timedelta(seconds=settings.NODE_RECOVERY + 1))
        run_node_lifecycle(timezone.now())

        steady, skipped = [], []
        for _ in range(5):
            _last_pass.clear()  # forget the last full pass: this one refreshes every node
            began = time.perf_counter()
            inventory_pass(cluster, api)
            steady.append(time.perf_counter() - began)
            began = time.perf_counter()
            inventory_pass(cluster, api)  # nothing changed since: returns at once
            skipped.append(time.perf_counter() - began)

        cache = SchedulerCache()
        snap = cache.ensure()
        node_informer = informers_for(cluster, api)[0]
        events, seen = [], []
        rows = dict(cluster.nodes.values_list("name", "pk"))
        for n in range(changes):
            name = f"gpu-{(n * 997 + 13) % nodes:05}"
            row = snap.row_of[rows[name]]
            before = node_informer.changes
            began = time.perf_counter()
            fake.cordon(name)
            node_informer.wait_for_change(before, 30)
            events.append(time.perf_counter() - began)
            while cache.ensure().ready[row]:
                inventory_pass(cluster, api)
            seen.append(time.perf_counter() - began)
        forget_all()
        api.close()

    return {
        "nodes": nodes,
        "gpus": nodes * 8,
        "yardstick_list_s": round(yardstick, 3),
        "informer_sync_s": round(sync, 3),
        "sync_vs_yardstick": round(sync / yardstick, 2),
        "registry_sync_s": round(registry_sync, 3),
        "first_pass_s": round(first_pass, 3),
        "onboard_s": round(sync + first_pass, 3),
        "onboard_vs_yardstick": round((sync + first_pass) / yardstick, 2),
        "steady_pass_s": round(statistics.median(steady), 3),
        "skipped_pass_ms": round(statistics.median(skipped) * 1000, 2),
        "event_ms_p50": round(statistics.median(events) * 1000, 1),
        "time_to_see_s_p50": round(statistics.median(seen), 3),
        "time_to_see_s_max": round(max(seen), 3),
        "changes": changes,
    }


if __name__ == "__main__":
    main()
