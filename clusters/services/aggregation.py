"""The aggregation pass: from the heartbeat buffer to PostgreSQL in bulk.

Each pass takes the latest record of every node reported since the last pass and, in one
transaction,

1. upserts the slim ``NodeLastSeen`` rows and learns whose fingerprint changed — one statement
   on PostgreSQL — keeping ``good_since``, the start of the node's current run of on-time
   heartbeats (a gap longer than ``lifecycle.fresh_bound()`` starts a new run);
2. writes Node rows only for nodes whose boot or agent changed, and GpuDevice rows only for
   nodes whose GPU health changed;
3. adds the reports to the 1-minute and 1-hour roll-ups per cluster and GPU model;
4. stamps the flush watermark (``clusters.services.hearing``), empty passes included.

It reads the buffer's slim summaries (``records.summarise``), not the full reports.

Passes run one at a time across workers (a transaction-scoped advisory lock on PostgreSQL); a
pass that finds another running returns at once, having taken nothing.

If the pass fails, the nodes are marked dirty again: the next pass writes their latest record,
so nothing is lost. On PostgreSQL each step is one set-based statement over arrays
(``unnest``); on SQLite (the embedded default, small fleets) plain ``executemany``.

``sync_telemetry`` runs less often (every minute) and copies the latest telemetry of every node
and GPU onto their rows for the console and the API, and moves each GPU's exponential averages
of utilisation, memory used and temperature (what load-aware placement reads) towards it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, F, Q
from django.utils import timezone

from clusters import ports
from clusters.choices import GpuHealth
from clusters.ingest.buffer import HeartbeatBuffer, Record, get_buffer
from clusters.metrics import FLUSH_SECONDS, FLUSHED_NODES
from clusters.models import GpuDevice, MetricPoint, Node, NodeEvent, NodeLastSeen
from clusters.services.hearing import record_flush
from clusters.services.lifecycle import fresh_bound
from foundation.performance import collector_paused
from foundation.sql import ids_among, is_postgresql, pg_array, pg_text_array

log = logging.getLogger(__name__)
_CATALOG_TTL_S = 30.0
FLUSH_LOCK_KEY = 0x0_4EA7_B347  # pg advisory lock id of the aggregation pass


@dataclass(frozen=True)
class FlushResult:
    nodes: int
    changed: int
    points: int
    seconds: float


def _when(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=UTC)


def flush_heartbeats(buffer: HeartbeatBuffer | None = None) -> FlushResult:
    """One aggregation pass. Safe to run concurrently with ingest, and with itself: across
    processes one pass runs at a time, and one that finds another running takes nothing."""
    buffer = buffer or get_buffer()
    started = time.perf_counter()
    records: list[Record] = []
    changed, points = [], 0
    with collector_paused():
        try:
            with transaction.atomic():
                if not _one_pass_at_a_time():
                    return FlushResult(0, 0, 0, time.perf_counter() - started)
                records = buffer.take_dirty()
                if records:
                    changed = _write_last_seen(records)
                    _write_changed(changed)
                    points = _add_rollups(records)
                # An empty pass is a successful one too: the lifecycle needs to know the
                # control plane hears, not that someone spoke (clusters.services.hearing).
                record_flush()
        except Exception:
            if records:
                buffer.restore(r["n"] for r in records)
            raise
    elapsed = time.perf_counter() - started
    if not records:
        return FlushResult(0, 0, 0, elapsed)
    FLUSH_SECONDS.observe(elapsed)
    FLUSHED_NODES.inc(len(records))
    return FlushResult(len(records), len(changed), points, elapsed)


def _one_pass_at_a_time() -> bool:
    """Take the pass's advisory lock for this transaction; False if another pass holds it.

    Every ingest worker runs this task, and a pass over a large fleet can outlast the 2 s
    between two: two takes of the dirty set interleaving their ``RENAME`` would drop the marks
    of the first. A pass that finds the lock held does nothing (no watermark either): the
    holder's pass covers what was dirty, the next one what came since."""
    if not is_postgresql():
        return True  # the embedded default: one process, one aggregator
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [FLUSH_LOCK_KEY])
        return bool(cursor.fetchone()[0])


def _write_last_seen(records: list[Record]) -> list[tuple[Record, bool, bool]]:
    """Upsert liveness rows; returns ``(record, node facts changed, GPU facts changed)`` for the
    nodes whose fingerprint changed. A record older than the stored one is skipped (two API
    hosts, one slow); a record for a deleted node is dropped."""
    changed = _write_last_seen_postgres(records) if is_postgresql() else _write_last_seen_portable(records)
    by_id = {r["n"]: r for r in records}
    return [(by_id[n], node_changed, gpus_changed) for n, node_changed, gpus_changed in changed]


def _write_last_seen_postgres(records: list[Record]) -> list[tuple[int, bool, bool]]:
    # UPDATE … FROM the arrays, joined once more to the table as ``old``: RETURNING can then
    # compare the old fingerprint with the new one in the same statement. Rows are rewritten in
    # place (HOT: no indexed column changes). Nodes without a row yet — new ones — get an
    # INSERT, which is rare.
    params = [
        pg_array(r["n"] for r in records),
        pg_array(repr(r["t"]) for r in records),
        pg_text_array(r["b"] for r in records),
        pg_array(r["q"] for r in records),
        pg_text_array(r["fp"] for r in records),
    ]
    with connection.cursor() as cursor:
        cursor.execute(
            """
            UPDATE clusters_nodelastseen l SET
                seen_at = to_timestamp(v.t),
                good_since = CASE WHEN to_timestamp(v.t) - old.seen_at > make_interval(secs => %s)
                                  THEN to_timestamp(v.t) ELSE old.good_since END,
                boot_id = v.boot_id, seq = v.seq, fingerprint = v.fp
            FROM unnest(%s::bigint[], %s::float8[], %s::text[], %s::bigint[], %s::text[]) AS v(node_id, t, boot_id, seq, fp)
            JOIN clusters_nodelastseen old ON old.node_id = v.node_id
            WHERE l.node_id = v.node_id AND old.seen_at < to_timestamp(v.t) AND l.seen_at < to_timestamp(v.t)
            RETURNING l.node_id, left(old.fingerprint, 16) <> left(v.fp, 16), substr(old.fingerprint, 17) <> substr(v.fp, 17)
            """,
            [float(fresh_bound()), *params],
        )
        rows = cursor.fetchall()
        changed = [row for row in rows if row[1] or row[2]]
        if len(rows) < len(records):
            cursor.execute(
                """
                INSERT INTO clusters_nodelastseen (node_id, seen_at, good_since, boot_id, seq, fingerprint)
                SELECT v.node_id, to_timestamp(v.t), to_timestamp(v.t), v.boot_id, v.seq, v.fp
                FROM unnest(%s::bigint[], %s::float8[], %s::text[], %s::bigint[], %s::text[]) AS v(node_id, t, boot_id, seq, fp)
                JOIN clusters_node n ON n.id = v.node_id
                ON CONFLICT (node_id) DO NOTHING
                RETURNING node_id
                """,
                params,
            )
            changed += [(node_id, True, True) for (node_id,) in cursor.fetchall()]
        return changed


def _write_last_seen_portable(records: list[Record]) -> list[tuple[int, bool, bool]]:
    fresh = timedelta(seconds=fresh_bound())
    ids = [r["n"] for r in records]
    existing = set(Node.objects.filter(pk__in=ids).values_list("pk", flat=True))
    old = {row.node_id: row for row in NodeLastSeen.objects.filter(node_id__in=ids)}
    rows, changed = [], []
    for r in records:
        if r["n"] not in existing:
            continue
        seen, previous = _when(r["t"]), old.get(r["n"])
        if previous is not None and previous.seen_at >= seen:
            continue
        fresh_run = previous is None or seen - previous.seen_at > fresh
        rows.append(
            NodeLastSeen(
                node_id=r["n"],
                seen_at=seen,
                good_since=seen if fresh_run else previous.good_since,
                boot_id=r["b"],
                seq=r["q"],
                fingerprint=r["fp"],
            )
        )
        before = previous.fingerprint if previous else ""
        if before != r["fp"]:
            changed.append((r["n"], before[:16] != r["fp"][:16], before[16:] != r["fp"][16:]))
    NodeLastSeen.objects.bulk_create(
        rows,
        update_conflicts=True,
        unique_fields=["node"],
        update_fields=["seen_at", "good_since", "boot_id", "seq", "fingerprint"],
    )
    return changed


def _write_changed(changed: list[tuple[Record, bool, bool]]) -> None:
    """Node boot/agent facts, and GPU health, for the nodes whose facts changed."""
    nodes = [(r["n"], r["b"], r["av"]) for r, node_changed, _ in changed if node_changed]
    gpu_nodes = [r["n"] for r, _, gpus_changed in changed if gpus_changed]
    unhealthy = [(r["n"], bad) for r, _, gpus_changed in changed if gpus_changed for bad in r["bad"]]
    with connection.cursor() as cursor:
        for node_id, boot, agent in nodes if not is_postgresql() else ():
            cursor.execute(
                "UPDATE clusters_node SET boot_id = %s, agent_version = %s WHERE id = %s",
                [boot, agent, node_id],
            )
        if nodes and is_postgresql():
            cursor.execute(
                """
                UPDATE clusters_node n SET boot_id = v.boot_id, agent_version = v.agent_version
                FROM unnest(%s::bigint[], %s::text[], %s::text[]) AS v(id, boot_id, agent_version)
                WHERE n.id = v.id
                """,
                [
                    pg_array(n for n, _, _ in nodes),
                    pg_text_array(b for _, b, _ in nodes),
                    pg_text_array(a for _, _, a in nodes),
                ],
            )
    if gpu_nodes:
        _write_gpu_health(gpu_nodes, {(n, bad[0]): (bad[1], *bad[2:3]) for n, bad in unhealthy})


def _write_gpu_health(node_ids: list[int], unhealthy: dict[tuple[int, int], tuple[int | None, ...]]) -> None:
    """Set GPU health to what the nodes report, and log each change as a NodeEvent: the event
    log is how the scheduler's cache learns that a GPU may no longer (or may again) be used.
    ``unhealthy`` maps ``(node, index)`` to ``(XID,)`` or ``(XID, reason)``."""
    # Only rows that may change: GPUs not healthy now, and those of nodes reporting one that is
    # not. A fleet whose GPUs stay healthy reads none (a node's first report, or a reboot of
    # every node, would otherwise read every GPU of the fleet into Python to change nothing).
    bad_nodes = {node_id for node_id, _ in unhealthy}
    current = (
        GpuDevice.objects.filter(ids_among("node_id", node_ids))
        .filter(~Q(health=GpuHealth.HEALTHY) | Q(node_id__in=bad_nodes))
        .values_list("pk", "node_id", "index", "health", "health_reason")
    )
    changes: dict[int, list[str]] = defaultdict(list)
    for pk, node_id, index, health, current_reason in current:
        bad = (node_id, index) in unhealthy
        if bad:
            xid, *why = unhealthy[(node_id, index)]
            reason = why[0] if why and why[0] else "reported unhealthy"
            reason = f"{reason} (XID {xid})" if xid is not None else reason
        # A collector's reason may change while the GPU stays unusable (withdrawn, then held by
        # a pod): the row and the history follow it.
        if bad and (health != GpuHealth.UNHEALTHY or (why and reason != current_reason)):
            GpuDevice.objects.filter(pk=pk).update(
                health=GpuHealth.UNHEALTHY,
                health_reason=reason,
                last_xid=xid if xid is not None else F("last_xid"),
            )
            changes[node_id].append(f"GPU {index} {reason}")
        elif not bad and health != GpuHealth.HEALTHY:
            GpuDevice.objects.filter(pk=pk).update(health=GpuHealth.HEALTHY, health_reason="")
            changes[node_id].append(f"GPU {index} healthy again")
    if changes:
        states = dict(Node.objects.filter(pk__in=list(changes)).values_list("pk", "state"))
        NodeEvent.objects.bulk_create(
            NodeEvent(node_id=n, from_state=states[n], to_state=states[n], reason="; ".join(words)[:255])
            for n, words in changes.items()
            if n in states
        )


class _Catalog:
    """Per process, refreshed every 30 s: which model each GPU is, how many GPUs of each model a
    cluster has, and how many are allocated (asked of the ``gpu_allocation`` port, since what
    holds a GPU is the scheduling app's business)."""

    def __init__(self) -> None:
        self._at = 0.0
        self._lock = threading.Lock()
        self.models: dict[int, tuple[int, int]] = {}
        self.totals: dict[tuple[int, int], int] = {}
        self.allocated: dict[tuple[int, int], int] = {}

    def refresh(self, force: bool = False) -> _Catalog:
        if force or time.monotonic() - self._at > _CATALOG_TTL_S:
            with self._lock:
                # A node's roll-ups go to the model of its GPU 0: nodes rarely mix models, and
                # one row per node is a tenth of one per GPU.
                rows = GpuDevice.objects.filter(index=0).values_list(
                    "node_id", "node__cluster_id", "model_id"
                )
                self.models = {n: (c, m) for n, c, m in rows}
                self.totals = {
                    (row["node__cluster_id"], row["model_id"]): row["n"]
                    for row in GpuDevice.objects.values("node__cluster_id", "model_id").annotate(
                        n=Count("id")
                    )
                }
                self.allocated = ports.gpu_allocation()()
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
        key = catalog.models.get(r["n"])
        if key is None:
            missing = missing or bool(r["k"])
            continue
        entry = sums[key]
        entry[0] += r["k"]
        entry[1] += r["u"]
        entry[2] += r["p"]
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
    """Copy every node's latest telemetry onto its Node and GpuDevice rows, and fold each GPU's
    into its averages (``ema``); returns nodes. Running it twice on the same records changes no
    average: only a reading newer than the row's ``telemetry_at`` moves one."""
    latest = (buffer or get_buffer()).latest()
    if not latest:
        return 0
    records = list(latest.values())
    nodes = [(r["n"], _when(r["t"]), r["cpu"], r["mem"], r["pw"]) for r in records]
    gpus = [(r["n"], g[0], g[5], g[4], g[6], g[7], _when(r["t"])) for r in records for g in r["g"]]
    alpha, fresh = settings.ORRERY_TELEMETRY_EMA_ALPHA, settings.ORRERY_TELEMETRY_STALE_S
    with transaction.atomic(), connection.cursor() as cursor:
        if is_postgresql():
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
                    f"""
                    UPDATE clusters_gpudevice d SET utilization = v.util, memory_used_mb = v.mem, power_w = v.pw,
                        temperature_c = v.temp, telemetry_at = v.at,
                        utilization_avg = {_EMA_SQL.format(latest="v.util", avg="d.utilization_avg")},
                        memory_used_avg_mb = {_EMA_SQL.format(latest="v.mem", avg="d.memory_used_avg_mb")},
                        temperature_avg_c = {_EMA_SQL.format(latest="v.temp", avg="d.temperature_avg_c")}
                    FROM unnest(%s::bigint[], %s::int[], %s::float8[], %s::int[], %s::float8[], %s::float8[],
                                %s::timestamptz[]) AS v(node_id, idx, util, mem, pw, temp, at),
                         (SELECT %s::float8 AS alpha, make_interval(secs => %s) AS fresh) p
                    WHERE d.node_id = v.node_id AND d.index = v.idx
                    """,
                    [*(list(col) for col in zip(*gpus, strict=True)), alpha, fresh],
                )
        else:
            cursor.executemany(
                "UPDATE clusters_node SET last_heartbeat_at = %s, cpu_load = %s, memory_used_bytes = %s, "
                "power_w = %s WHERE id = %s",
                [(at, cpu, mem, pw, n) for n, at, cpu, mem, pw in nodes],
            )
            averages = _averages_portable(gpus, alpha, timedelta(seconds=fresh))
            cursor.executemany(
                "UPDATE clusters_gpudevice SET utilization = %s, memory_used_mb = %s, power_w = %s, "
                "temperature_c = %s, telemetry_at = %s, utilization_avg = %s, memory_used_avg_mb = %s, "
                'temperature_avg_c = %s WHERE node_id = %s AND "index" = %s',
                [
                    (u, m, p, t, at, *averages.get((n, i), (None, None, None)), n, i)
                    for n, i, u, m, p, t, at in gpus
                ],
            )
    return len(records)


# ``ema`` in SQL, for one column: ``{latest}`` is the new reading, ``{avg}`` the stored average;
# ``d.telemetry_at`` is the previous reading's time, ``v.at`` the new one's, ``p`` the settings.
_EMA_SQL = """CASE WHEN {latest} IS NULL THEN {avg}
                   WHEN {avg} IS NULL OR d.telemetry_at IS NULL OR v.at - d.telemetry_at > p.fresh THEN {latest}
                   WHEN v.at <= d.telemetry_at THEN {avg}
                   ELSE p.alpha * {latest} + (1 - p.alpha) * {avg} END"""


def ema(
    latest: float | None,
    average: float | None,
    at: datetime,
    previous_at: datetime | None,
    *,
    alpha: float,
    fresh: timedelta,
) -> float | None:
    """The exponential average after a reading ``latest`` taken at ``at``, the previous one
    having been taken at ``previous_at``: ``alpha · latest + (1 − alpha) · average``. A missing
    reading (None) leaves the average as it is, and so does one no newer than the previous
    (the same record synced twice). An average whose previous reading is older than ``fresh``
    describes a GPU as it was, not as it is: it starts again from ``latest``."""
    if latest is None:
        return average
    if average is None or previous_at is None or at - previous_at > fresh:
        return float(latest)
    if at <= previous_at:
        return average
    return alpha * latest + (1 - alpha) * average


def _averages_portable(
    gpus: list[tuple[int, int, Any, Any, Any, Any, datetime]], alpha: float, fresh: timedelta
) -> dict[tuple[int, int], tuple[float | None, float | None, float | None]]:
    """``{(node id, index): new averages}`` for ``gpus`` (the rows ``sync_telemetry`` writes),
    from one read of the stored averages."""
    stored = GpuDevice.objects.filter(node_id__in={g[0] for g in gpus}).values_list(
        "node_id", "index", "telemetry_at", "utilization_avg", "memory_used_avg_mb", "temperature_avg_c"
    )
    before = {(n, i): (at, averages) for n, i, at, *averages in stored}
    out = {}
    for n, i, util, mem, _, temp, at in gpus:
        previous_at, averages = before.get((n, i), (None, (None, None, None)))
        out[(n, i)] = tuple(
            ema(latest, avg, at, previous_at, alpha=alpha, fresh=fresh)
            for latest, avg in zip((util, mem, temp), averages, strict=True)
        )
    return out
