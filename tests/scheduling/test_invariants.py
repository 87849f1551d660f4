"""The database, not the code, refuses rows that break Orrery's invariants — on PostgreSQL
(``default`` under ``make test``) and on SQLite (the embedded default) alike.

Each test first shows the legal row is accepted, then writes the violating row directly
(``QuerySet.create``/``update`` skip model validation) and expects an IntegrityError.
"""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connections, transaction

from clusters.models import GpuDevice, Node
from scheduling.models import Allocation, Job, JobAttempt, JobEvent, QueueQuota
from tests.factories import gpu_model, make_cluster, make_job, make_node, make_project, make_queue, make_user

DATABASES = ["default", "sqlite"]
pytestmark = pytest.mark.django_db(databases=DATABASES)


@pytest.fixture(params=DATABASES)
def db_alias(request):
    return request.param


def refused(using: str):
    """A context that expects the database to refuse the statement inside it."""
    return pytest.raises(IntegrityError)


def _world(using: str):
    user = make_user(using=using)
    queue = make_queue(make_project(members=(user,), using=using), using=using)
    node = make_node(make_cluster(using=using), gpus=2, using=using)
    job = make_job(user, queue, gpus=1, using=using)
    return user, queue, node, job


def _attempt(job: Job, node: Node, number: int, using: str, active: bool = True) -> JobAttempt:
    return JobAttempt.objects.using(using).create(job=job, number=number, cluster=node.cluster, active=active)


def test_engines_are_the_ones_claimed(db_alias):
    vendor = connections[db_alias].vendor
    assert vendor == ("sqlite" if db_alias == "sqlite" else connections["default"].vendor)


def test_no_gpu_has_two_active_allocations(db_alias):
    user, queue, node, job = _world(db_alias)
    other = make_job(user, queue, gpus=1, using=db_alias)
    gpu = GpuDevice.objects.using(db_alias).get(node=node, index=0)
    first = _attempt(job, node, 1, db_alias)
    second = _attempt(other, node, 1, db_alias)
    Allocation.objects.using(db_alias).create(attempt=first, job=job, node=node, gpu=gpu)
    with refused(db_alias), transaction.atomic(using=db_alias):
        Allocation.objects.using(db_alias).create(attempt=second, job=other, node=node, gpu=gpu)

    # Once released, the GPU may be allocated again; history keeps both rows.
    Allocation.objects.using(db_alias).filter(gpu=gpu).update(
        active=False, released_at="2026-01-01T00:00:00Z"
    )
    Allocation.objects.using(db_alias).create(attempt=second, job=other, node=node, gpu=gpu)
    assert Allocation.objects.using(db_alias).filter(gpu=gpu).count() == 2


def test_reactivating_a_released_allocation_is_refused(db_alias):
    user, queue, node, job = _world(db_alias)
    gpu = GpuDevice.objects.using(db_alias).get(node=node, index=1)
    old = Allocation.objects.using(db_alias).create(
        attempt=_attempt(job, node, 1, db_alias, active=False),
        job=job,
        node=node,
        gpu=gpu,
        active=False,
        released_at="2026-01-01T00:00:00Z",
    )
    other = make_job(user, queue, using=db_alias)
    Allocation.objects.using(db_alias).create(
        attempt=_attempt(other, node, 1, db_alias), job=other, node=node, gpu=gpu
    )
    with refused(db_alias), transaction.atomic(using=db_alias):
        Allocation.objects.using(db_alias).filter(pk=old.pk).update(active=True, released_at=None)


def test_a_job_has_at_most_one_active_attempt(db_alias):
    _, _, node, job = _world(db_alias)
    _attempt(job, node, 1, db_alias, active=False)
    _attempt(job, node, 2, db_alias)
    with refused(db_alias), transaction.atomic(using=db_alias):
        _attempt(job, node, 3, db_alias)
    assert JobAttempt.objects.using(db_alias).filter(job=job, active=True).count() == 1


def test_owner_and_idempotency_key_are_unique(db_alias):
    user, queue, _, _ = _world(db_alias)
    stranger = make_user(using=db_alias)
    make_job(user, queue, idempotency_key="sweep-1", using=db_alias)
    make_job(stranger, queue, idempotency_key="sweep-1", using=db_alias)  # another owner: fine
    make_job(user, queue, idempotency_key=None, using=db_alias)  # no key: any number
    make_job(user, queue, idempotency_key=None, using=db_alias)
    with refused(db_alias), transaction.atomic(using=db_alias):
        make_job(user, queue, idempotency_key="sweep-1", using=db_alias)


@pytest.mark.parametrize(
    "field, value",
    [
        ("cpu_millicores_capacity", -1),
        ("memory_bytes_capacity", -1),
        ("gpu_capacity", -1),
        ("cpu_millicores_allocatable", -1),
        ("memory_bytes_allocatable", -5),
        ("cpu_millicores_allocatable", 10**9),  # above capacity
        ("memory_bytes_allocatable", 2**50),  # above capacity
    ],
    ids=lambda v: str(v),
)
def test_node_capacity_cannot_go_negative_or_past_capacity(db_alias, field, value):
    node = make_node(gpus=0, using=db_alias)
    with refused(db_alias), transaction.atomic(using=db_alias):
        Node.objects.using(db_alias).filter(pk=node.pk).update(**{field: value})


@pytest.mark.parametrize("field", ["cpu_millicores", "memory_bytes"])
def test_allocation_resources_cannot_go_negative(db_alias, field):
    _, _, node, job = _world(db_alias)
    attempt = _attempt(job, node, 1, db_alias)
    with refused(db_alias), transaction.atomic(using=db_alias):
        Allocation.objects.using(db_alias).create(attempt=attempt, job=job, node=node, **{field: -1})


@pytest.mark.parametrize(
    "changes",
    [{"gpus": -1}, {"borrowing_limit": -1}],
    ids=["quota", "borrowing_limit"],
)
def test_quota_cannot_go_negative(db_alias, changes):
    _, queue, _, _ = _world(db_alias)
    quota = QueueQuota.objects.using(db_alias).create(
        queue=queue, gpu_model=gpu_model("h100", db_alias), gpus=8
    )
    with refused(db_alias), transaction.atomic(using=db_alias):
        QueueQuota.objects.using(db_alias).filter(pk=quota.pk).update(**changes)


@pytest.mark.parametrize(
    "changes",
    [
        {"nodes": 0},
        {"gpus_per_node": -1},
        {"cpu_millicores_per_node": -1},
        {"memory_bytes_per_node": -1},
        {"gpu_model": None, "state": "RUNNING"},
        {"state": "LOST"},
    ],
    ids=["nodes", "gpus", "cpu", "memory", "placed-gpus-without-model", "unknown-state"],
)
def test_job_requests_are_checked(db_alias, changes):
    _, _, _, job = _world(db_alias)
    with refused(db_alias), transaction.atomic(using=db_alias):
        Job.objects.using(db_alias).filter(pk=job.pk).update(**changes)


def test_a_waiting_job_may_ask_for_any_gpu_model(db_alias):
    _, _, _, job = _world(db_alias)
    assert Job.objects.using(db_alias).filter(pk=job.pk).update(gpu_model=None) == 1


def test_gpu_index_is_unique_per_node(db_alias):
    node = make_node(gpus=1, using=db_alias)
    with refused(db_alias), transaction.atomic(using=db_alias):
        GpuDevice.objects.using(db_alias).create(node=node, index=0, model=gpu_model("h100", db_alias))


def test_job_events_are_append_only(db_alias):
    _, _, _, job = _world(db_alias)
    event = JobEvent.objects.using(db_alias).create(job=job, kind="note", message="hello")
    with pytest.raises(Exception, match="append-only"), transaction.atomic(using=db_alias):
        JobEvent.objects.using(db_alias).filter(pk=event.pk).update(message="rewritten")
    assert JobEvent.objects.using(db_alias).get(pk=event.pk).message == "hello"
