"""Fine-grained GPUs through real cycles on PostgreSQL: MIG instances, fractions of shareable
GPUs, topology-aware gangs, and the database's own guarantees about them."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from clusters.models import GpuDevice
from scheduling.choices import JobState
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import run_cycle
from scheduling.models import Allocation, Job
from scheduling.services.jobs import cancel_job
from tests.factories import make_cluster, make_job, make_mig, make_node, make_shareable

pytestmark = pytest.mark.django_db
GiB_MB = 1024


def held(job: Job) -> list[Allocation]:
    return list(Allocation.objects.filter(job=job, active=True, gpu__isnull=False).select_related("gpu"))


@pytest.fixture
def mig_node():
    """One a100 node: GPU 0 in MIG mode as 7 × 1g.10gb, GPU 1 as 3g.40gb + 2 × 2g.20gb, GPUs 2–3 whole."""
    node = make_node(make_cluster("sim-m"), gpus=4, model="a100", name="m0")
    make_mig(node, 0, ["1g.10gb"] * 7)
    make_mig(node, 1, ["3g.40gb", "2g.20gb", "2g.20gb"])
    return node


def test_a_mig_job_gets_instances_and_a_whole_job_never_a_mig_gpu(alice, queue, mig_node):
    small = make_job(alice, queue, model="a100", gpus=2, gpu_slice="1g.10gb")
    whole = make_job(alice, queue, model="a100", gpus=2)
    assert run_cycle(SchedulerCache()).placed == 2
    rows = held(small)
    assert len(rows) == 2 and all(r.mig_instance_id for r in rows)
    assert {r.gpu.index for r in rows} == {0} and all(r.mig_instance.profile == "1g.10gb" for r in rows)
    assert sorted(r.gpu.index for r in held(whole)) == [2, 3], "GPUs in MIG mode are not handed out whole"


def test_instances_run_out_and_the_job_is_told_which_profile(alice, queue, mig_node):
    jobs = [make_job(alice, queue, model="a100", gpus=1, gpu_slice="1g.10gb") for _ in range(8)]
    assert run_cycle(SchedulerCache()).placed == 7
    last = Job.objects.get(pk=jobs[-1].pk)
    assert last.state == JobState.PENDING
    assert "lack 1 free a100-80g MIG 1g.10gb" in last.reason_message
    instances = Allocation.objects.filter(active=True, mig_instance__isnull=False)
    assert instances.values("mig_instance").distinct().count() == 7


def test_a_released_instance_is_handed_out_again_and_a_restart_counts_what_is_held(alice, queue, mig_node):
    first = make_job(alice, queue, model="a100", gpus=1, gpu_slice="3g.40gb")
    cache = SchedulerCache()
    assert run_cycle(cache).placed == 1
    second = make_job(alice, queue, model="a100", gpus=1, gpu_slice="3g.40gb")
    fresh = SchedulerCache()  # another process: it must count the held instance from the database
    assert run_cycle(fresh).placed == 0
    cancel_job(Job.objects.get(pk=first.pk), actor=alice)
    assert run_cycle(fresh).placed == 1
    assert held(Job.objects.get(pk=second.pk))[0].mig_instance.profile == "3g.40gb"


def test_the_database_refuses_an_instance_held_twice(alice, queue, mig_node):
    job = make_job(alice, queue, model="a100", gpus=1, gpu_slice="1g.10gb")
    run_cycle(SchedulerCache())
    row = held(job)[0]
    with pytest.raises(IntegrityError), transaction.atomic():
        Allocation.objects.create(
            attempt=row.attempt, job=job, node_id=row.node_id, gpu=row.gpu, mig_instance=row.mig_instance
        )


@pytest.fixture
def shared_node():
    """One h100 node (80 GiB GPUs) with GPU 0 offered in fractions."""
    node = make_node(make_cluster("sim-s"), gpus=2, model="h100", name="s0")
    make_shareable(node, 0)
    return node


def test_fractions_fill_a_shared_gpu_and_never_oversubscribe_its_memory(alice, queue, shared_node):
    memory = GpuDevice.objects.get(node=shared_node, index=0).memory_mb
    a = make_job(alice, queue, gpus=1, gpu_memory_mb=memory // 2)
    b = make_job(alice, queue, gpus=1, gpu_share=0.5)
    c = make_job(alice, queue, gpus=1, gpu_memory_mb=1024)
    assert run_cycle(SchedulerCache()).placed == 2
    for job, mb in ((a, memory // 2), (b, -(-memory // 2))):  # a share rounds up to whole MiB
        (row,) = held(job)
        assert (row.gpu.index, row.gpu_memory_mb) == (0, mb)
    c.refresh_from_db()
    assert c.state == JobState.PENDING and "lack a shareable h100-80g with 1 GiB free" in c.reason_message


def test_a_shared_gpu_is_not_given_whole_while_any_of_it_is_shared_out(alice, queue, shared_node):
    fraction = make_job(alice, queue, gpus=1, gpu_memory_mb=10 * GiB_MB)
    run_cycle(SchedulerCache())
    whole = make_job(alice, queue, gpus=2)
    cache = SchedulerCache()
    assert run_cycle(cache).placed == 0, "GPU 0 is shared out: only GPU 1 is whole-free"
    cancel_job(Job.objects.get(pk=fraction.pk), actor=alice)
    assert run_cycle(cache).placed == 1
    assert sorted(r.gpu.index for r in held(Job.objects.get(pk=whole.pk))) == [0, 1]


def test_a_gpu_held_whole_gives_no_fractions(alice, queue, shared_node):
    whole = make_job(alice, queue, gpus=2)
    run_cycle(SchedulerCache())
    fraction = make_job(alice, queue, gpus=1, gpu_memory_mb=GiB_MB)
    assert run_cycle(SchedulerCache()).placed == 0
    cancel_job(Job.objects.get(pk=whole.pk), actor=alice)
    assert run_cycle(SchedulerCache()).placed == 1
    assert held(Job.objects.get(pk=fraction.pk))[0].gpu.index == 0


def test_a_shared_gpu_is_placed_by_the_memory_it_actually_uses(alice, queue, shared_node):
    gpu = GpuDevice.objects.get(node=shared_node, index=0)
    gpu.memory_used_mb, gpu.telemetry_at = gpu.memory_mb - 5 * GiB_MB, timezone.now()
    gpu.save()
    job = make_job(alice, queue, gpus=1, gpu_memory_mb=10 * GiB_MB)
    assert run_cycle(SchedulerCache()).placed == 0, "only 5 GiB is really free"
    gpu.telemetry_at = timezone.now() - timedelta(hours=1)  # a stale reading is not trusted
    gpu.save()
    assert run_cycle(SchedulerCache()).placed == 1
    assert held(Job.objects.get(pk=job.pk))[0].gpu_memory_mb == 10 * GiB_MB


@pytest.fixture
def racks():
    """Four 8-GPU nodes of one cluster: r1a, r1b under switch s1; r2a under s2; r3a under s3."""
    cluster = make_cluster("sim-t")
    return {
        name: make_node(cluster, gpus=8, name=name, switch=switch, labels={"host": name})
        for name, switch in (("r1a", "s1"), ("r1b", "s1"), ("r2a", "s2"), ("r3a", "s3"))
    }


def test_a_gang_that_prefers_topology_lands_under_one_switch(alice, queue, racks):
    # Binpack alone would pick the two partly used nodes under different switches.
    for name in ("r2a", "r3a"):
        make_job(alice, queue, gpus=4, placement={"nodeSelector": {"host": name}}, name=f"fill-{name}")
    run_cycle(SchedulerCache())
    gang = make_job(alice, queue, gpus=4, nodes=2, placement={"topology": "preferred"})
    assert run_cycle(SchedulerCache()).placed == 1
    nodes = {r.node.name for r in Allocation.objects.filter(job=gang, active=True).select_related("node")}
    assert nodes == {"r1a", "r1b"}


@pytest.mark.parametrize(
    ("topology", "placed"),
    [("required", 0), ("preferred", 1), ("", 1)],
    ids=["required", "preferred", "none"],
)
def test_a_gang_that_requires_topology_waits_for_it_and_says_so(alice, queue, racks, topology, placed):
    blocker = make_job(alice, queue, gpus=8, name="blocker")
    run_cycle(SchedulerCache())
    assert held(blocker)[0].node.switch == "s1"
    gang = make_job(alice, queue, gpus=8, nodes=2, placement={"topology": topology} if topology else {})
    assert run_cycle(SchedulerCache()).placed == placed
    gang.refresh_from_db()
    if not placed:
        assert "not 2 under one switch or rack" in gang.reason_message
        assert "waits for topology" in gang.reason_message


def test_a_gpu_whose_layout_is_changing_is_kept_out_until_its_node_reports_it(alice, queue, mig_node):
    """An operator's new layout is applied by the agent once the GPU is idle: meanwhile the
    scheduler places nothing on it (not its old instances, not the GPU whole)."""
    GpuDevice.objects.filter(node=mig_node, index=0).update(mig_layout_wanted=["7g.80gb"])
    GpuDevice.objects.filter(node=mig_node, index=2).update(mig_layout_wanted=["3g.40gb", "3g.40gb"])
    small = make_job(alice, queue, model="a100", gpus=1, gpu_slice="1g.10gb")
    whole = make_job(alice, queue, model="a100", gpus=2)
    assert run_cycle(SchedulerCache()).placed == 0
    assert "lack 1 free a100-80g MIG 1g.10gb" in Job.objects.get(pk=small.pk).reason_message
    GpuDevice.objects.filter(node=mig_node, index=2).update(mig_layout_wanted=[])  # back to whole: no change
    GpuDevice.objects.filter(node=mig_node, index=0).update(mig_layout_wanted=["1g.10gb"] * 7)  # as it is
    assert run_cycle(SchedulerCache()).placed == 2
    assert sorted(r.gpu.index for r in held(Job.objects.get(pk=whole.pk))) == [2, 3]


def test_a_node_whose_gpus_are_all_in_mig_mode_takes_mig_jobs(alice, queue):
    node = make_node(make_cluster("sim-all"), gpus=1, model="a100", name="all-mig")
    make_mig(node, 0, ["3g.40gb", "3g.40gb"])
    job = make_job(alice, queue, model="a100", gpus=1, gpu_slice="3g.40gb")
    assert run_cycle(SchedulerCache()).placed == 1
    assert held(Job.objects.get(pk=job.pk))[0].mig_instance.profile == "3g.40gb"


def test_mig_jobs_are_packed_onto_the_node_whose_instances_they_fill_most(alice, queue):
    cluster = make_cluster("sim-pack")
    nodes = [make_node(cluster, gpus=1, model="a100", name=f"p{i}") for i in range(2)]
    for node in nodes:
        make_mig(node, 0, ["1g.10gb"] * 7)
    first = make_job(alice, queue, model="a100", gpus=1, gpu_slice="1g.10gb")
    run_cycle(SchedulerCache())
    second = make_job(alice, queue, model="a100", gpus=1, gpu_slice="1g.10gb")
    run_cycle(SchedulerCache())
    where = {held(Job.objects.get(pk=j.pk))[0].node_id for j in (first, second)}
    assert len(where) == 1, "the second instance comes from the partly used node"
