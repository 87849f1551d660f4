"""Any-model requests: a job that takes any of several GPU models is tried model by model, in its
order, and placed on the first that fits; the cycle records the model it got."""

from __future__ import annotations

import pytest

from clusters.models import Cluster
from scheduling.choices import JobState, PendingReason
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import run_cycle
from scheduling.models import Job, QueueQuota
from tests.factories import gpu_model, make_job, make_node
from tests.scheduling.snapshots import node, snapshot
from tests.scheduling.worlds import NEVER_PREEMPT, NOW, QUEUES, view, world_of

H100, A100 = 0, 1


def two_models(*running):
    """Row 0: 8 h100, row 1: 8 a100, with ``running`` (view, row) on them."""
    world = world_of(snapshot(node(model=H100), node(model=A100)), [], [], {q: NEVER_PREEMPT for q in QUEUES})
    for job, row in running:
        world.start(job, NOW - 10, rows=[row])
    return world


@pytest.mark.parametrize(
    ("models", "running", "quota", "chosen"),
    [
        pytest.param((A100, H100), [], None, A100, id="both-fit-the-first-wins"),
        pytest.param((H100, A100), [], None, H100, id="its-order-not-the-fleet's"),
        pytest.param((A100, H100), [(view(1000, 4, model=A100), 1)], None, H100, id="the-first-is-full"),
        pytest.param((A100, H100), [], {A100: 2, H100: 8}, H100, id="the-first-is-out-of-quota"),
        pytest.param((A100,), [], None, A100, id="one-model"),
    ],
)
def test_an_any_model_job_takes_the_first_model_it_accepts_that_fits(models, running, quota, chosen):
    world = two_models(*running)
    if quota:
        world.snap.quota.limited.add(1)
        world.snap.quota.nominal |= {(1, m): n for m, n in quota.items()}
    world.submit(view(1, 6, models=models))
    (placement,) = world.decide().placements
    assert placement.job.model == chosen
    assert [int(world.snap.model[c.row]) for c in placement.nodes] == [chosen]


def test_an_any_model_job_that_fits_nowhere_waits_for_its_first_model():
    world = two_models((view(1000, 8, model=H100, limit=600), 0), (view(1001, 8, model=A100, limit=300), 1))
    world.submit(view(1, 8, models=(H100, A100), limit=60))
    decided = world.decide()
    assert decided.placements == []
    (blocked,) = decided.blocked
    assert blocked.status.reason == PendingReason.RESOURCES
    assert blocked.status.message.startswith("0/2 nodes fit: 1 have no h100-80g, 1 lack 8 free h100-80g")
    assert decided.reservations == {1: ((0,), 8, NOW - 10 + 600)}, "reserved on its first model"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("asked", "preference", "chosen"),
    [
        pytest.param(["a100-80g", "h100-80g"], [], "a100", id="the-job's-order"),
        pytest.param(["h100-80g", "a100-80g"], [], "h100", id="the-job's-order-reversed"),
        pytest.param([], ["a100-80g"], "a100", id="the-queue's-preference"),
        pytest.param(["h200-141g", "h100-80g"], [], "h100", id="a-model-the-fleet-lacks-is-skipped"),
    ],
)
def test_a_cycle_records_the_model_an_any_model_job_was_placed_on(
    alice, queue, fleet, asked, preference, chosen
):
    make_node(Cluster.objects.get(name="sim-b"), gpus=8, model="a100", name="b1")
    queue.gpu_model_preference = preference
    queue.save()
    job = make_job(alice, queue, gpus=4, placement={"gpuModels": asked})
    Job.objects.filter(pk=job.pk).update(gpu_model=None)
    run_cycle(SchedulerCache())
    job.refresh_from_db()
    assert job.state == JobState.SCHEDULED and job.gpu_model == gpu_model(chosen), job.reason_message
    assert set(job.allocations.filter(gpu__isnull=False).values_list("gpu__model__slug", flat=True)) == {
        gpu_model(chosen).slug
    }


@pytest.mark.django_db
def test_an_any_model_job_of_a_queue_with_quota_takes_only_models_it_has_quota_for(alice, queue, fleet):
    make_node(Cluster.objects.get(name="sim-b"), gpus=8, model="a100", name="b1")
    QueueQuota.objects.create(queue=queue, gpu_model=gpu_model("a100"), gpus=8)
    job = make_job(alice, queue, gpus=4, placement={"gpuModels": []})
    Job.objects.filter(pk=job.pk).update(gpu_model=None)
    run_cycle(SchedulerCache())
    job.refresh_from_db()
    assert job.state == JobState.SCHEDULED and job.gpu_model == gpu_model("a100")
