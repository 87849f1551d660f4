"""The scheduler under two workers and stalls: caches that agree, cycles that lose a race at
commit, a lock holder that stalls or vanishes, a connection killed under a cycle."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from scheduling.choices import EventKind, JobState
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import run_cycle
from scheduling.models import Job, JobEvent
from scheduling.services.jobs import cancel_job
from tests.factories import make_cluster, make_job, make_node

pytestmark = pytest.mark.django_db

FAR_IDS = 10**9  # explicit job ids, so a set of them iterates in a known order (below)


@pytest.fixture
def one_node(db):
    """One 8-GPU node: any two whole-node jobs want the same GPUs."""
    return make_node(make_cluster("sim-a"), gpus=8, name="a0")


def submit(owner, queue, **fields):
    job = make_job(owner, queue, **fields)
    JobEvent.objects.create(job=job, kind=EventKind.SUBMITTED, to_state=JobState.PENDING)
    return job


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def free_gpus(cache: SchedulerCache, node) -> tuple[int, int]:
    row = cache.snap.row_of[node.pk]
    return int(cache.snap.gpu_free[row]), int(cache.snap.free_bits[row])


def test_a_sync_that_sees_a_release_and_another_workers_placement_keeps_the_gpu_taken(alice, queue, one_node):
    """Worker A holds X on the node; outside A, X ends and worker B places Y on X's GPUs. A's
    next sync reads both, visiting Y before X."""
    y = submit(alice, queue, gpus=8, priority=5, id=FAR_IDS)
    x = submit(alice, queue, gpus=8, priority=10, id=FAR_IDS + 1)
    z = submit(alice, queue, gpus=8, priority=0)
    a = SchedulerCache()
    assert run_cycle(a).placed == 1 and Job.objects.get(pk=x.pk).state == JobState.SCHEDULED
    cancel_job(Job.objects.get(pk=x.pk), actor=alice)
    assert run_cycle(SchedulerCache()).placed == 1  # worker B
    assert Job.objects.get(pk=y.pk).state == JobState.SCHEDULED
    assert next(iter({x.pk, y.pk})) == y.pk, "the sync visits Y first"

    a.sync()
    assert free_gpus(a, one_node) == (0, 0), "Y holds every GPU of the node"
    aborted = sample("orrery_scheduler_cycles_aborted_total", reason="conflict")
    report = run_cycle(a)
    assert report.ran and report.placed == 0
    assert sample("orrery_scheduler_cycles_aborted_total", reason="conflict") == aborted
    assert Job.objects.get(pk=z.pk).state == JobState.PENDING
