"""The energy meter: power × time of the GPUs an attempt holds, with its share of each, only from
fresh telemetry, never filling a long gap; cost and CO₂ at its cluster's price and intensity;
the last reading when an attempt ends, and what accounting makes of it."""

from __future__ import annotations

import threading
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from clusters.models import GpuDevice, MigInstance, Node
from scheduling.choices import JobState
from scheduling.models import Allocation, Job, JobAttempt, UsageDay, UsageMonth, UsageProjectDay
from scheduling.services import energy
from scheduling.services.allocations import NodePlacement, bind_job
from scheduling.services.energy import meter_energy, share
from scheduling.services.transitions import transition_job, transition_jobs
from tests.factories import make_cluster, make_job, make_node, make_project, make_queue, make_user

pytestmark = pytest.mark.django_db

WATTS = 400.0
MINUTE_WH = WATTS * 60 / 3600  # 400 W for 60 s: 6.67 Wh
GiB_MB = 1024


@pytest.fixture(params=["set-based", "portable"])
def meter_path(request, monkeypatch):
    """Both ways of reading: PostgreSQL's one statement, and SQLite's row by row (which runs on
    PostgreSQL too, so each test checks that both agree)."""
    if request.param == "portable":
        monkeypatch.setattr(energy, "is_postgresql", lambda: False)
    elif connection.vendor != "postgresql":
        pytest.skip("the set-based statement is PostgreSQL's")
    return request.param


@pytest.fixture
def now():
    return timezone.now()


@pytest.fixture
def node(db, now) -> Node:
    """Eight 80 GiB GPUs drawing 400 W each, their telemetry ten seconds old; on a cluster at
    0.25 per kWh and 400 g CO₂ per kWh."""
    cluster = make_cluster("sim-a", energy_price_per_kwh=Decimal("0.25"), carbon_g_per_kwh=400)
    node = make_node(cluster, gpus=8, name="a0")
    GpuDevice.objects.filter(node=node).update(
        power_w=WATTS, memory_mb=80 * GiB_MB, telemetry_at=now - timedelta(seconds=10)
    )
    return node


def holding(
    job: Job,
    node: Node,
    indices: list[int],
    *,
    read_ago: float | None = 60,
    created_ago: float = 0,
    mig_slices: int | None = None,
    gpu_memory_mb: int = 0,
    active: bool = True,
) -> JobAttempt:
    """An active attempt of ``job`` holding GPUs ``indices`` of ``node`` (whole, one MIG
    instance of ``mig_slices`` each, or ``gpu_memory_mb`` of each), read last ``read_ago``
    seconds ago (None: never)."""
    now = timezone.now()
    attempt = JobAttempt.objects.create(job=job, number=1, cluster=node.cluster)
    JobAttempt.objects.filter(pk=attempt.pk).update(
        created_at=now - timedelta(seconds=created_ago),
        energy_at=None if read_ago is None else now - timedelta(seconds=read_ago),
    )
    rows = [Allocation(attempt=attempt, job=job, node=node)]
    for index in indices:
        gpu = GpuDevice.objects.get(node=node, index=index)
        instance = None
        if mig_slices is not None:
            profile = f"{mig_slices}g.{10 * mig_slices}gb"
            instance = MigInstance.objects.create(gpu=gpu, slot=0, profile=profile, slices=mig_slices)
        rows.append(
            Allocation(
                attempt=attempt,
                job=job,
                node=node,
                gpu=gpu,
                mig_instance=instance,
                gpu_memory_mb=gpu_memory_mb,
                active=active,
                released_at=None if active else now,
            )
        )
    Allocation.objects.bulk_create(rows)
    return attempt


def read(attempt: JobAttempt) -> tuple[float, float, float]:
    attempt.refresh_from_db()
    return attempt.energy_wh, attempt.energy_cost, attempt.co2_g


@pytest.mark.parametrize(
    ("hold", "telemetry_ago", "wh"),
    [
        pytest.param({"indices": [0]}, 10, MINUTE_WH, id="whole-gpu-one-minute"),
        pytest.param({"indices": [0, 1]}, 10, 2 * MINUTE_WH, id="two-gpus"),
        pytest.param({"indices": [0]}, 600, 0.0, id="stale-telemetry-adds-nothing"),
        pytest.param({"indices": [0], "mig_slices": 1}, 10, MINUTE_WH / 7, id="mig-1-slice-of-7"),
        pytest.param({"indices": [0], "mig_slices": 3}, 10, 3 * MINUTE_WH / 7, id="mig-3-slices-of-7"),
        pytest.param({"indices": [0], "gpu_memory_mb": 20 * GiB_MB}, 10, MINUTE_WH / 4, id="shared-20-of-80"),
        pytest.param({"indices": [0], "read_ago": 3600}, 10, 3 * MINUTE_WH, id="gap-capped-at-3-periods"),
        pytest.param({"indices": [0], "read_ago": None, "created_ago": 60}, 10, MINUTE_WH, id="first-read"),
        pytest.param({"indices": [0], "active": False}, 10, 0.0, id="released-allocation-adds-nothing"),
        pytest.param({"indices": []}, 10, 0.0, id="cpu-only"),
    ],
)
def test_a_reading_adds_power_times_time(alice, queue, node, now, meter_path, hold, telemetry_ago, wh):
    GpuDevice.objects.filter(node=node).update(telemetry_at=now - timedelta(seconds=telemetry_ago))
    attempt = holding(make_job(alice, queue, state=JobState.RUNNING), node, **hold)
    assert meter_energy(timezone.now()) == 1
    energy_wh, cost, co2 = read(attempt)
    assert energy_wh == pytest.approx(wh, rel=1e-3)
    assert cost == pytest.approx(wh / 1000 * 0.25, rel=1e-3)
    assert co2 == pytest.approx(wh / 1000 * 400, rel=1e-3)


def test_a_gpu_without_power_reading_adds_nothing(alice, queue, node, meter_path):
    GpuDevice.objects.filter(node=node).update(power_w=None)
    attempt = holding(make_job(alice, queue, state=JobState.RUNNING), node, [0])
    meter_energy()
    assert read(attempt) == (0.0, 0.0, 0.0)
    assert attempt.energy_at is not None  # read all the same: the next reading starts here


def test_a_cluster_without_price_or_intensity_adds_energy_only(alice, queue, node, meter_path):
    node.cluster.__class__.objects.filter(pk=node.cluster_id).update(
        energy_price_per_kwh=None, carbon_g_per_kwh=None
    )
    attempt = holding(make_job(alice, queue, state=JobState.RUNNING), node, [0])
    meter_energy()
    energy_wh, cost, co2 = read(attempt)
    assert energy_wh == pytest.approx(MINUTE_WH, rel=1e-3) and (cost, co2) == (0.0, 0.0)


def test_a_second_reading_right_after_adds_only_the_time_between(alice, queue, node, meter_path):
    attempt = holding(make_job(alice, queue, state=JobState.RUNNING), node, [0])
    at = timezone.now()
    meter_energy(at)
    first = read(attempt)[0]
    assert meter_energy(at) == 0  # the same moment again: nothing to read
    assert read(attempt)[0] == first
    meter_energy(at + timedelta(seconds=1))
    assert read(attempt)[0] == pytest.approx(first + WATTS / 3600, rel=1e-6)


def test_ended_attempts_are_not_read(alice, queue, node, meter_path):
    attempt = holding(make_job(alice, queue, state=JobState.SUCCEEDED), node, [0], active=False)
    JobAttempt.objects.filter(pk=attempt.pk).update(active=False, finished_at=timezone.now())
    assert meter_energy() == 0
    assert read(attempt) == (0.0, 0.0, 0.0)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the set-based statement is PostgreSQL's")
def test_every_attempt_is_read_in_one_statement(alice, queue, node, django_assert_num_queries):
    attempts = [holding(make_job(alice, queue, state=JobState.RUNNING), node, [i]) for i in range(8)]
    with django_assert_num_queries(1):
        assert meter_energy() == 8
    assert [read(a)[0] for a in attempts] == pytest.approx([MINUTE_WH] * 8, rel=1e-2)


def test_share_of_a_gpu():
    assert share(None, 0, 81920) == 1.0
    assert share(2, 0, 81920) == pytest.approx(2 / 7)
    assert share(None, 20480, 81920) == 0.25
    assert share(None, 163840, 81920) == 1.0  # never more than the whole GPU
    assert share(None, 20480, 0) == 0.0  # memory unknown: no guess


# --- the last reading, when an attempt ends -------------------------------------------------


def running(alice, queue, node: Node, indices: tuple[int, ...] = (0, 1)) -> tuple[Job, JobAttempt]:
    """A job placed on GPUs ``indices`` of ``node`` through the state machine and running, last
    read 30 s ago."""
    job = make_job(alice, queue, gpus=len(indices))
    attempt = bind_job(job, [NodePlacement(node, list(indices))])
    transition_job(job.pk, JobState.RUNNING)
    JobAttempt.objects.filter(pk=attempt.pk).update(energy_at=timezone.now() - timedelta(seconds=30))
    return job, attempt


@pytest.mark.parametrize("to", [JobState.SUCCEEDED, JobState.PENDING], ids=["ends", "requeued"])
def test_an_ending_attempt_is_read_up_to_its_end(alice, queue, node, meter_path, to):
    job, attempt = running(alice, queue, node)
    transition_job(job.pk, to)
    attempt.refresh_from_db()
    assert attempt.energy_at == attempt.finished_at
    # 2 GPUs × 400 W × 30 s (and the few milliseconds the test took)
    assert attempt.energy_wh == pytest.approx(2 * WATTS * 30 / 3600, rel=1e-2)


def test_many_ending_at_once_are_read_and_accounted(alice, queue, node, meter_path):
    jobs = [running(alice, queue, node, (i,))[0] for i in range(3)]
    transition_jobs([j.pk for j in jobs], JobState.FAILED, only_from=JobState.RUNNING)
    wh = sorted(JobAttempt.objects.values_list("energy_wh", flat=True))
    assert wh == pytest.approx([WATTS * 30 / 3600] * 3, rel=1e-2)
    day = UsageDay.objects.get()
    assert day.energy_wh == pytest.approx(sum(wh))


def test_accounting_adds_the_energy_of_every_attempt(alice, queue, node, meter_path):
    job, _ = running(alice, queue, node)
    transition_job(job.pk, JobState.PENDING)  # requeued: the first attempt ends, metered
    second = bind_job(Job.objects.get(pk=job.pk), [NodePlacement(node, [2, 3])])
    transition_job(job.pk, JobState.RUNNING)
    JobAttempt.objects.filter(pk=second.pk).update(energy_at=timezone.now() - timedelta(seconds=60))
    transition_job(job.pk, JobState.SUCCEEDED)
    attempts = JobAttempt.objects.filter(job=job)
    wh = sum(a.energy_wh for a in attempts)
    assert wh == pytest.approx(2 * WATTS * 90 / 3600, rel=1e-2)
    for rollup in (UsageDay, UsageMonth, UsageProjectDay):
        row = rollup.objects.get()
        assert row.energy_wh == pytest.approx(wh)
        assert row.energy_cost == pytest.approx(sum(a.energy_cost for a in attempts))
        assert row.co2_g == pytest.approx(sum(a.co2_g for a in attempts))
        assert row.co2_g == pytest.approx(wh / 1000 * 400)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="two connections at once need PostgreSQL")
@pytest.mark.django_db(transaction=True)
def test_a_reading_waiting_on_an_ending_attempt_adds_nothing_more():
    """The attempt's end (with its last reading) holds the row; the meter's reading waits on it,
    then finds the attempt ended and leaves it: its last 30 s are counted once."""
    alice = make_user("alice")
    queue = make_queue(make_project("vision", members=(alice,)))
    cluster = make_cluster("sim-a", energy_price_per_kwh=Decimal("0.25"), carbon_g_per_kwh=400)
    node = make_node(cluster, gpus=2, name="a0")
    GpuDevice.objects.filter(node=node).update(power_w=WATTS, telemetry_at=timezone.now())
    job, attempt = running(alice, queue, node)
    ended, errors = threading.Event(), []

    def end() -> None:
        try:
            with transaction.atomic():
                transition_job(job.pk, JobState.SUCCEEDED)
                ended.set()
                threading.Event().wait(0.3)  # hold the attempt's row while the meter reads
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            ended.set()
            connections.close_all()

    thread = threading.Thread(target=end)
    thread.start()
    ended.wait(5)
    assert meter_energy() == 0
    thread.join(5)
    assert errors == []
    assert read(attempt)[0] == pytest.approx(2 * WATTS * 30 / 3600, rel=1e-2)
    assert UsageDay.objects.get().energy_wh == pytest.approx(read(attempt)[0])
