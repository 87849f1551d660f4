#!/usr/bin/env python
"""GPU metrics benchmark: one scrape of ``/metrics/gpus`` (the DCGM exporter's names) over a
fleet of 10,000 nodes of 8 GPUs, every GPU with fresh telemetry.

    python benchmarks/gpu_metrics.py --nodes 10000 --gpus 8 --json

A throwaway PostgreSQL database, the fleet written with ``generate_series``. Reported (median
of ``--repeat`` runs):

* ``yardstick_query_s`` — the bare work: the scrape's SQL through a plain cursor, rows fetched,
  no Orrery code at all;
* ``rows_s`` — ``clusters.dcgm.fresh_gpu_rows`` (the same query through the ORM's
  ``values_list``), and ``rows_vs_yardstick``;
* ``exposition_s`` — writing the text format of those rows; ``bytes`` and ``series``;
* ``scrape_s`` — the whole page through Django's test client, scrape token and streaming
  included, and ``scrape_vs_yardstick``;
* ``power_plan_s`` — the power-saving page's plan over the same fleet (every node idle and ready:
  the most work it can have), for scale;
* ``prometheus_client_s`` (with ``--compare``) — the same samples through prometheus_client's
  own ``GaugeMetricFamily`` and ``generate_latest``, what a registry-based collector would cost;
* ``rss_mb``.

Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--compare", action="store_true", help="also time prometheus_client's exposition")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))

    from benchmarks.throwaway import throwaway_database

    with throwaway_database("orrery_gpumetrics"):
        result = run(args.nodes, args.gpus, args.repeat, args.compare, say)
        result["rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        print(json.dumps(result, indent=None if args.json else 2))


def build_fleet(nodes: int, gpus: int) -> None:
    """One cluster of ``nodes`` nodes with ``gpus`` H100s each, telemetry stamped now."""
    from django.db import connection

    from clusters.models import Cluster, GpuModel

    cluster = Cluster.objects.create(name="bench", kind="simulated", state="ready")
    model = GpuModel.objects.get(slug="h100-80g")
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO clusters_node (cluster_id, name, state, state_reason, state_changed_at,
                cpu_millicores_capacity, cpu_millicores_allocatable, memory_bytes_capacity,
                memory_bytes_allocatable, gpu_capacity, labels, rack, switch, nvlink_domain,
                agent_version, boot_id, power_state)
            SELECT %s, 'node' || lpad(i::text, 5, '0'), 'ready', '', now(), 64000, 64000, 0, 0, %s,
                '{}', '', '', '', '', '', 'on'
            FROM generate_series(1, %s) AS i
            """,
            [cluster.pk, gpus, nodes],
        )
        cursor.execute(
            """
            INSERT INTO clusters_gpudevice (node_id, index, uuid, model_id, memory_mb, health,
                health_reason, mig_enabled, shareable, topology_group, utilization, memory_used_mb,
                power_w, temperature_c, telemetry_at)
            SELECT n.id, g, 'GPU-' || md5(n.id::text || '-' || g::text), %s, 81559, 'healthy', '',
                false, false, '', (n.id * 7 + g) %% 101, (n.id + g) %% 81559, 80 + (n.id %% 600),
                30 + (g * 5 + n.id) %% 60, now()
            FROM clusters_node n, generate_series(0, %s) AS g WHERE n.cluster_id = %s
            """,
            [model.pk, gpus - 1, cluster.pk],
        )
        cursor.execute("ANALYZE clusters_node; ANALYZE clusters_gpudevice")


def run(nodes: int, gpus: int, repeat: int, compare: bool, say) -> dict:
    from django.conf import settings
    from django.db import connection
    from django.test import Client

    from clusters import dcgm

    say(f"building {nodes:,} nodes × {gpus} GPUs")
    build_fleet(nodes, gpus)
    sql, params = dcgm_query().query.sql_with_params()
    timings: dict[str, list[float]] = {"yardstick": [], "rows": [], "exposition": [], "scrape": []}
    settings.ORRERY_METRICS_TOKEN = "bench-" + "x" * 40
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
    client = Client()
    size = 0
    for _ in range(repeat):
        with connection.cursor() as cursor:
            started = time.perf_counter()
            cursor.execute(sql, params)
            cursor.fetchall()
            timings["yardstick"].append(time.perf_counter() - started)
        started = time.perf_counter()
        rows = dcgm.fresh_gpu_rows()
        timings["rows"].append(time.perf_counter() - started)
        started = time.perf_counter()
        text = "".join(dcgm.exposition(rows))
        timings["exposition"].append(time.perf_counter() - started)
        size = len(text.encode())
        started = time.perf_counter()
        answer = client.get("/metrics/gpus", HTTP_AUTHORIZATION=f"Bearer {settings.ORRERY_METRICS_TOKEN}")
        body = b"".join(answer.streaming_content)
        timings["scrape"].append(time.perf_counter() - started)
        assert answer.status_code == 200 and len(body) == size, (answer.status_code, len(body), size)
        say({k: round(v[-1], 3) for k, v in timings.items()})
    med = {k: statistics.median(v) for k, v in timings.items()}
    result = {
        "nodes": nodes,
        "gpus": nodes * gpus,
        "series": sum(1 for line in text.splitlines() if line and not line.startswith("#")),
        "bytes": size,
        "yardstick_query_s": round(med["yardstick"], 3),
        "rows_s": round(med["rows"], 3),
        "rows_vs_yardstick": round(med["rows"] / med["yardstick"], 2),
        "exposition_s": round(med["exposition"], 3),
        "scrape_s": round(med["scrape"], 3),
        "scrape_vs_yardstick": round(med["scrape"] / med["yardstick"], 2),
    }
    from clusters.services.power import power_plan

    started = time.perf_counter()
    power_plan()
    result["power_plan_s"] = round(time.perf_counter() - started, 3)
    if compare:
        result["prometheus_client_s"] = round(generic_exposition(rows), 3)
    return result


def dcgm_query():
    """The queryset ``fresh_gpu_rows`` runs, for the yardstick's SQL."""
    from datetime import timedelta

    from django.conf import settings
    from django.utils import timezone

    from clusters.dcgm import _LABEL_COLUMNS, GPU_METRICS
    from clusters.models import GpuDevice

    since = timezone.now() - timedelta(seconds=settings.ORRERY_TELEMETRY_STALE_S)
    columns = (*_LABEL_COLUMNS, *(column for _, _, column in GPU_METRICS))
    return GpuDevice.objects.filter(telemetry_at__gte=since).order_by().values_list(*columns)


def generic_exposition(rows: list) -> float:
    """Seconds prometheus_client takes for the same samples through a registered collector."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import GaugeMetricFamily

    from clusters.dcgm import GPU_METRICS, LABELS

    class Collector:
        def collect(self):
            families = [GaugeMetricFamily(name, text, labels=LABELS) for name, text, _ in GPU_METRICS]
            for row in rows:
                labels = [str(v) for v in row[: len(LABELS)]]
                for family, value in zip(families, row[len(LABELS) :], strict=True):
                    if value is not None:
                        family.add_metric(labels, value)
            return families

        def describe(self):
            return []

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    started = time.perf_counter()
    generate_latest(registry)
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
