"""The aggregation pass: from the heartbeat buffer to PostgreSQL in bulk (DESIGN.md §2).

Each pass takes the latest record of every node reported since the last pass and, in one
transaction,

1. upserts the slim ``NodeLastSeen`` rows (one statement), keeping ``good_since`` — the start of
   the node's current run of on-time heartbeats — and a fingerprint of its slow-changing facts;
2. writes Node and GpuDevice rows only for nodes whose fingerprint changed (a reboot, a new
   agent version, a GPU turning unhealthy): one statement per table;
3. adds the reports to the 1-minute and 1-hour roll-ups per cluster and GPU model.

If the pass fails, the nodes are marked dirty again: the next pass writes their latest record,
so nothing is lost. On PostgreSQL each step is one set-based statement over arrays
(``unnest``); on SQLite (the embedded default, small fleets) plain ``executemany``.

``sync_telemetry`` runs less often (every minute) and copies the latest telemetry of every node
and GPU onto their rows for the console and the API.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count
from django.utils import timezone
from django.utils.module_loading import import_string

from clusters.choices import GpuHealth
from clusters.ingest.buffer import HeartbeatBuffer, Record, get_buffer
from clusters.metrics import FLUSH_SECONDS, FLUSHED_NODES
from clusters.models import GpuDevice, MetricPoint

log = logging.getLogger(__name__)
_CATALOG_TTL_S = 30.0


@dataclass(frozen=True)
class FlushResult:
    nodes: int
    changed: int
    points: int
    seconds: float


def fingerprint(record: Record) -> str:
    """A hash of what rarely changes about a node: boot, agent version, each GPU's identity and
    health. Telemetry is left out on purpose — it changes with every report."""
    facts = [record["b"], record["av"], [[g[0], g[2], g[3], g[8], g[9]] for g in record["g"]]]
    return hashlib.blake2b(orjson.dumps(facts), digest_size=8).hexdigest()


def _when(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=UTC)


def flush_heartbeats(buffer: HeartbeatBuffer | None = None) -> FlushResult:
    """One aggregation pass. Safe to run concurrently with ingest; run one at a time."""
    buffer = buffer or get_buffer()
    started = time.perf_counter()
    records = buffer.take_dirty()
    if not records:
        return FlushResult(0, 0, 0, time.perf_counter() - started)
    try:
        with transaction.atomic():
            changed = _write_last_seen(records)
            _write_changed(changed)
            points = _add_rollups(records)
    except Exception:
        buffer.restore(r["n"] for r in records)
        raise
    elapsed = time.perf_counter() - started
    FLUSH_SECONDS.observe(elapsed)
    FLUSHED_NODES.inc(len(records))
    return FlushResult(len(records), len(changed), points, elapsed)


def _write_last_seen(records: list[Record]) -> list[Record]:
    """Upsert liveness rows; returns the records whose fingerprint changed."""
    grace = timedelta(seconds=settings.NODE_GRACE)
    ids = [r["n"] for r in records]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT l.node_id, l.seen_at, l.good_since, l.fingerprint FROM clusters_nodelastseen l "
                "WHERE l.node_id = ANY(%s)",
                [ids],
            )
        else:
            cursor.execute(
                "SELECT node_id, seen_at, good_since, fingerprint FROM clusters_nodelastseen "
                f"WHERE node_id IN ({','.join(['%s'] * len(ids))})",
                ids,
            )
        old = {row[0]: row[1:] for row in cursor.fetchall()}
    rows, changed = [], []
    for r in records:
        seen = _when(r["t"])
        previous = old.get(r["n"])
        if previous is not None and _aware(previous[0]) >= seen:
            continue  # an older report than what is stored (two API hosts, one slow)
        good_since = seen if previous is None or seen - _aware(previous[0]) > grace else _aware(previous[1])
        fp = fingerprint(r)
        if previous is None or previous[2] != fp:
            changed.append(r)
        rows.append((r["n"], seen, good_since, r["b"], r["q"], fp))
    if not rows:
        return changed
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                """
                INSERT INTO clusters_nodelastseen (node_id, seen_at, good_since, boot_id, seq, fingerprint)
                SELECT u.* FROM unnest(%s::bigint[], %s::timestamptz[], %s::timestamptz[], %s::text[],
                                       %s::bigint[], %s::text[]) AS u(node_id, seen_at, good_since, boot_id, seq, fp)
                JOIN clusters_node n ON n.id = u.node_id
                ON CONFLICT (node_id) DO UPDATE SET seen_at = EXCLUDED.seen_at, good_since = EXCLUDED.good_since,
                    boot_id = EXCLUDED.boot_id, seq = EXCLUDED.seq, fingerprint = EXCLUDED.fingerprint
                """,
                [list(col) for col in zip(*rows, strict=True)],
            )
        else:
            cursor.executemany(
                """
                INSERT INTO clusters_nodelastseen (node_id, seen_at, good_since, boot_id, seq, fingerprint)
                SELECT %s, %s, %s, %s, %s, %s WHERE EXISTS (SELECT 1 FROM clusters_node WHERE id = %s)
                ON CONFLICT (node_id) DO UPDATE SET seen_at = excluded.seen_at, good_since = excluded.good_since,
                    boot_id = excluded.boot_id, seq = excluded.seq, fingerprint = excluded.fingerprint
                """,
                [(*row, row[0]) for row in rows],
            )
    return changed


def _aware(value: datetime | str) -> datetime:
    if isinstance(value, str):  # SQLite hands back text
        value = datetime.fromisoformat(value)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _write_changed(records: list[Record]) -> None:
    """Node boot/agent facts and GPU health, for the nodes whose facts changed."""
    if not records:
        return
    nodes = [(r["n"], r["b"], r["av"]) for r in records]
    gpus = [
        (r["n"], g[0], g[8], g[9], "" if g[8] == GpuHealth.HEALTHY else _health_reason(g))
        for r in records
        for g in r["g"]
    ]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                """
                UPDATE clusters_node n SET boot_id = v.boot_id, agent_version = v.agent_version
                FROM unnest(%s::bigint[], %s::text[], %s::text[]) AS v(id, boot_id, agent_version)
                WHERE n.id = v.id AND (n.boot_id, n.agent_version) IS DISTINCT FROM (v.boot_id, v.agent_version)
                """,
                [list(col) for col in zip(*nodes, strict=True)],
            )
            if gpus:
                cursor.execute(
                    """
                    UPDATE clusters_gpudevice d SET health = v.health, last_xid = COALESCE(v.xid, d.last_xid),
                        health_reason = v.reason
                    FROM unnest(%s::bigint[], %s::int[], %s::text[], %s::int[], %s::text[])
                        AS v(node_id, idx, health, xid, reason)
                    WHERE d.node_id = v.node_id AND d.index = v.idx
                      AND (d.health, d.health_reason, d.last_xid) IS DISTINCT FROM
                          (v.health, v.reason, COALESCE(v.xid, d.last_xid))
                    """,
                    [list(col) for col in zip(*gpus, strict=True)],
                )
        else:
            cursor.executemany(
                "UPDATE clusters_node SET boot_id = %s, agent_version = %s WHERE id = %s",
                [(b, av, n) for n, b, av in nodes],
            )
            cursor.executemany(
                "UPDATE clusters_gpudevice SET health = %s, last_xid = COALESCE(%s, last_xid), health_reason = %s "
                'WHERE node_id = %s AND "index" = %s',
                [(h, x, reason, n, i) for n, i, h, x, reason in gpus],
            )


def _health_reason(gpu: list[Any]) -> str:
    return f"reported unhealthy (XID {gpu[9]})" if gpu[9] is not None else "reported unhealthy"


class _Catalog:
    """Per process, refreshed every 30 s: which model each GPU is, how many GPUs of each model a
    cluster has, and how many are allocated (asked of ``ORRERY_GPU_ALLOCATION``, since what
    holds a GPU is the scheduling app's business)."""

    def __init__(self) -> None:
        self._at = 0.0
        self._lock = threading.Lock()
        self.models: dict[tuple[int, int], tuple[int, int]] = {}
        self.totals: dict[tuple[int, int], int] = {}
        self.allocated: dict[tuple[int, int], int] = {}

    def refresh(self, force: bool = False) -> _Catalog:
        if force or time.monotonic() - self._at > _CATALOG_TTL_S:
            with self._lock:
                rows = GpuDevice.objects.values_list("node_id", "index", "node__cluster_id", "model_id")
                self.models = {(n, i): (c, m) for n, i, c, m in rows}
                self.totals = {
                    (row["node__cluster_id"], row["model_id"]): row["n"]
                    for row in GpuDevice.objects.values("node__cluster_id", "model_id").annotate(
                        n=Count("id")
                    )
                }
                self.allocated = import_string(settings.ORRERY_GPU_ALLOCATION)()
                self._at = time.monotonic()
        return self


_catalog = _Catalog()


def forget_catalog() -> None:
    _catalog._at = 0.0


def _add_rollups(records: list[Record]) -> int:
    catalog = _catalog.refresh()
    sums: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    missing = False
    for r in records:
        for g in r["g"]:
            key = catalog.models.get((r["n"], g[0]))
            if key is None:
                missing = True
                continue
            entry = sums[key]
            entry[0] += 1
            entry[1] += g[5] or 0.0
            entry[2] += g[6] or 0.0
    if missing:
        catalog.refresh(force=True)
    if not sums:
        return 0
    now = timezone.now()
    minute = now.replace(second=0, microsecond=0)
    hour = minute.replace(minute=0)
    rows = []
    for (cluster_id, model_id), (samples, util, power) in sums.items():
        total = catalog.totals.get((cluster_id, model_id), 0)
        allocated = min(catalog.allocated.get((cluster_id, model_id), 0), total)
        for resolution, at in ((MetricPoint.Resolution.MINUTE, minute), (MetricPoint.Resolution.HOUR, hour)):
            rows.append((cluster_id, model_id, resolution, at, samples, total, allocated, util, power))
    with connection.cursor() as cursor:
        cursor.executemany(
            """
            INSERT INTO clusters_metricpoint (cluster_id, gpu_model_id, resolution, at, samples, gpus_total,
                                              gpus_allocated, utilization_sum, power_w_sum)
            VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)
            ON CONFLICT (cluster_id, gpu_model_id, resolution, at) DO UPDATE SET
                samples = clusters_metricpoint.samples + excluded.samples,
                utilization_sum = clusters_metricpoint.utilization_sum + excluded.utilization_sum,
                power_w_sum = clusters_metricpoint.power_w_sum + excluded.power_w_sum,
                gpus_total = excluded.gpus_total, gpus_allocated = excluded.gpus_allocated
            """,
            rows,
        )
    return len(rows)


def prune_metrics(now: datetime | None = None) -> int:
    """Drop 1-minute points older than 24 h and 1-hour points older than 30 days."""
    now = now or timezone.now()
    deleted, _ = MetricPoint.objects.filter(
        resolution=MetricPoint.Resolution.MINUTE, at__lt=now - timedelta(hours=24)
    ).delete()
    more, _ = MetricPoint.objects.filter(
        resolution=MetricPoint.Resolution.HOUR, at__lt=now - timedelta(days=30)
    ).delete()
    return deleted + more


def sync_telemetry(buffer: HeartbeatBuffer | None = None) -> int:
    """Copy every node's latest telemetry onto its Node and GpuDevice rows; returns nodes."""
    latest = (buffer or get_buffer()).latest()
    if not latest:
        return 0
    records = list(latest.values())
    nodes = [(r["n"], _when(r["t"]), r["cpu"], r["mem"], r["pw"]) for r in records]
    gpus = [(r["n"], g[0], g[5], g[4], g[6], g[7], _when(r["t"])) for r in records for g in r["g"]]
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                """
                UPDATE clusters_node n SET last_heartbeat_at = v.at, cpu_load = v.cpu, memory_used_bytes = v.mem,
                    power_w = v.pw
                FROM unnest(%s::bigint[], %s::timestamptz[], %s::float8[], %s::bigint[], %s::float8[])
                    AS v(id, at, cpu, mem, pw)
                WHERE n.id = v.id
                """,
                [list(col) for col in zip(*nodes, strict=True)],
            )
            if gpus:
                cursor.execute(
                    """
                    UPDATE clusters_gpudevice d SET utilization = v.util, memory_used_mb = v.mem, power_w = v.pw,
                        temperature_c = v.temp, telemetry_at = v.at
                    FROM unnest(%s::bigint[], %s::int[], %s::float8[], %s::int[], %s::float8[], %s::float8[],
                                %s::timestamptz[]) AS v(node_id, idx, util, mem, pw, temp, at)
                    WHERE d.node_id = v.node_id AND d.index = v.idx
                    """,
                    [list(col) for col in zip(*gpus, strict=True)],
                )
        else:
            cursor.executemany(
                "UPDATE clusters_node SET last_heartbeat_at = %s, cpu_load = %s, memory_used_bytes = %s, "
                "power_w = %s WHERE id = %s",
                [(at, cpu, mem, pw, n) for n, at, cpu, mem, pw in nodes],
            )
            cursor.executemany(
                "UPDATE clusters_gpudevice SET utilization = %s, memory_used_mb = %s, power_w = %s, "
                'temperature_c = %s, telemetry_at = %s WHERE node_id = %s AND "index" = %s',
                [(u, m, p, t, at, n, i) for n, i, u, m, p, t, at in gpus],
            )
    return len(records)


def node_ids_of(records: Iterable[Record]) -> list[int]:
    return [r["n"] for r in records]
