"""The aggregation pass: the database ends equal to the last report of every node."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from clusters.choices import GpuHealth
from clusters.ingest.buffer import get_buffer
from clusters.models import GpuDevice, MetricPoint, Node, NodeLastSeen
from clusters.services import aggregation
from clusters.services.aggregation import flush_heartbeats, prune_metrics, sync_telemetry
from tests.factories import make_cluster, make_node

pytestmark = pytest.mark.django_db


def record(
    node: Node,
    seq: int,
    *,
    t: float | None = None,
    boot: str = "b1",
    health: str = "healthy",
    util: float = 50.0,
    xid: int | None = None,
    agent: str = "0.1",
) -> dict:
    gpus = [
        [
            i,
            "",
            "h100",
            81559,
            1000 + seq,
            util,
            300.0,
            55.0,
            health if i == 0 else "healthy",
            xid if i == 0 else None,
        ]
        for i in range(node.gpu_capacity)
    ]
    return {
        "n": node.pk,
        "c": node.cluster_id,
        "b": boot,
        "q": seq,
        "t": t or time.time(),
        "s": "",
        "cpu": 0.25,
        "mem": 2**30 + seq,
        "pw": 900.0,
        "av": agent,
        "g": gpus,
        "r": [],
    }


@pytest.fixture
def fleet():
    cluster = make_cluster("sim-a")
    return [make_node(cluster, gpus=4, name=f"n{i}") for i in range(20)]


def test_the_database_equals_the_last_report_of_every_node(fleet):
    buffer = get_buffer()
    for seq in range(1, 4):
        buffer.put([record(n, seq + i) for i, n in enumerate(fleet)])
        flush_heartbeats()
    buffer.put([record(n, 100 + i) for i, n in enumerate(fleet[:5])])  # a few report once more
    result = flush_heartbeats()
    assert result.nodes == 5
    expected = {n.pk: (100 + i if i < 5 else 3 + i) for i, n in enumerate(fleet)}
    assert dict(NodeLastSeen.objects.values_list("node_id", "seq")) == expected


def test_only_changed_facts_touch_node_and_gpu_rows(fleet):
    buffer = get_buffer()
    buffer.put([record(n, 1) for n in fleet])
    assert flush_heartbeats().changed == len(fleet)  # first sight of every node
    buffer.put([record(n, 2, util=90.0) for n in fleet])  # telemetry only
    assert flush_heartbeats().changed == 0
    buffer.put([record(fleet[3], 3, health="unhealthy", xid=79), record(fleet[4], 3, boot="b2")])
    assert flush_heartbeats().changed == 2
    gpu = GpuDevice.objects.get(node=fleet[3], index=0)
    assert (gpu.health, gpu.last_xid, gpu.health_reason) == (
        GpuHealth.UNHEALTHY,
        79,
        "reported unhealthy (XID 79)",
    )
    assert Node.objects.get(pk=fleet[4].pk).boot_id == "b2"
    buffer.put([record(fleet[3], 4)])  # healthy again
    flush_heartbeats()
    assert GpuDevice.objects.get(node=fleet[3], index=0).health == GpuHealth.HEALTHY


def test_good_since_restarts_after_a_gap(fleet):
    node, buffer = fleet[0], get_buffer()
    start = time.time() - 300
    buffer.put([record(node, 1, t=start)])
    flush_heartbeats()
    buffer.put([record(node, 2, t=start + 10)])
    flush_heartbeats()
    row = NodeLastSeen.objects.get(node=node)
    assert row.good_since.timestamp() == pytest.approx(start)
    buffer.put([record(node, 3, t=start + 200)])  # 190 s of silence: longer than NODE_GRACE
    flush_heartbeats()
    row.refresh_from_db()
    assert row.good_since.timestamp() == pytest.approx(start + 200)


def test_a_failed_pass_loses_nothing(fleet, monkeypatch):
    buffer = get_buffer()
    buffer.put([record(n, 7) for n in fleet])

    def broken(records):
        raise RuntimeError("database went away")

    monkeypatch.setattr(aggregation, "_add_rollups", broken)
    with pytest.raises(RuntimeError):
        flush_heartbeats()
    assert not NodeLastSeen.objects.exists()  # the pass rolled back as a whole
    monkeypatch.undo()
    assert flush_heartbeats().nodes == len(fleet)
    assert set(NodeLastSeen.objects.values_list("seq", flat=True)) == {7}


def test_one_pass_at_a_time_across_workers(fleet):
    """Another worker's pass holds the pass's lock (its own database session): this one takes
    nothing from the buffer, and the nodes stay dirty for the next."""
    import psycopg

    if connection.vendor != "postgresql":
        pytest.skip("the lock is PostgreSQL's; the embedded default has one aggregator")
    get_buffer().put([record(n, 1) for n in fleet])
    db = connection.settings_dict
    other = psycopg.connect(
        host=db["HOST"], port=db["PORT"], user=db["USER"], password=db["PASSWORD"], dbname=db["NAME"]
    )
    try:
        other.execute("SELECT pg_advisory_xact_lock(%s)", [aggregation.FLUSH_LOCK_KEY])
        assert flush_heartbeats().nodes == 0
        assert not NodeLastSeen.objects.exists()
    finally:
        # The other pass's transaction ends, and its lock with it: a rollback the server has
        # answered, not only a closed socket, whose backend may still hold the lock a moment.
        other.rollback()
        other.close()
    assert flush_heartbeats().nodes == len(fleet)
    assert set(NodeLastSeen.objects.values_list("seq", flat=True)) == {1}


def test_reports_for_deleted_nodes_are_dropped(fleet):
    buffer = get_buffer()
    gone = fleet[0]
    buffer.put([record(n, 1) for n in fleet])
    Node.objects.filter(pk=gone.pk).delete()
    flush_heartbeats()
    assert NodeLastSeen.objects.count() == len(fleet) - 1


def test_rollups_add_up_per_cluster_and_model(fleet):
    buffer = get_buffer()
    buffer.put([record(n, 1, util=40.0) for n in fleet])
    flush_heartbeats()
    buffer.put([record(n, 2, util=80.0) for n in fleet])
    flush_heartbeats()
    minute = MetricPoint.objects.get(resolution="1m")
    hour = MetricPoint.objects.get(resolution="1h")
    gpus = sum(n.gpu_capacity for n in fleet)
    for point in (minute, hour):
        assert point.samples == 2 * gpus and point.gpus_total == gpus
        assert point.utilization == pytest.approx(60.0) and point.power_w == pytest.approx(300.0)


def test_prune_keeps_a_day_of_minutes_and_a_month_of_hours(fleet):
    cluster, model = fleet[0].cluster, GpuDevice.objects.first().model
    now = timezone.now()
    for resolution, age in (
        ("1m", timedelta(hours=23)),
        ("1m", timedelta(hours=25)),
        ("1h", timedelta(days=29)),
        ("1h", timedelta(days=31)),
    ):
        MetricPoint.objects.create(cluster=cluster, gpu_model=model, resolution=resolution, at=now - age)
    assert prune_metrics(now) == 2
    assert MetricPoint.objects.count() == 2


def test_sync_telemetry_copies_the_latest_values(fleet):
    get_buffer().put([record(n, 1, util=33.0) for n in fleet])
    assert sync_telemetry() == len(fleet)
    gpu = GpuDevice.objects.get(node=fleet[2], index=1)
    node = Node.objects.get(pk=fleet[2].pk)
    assert (gpu.utilization, gpu.memory_used_mb, gpu.power_w) == (33.0, 1001, 300.0)
    assert node.cpu_load == 0.25 and node.last_heartbeat_at is not None


def test_a_pass_is_a_handful_of_statements(fleet, django_assert_max_num_queries):
    get_buffer().put([record(n, 1) for n in fleet])
    flush_heartbeats()  # warm the catalog
    get_buffer().put([record(n, 2, boot="new") for n in fleet])
    # the pass's lock, read last-seen, upsert it, nodes, GPUs, roll-ups (+ the savepoint pair of
    # the test transaction)
    limit = 8 if connection.vendor == "postgresql" else 200
    with django_assert_max_num_queries(limit):
        flush_heartbeats()


def reading(node: Node, seq: int, t: float, util: float | None, temp: float | None = 50.0) -> dict:
    """A report of ``node`` whose GPUs read ``util`` % and ``temp`` °C (None: not measured), with
    ``1000 + seq`` MiB in use."""
    report = record(node, seq, t=t)
    for gpu in report["g"]:
        gpu[5], gpu[7] = util, temp
    return report


@pytest.fixture(params=["set-based", "portable"])
def sync_path(request, monkeypatch):
    """Both ways of writing telemetry: PostgreSQL's one statement over arrays, and SQLite's
    row by row (which runs on PostgreSQL too, so each test checks that both agree)."""
    if request.param == "portable":
        monkeypatch.setattr(aggregation, "is_postgresql", lambda: False)
    elif connection.vendor != "postgresql":
        pytest.skip("the set-based statement is PostgreSQL's")
    return request.param


def averages(node: Node) -> tuple[float | None, float | None, float | None]:
    gpu = GpuDevice.objects.get(node=node, index=0)
    return gpu.utilization_avg, gpu.memory_used_avg_mb, gpu.temperature_avg_c


@pytest.mark.parametrize(
    ("readings", "expected"),
    [
        pytest.param([(0, 40.0, 50.0)], (40.0, 1001, 50.0), id="first-reading-is-the-average"),
        pytest.param(
            [(0, 40.0, 50.0), (60, 80.0, 60.0)],
            (0.3 * 80 + 0.7 * 40, 0.3 * 1002 + 0.7 * 1001, 0.3 * 60 + 0.7 * 50),
            id="second-moves-alpha-of-the-way",
        ),
        pytest.param(
            [(0, 40.0, 50.0), (60, 80.0, 50.0), (120, 80.0, 50.0)],
            (0.3 * 80 + 0.7 * (0.3 * 80 + 0.7 * 40), None, 50.0),
            id="third-keeps-moving",
        ),
        pytest.param(
            [(0, 40.0, 50.0), (60, None, None)],
            (40.0, 0.3 * 1002 + 0.7 * 1001, 50.0),  # memory was measured: it moves
            id="null-keeps-average",
        ),
        pytest.param([(0, 40.0, 50.0), (400, 80.0, 70.0)], (80.0, 1002, 70.0), id="gap-resets"),
    ],
)
def test_sync_telemetry_moves_exponential_averages(fleet, sync_path, readings, expected):
    node, start = fleet[0], time.time() - 1000
    for seq, (offset, util, temp) in enumerate(readings, start=1):
        get_buffer().put([reading(node, seq, start + offset, util, temp)])
        sync_telemetry()
    got = averages(node)
    for value, want in zip(got, expected, strict=True):
        if want is not None:
            assert value == pytest.approx(want)


def test_syncing_the_same_reading_twice_moves_no_average(fleet, sync_path):
    node, start = fleet[0], time.time() - 1000
    get_buffer().put([reading(node, 1, start, 40.0)])
    sync_telemetry()
    get_buffer().put([reading(node, 2, start + 60, 80.0)])
    sync_telemetry()
    once = averages(node)
    sync_telemetry()  # the node said nothing new: the buffer's latest is the same record
    assert averages(node) == once and once[0] == pytest.approx(52.0)


def test_averages_follow_the_alpha_setting(fleet, sync_path, settings):
    settings.ORRERY_TELEMETRY_EMA_ALPHA = 1.0
    node, start = fleet[0], time.time() - 1000
    for seq, util in enumerate((40.0, 90.0), start=1):
        get_buffer().put([reading(node, seq, start + 60 * seq, util)])
        sync_telemetry()
    assert averages(node)[0] == pytest.approx(90.0)


def test_a_fleet_wide_reboot_rewrites_node_rows_in_place():
    """Every node rebooting rewrites every Node row in one statement. With half of each page
    kept free the new versions fit beside the old ones (HOT) instead of going through every
    index of the table; with the former 20 % about three rows in four did not fit (117 of 400
    in place)."""
    if connection.vendor != "postgresql":
        pytest.skip("page layout is PostgreSQL's")
    cluster = make_cluster("sim-reboot")
    nodes = Node.objects.bulk_create(
        Node(
            cluster=cluster,
            name=f"r{i:04d}",
            boot_id=str(uuid.uuid4()),  # what agents report: the kernel's boot id
            agent_version="0.1",
            gpu_capacity=0,
            cpu_millicores_capacity=64_000,
            cpu_millicores_allocatable=64_000,
            memory_bytes_capacity=2**39,
            memory_bytes_allocatable=2**39,
        )
        for i in range(400)
    )

    def node_updates() -> tuple[int, int]:  # (rows updated, of them in place) in this transaction
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables "
                "WHERE relname = 'clusters_node'"
            )
            return cursor.fetchone()

    before = node_updates()
    get_buffer().put([record(n, 1, boot=str(uuid.uuid4()), agent="0.2") for n in nodes])
    assert flush_heartbeats().changed == len(nodes)
    after = node_updates()
    assert (after[0] - before[0], after[1] - before[1]) == (len(nodes), len(nodes))
