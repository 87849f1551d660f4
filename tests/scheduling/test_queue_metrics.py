"""Queue state under Kueue's metric names on /metrics: pending workloads by status, admitted
workloads, nominal quota and usage per flavor (GPU model) and resource."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from scheduling.choices import JobState, PendingReason
from scheduling.models import QueueQuota
from scheduling.queue_metrics import REGISTRY, pending_status, queue_state
from tests.factories import gpu_model, make_job, make_project, make_queue

pytestmark = pytest.mark.django_db

TOKEN = "scrape-0123456789abcdefghijklmnopqrstuvwxyz"


def values() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(name, sorted labels): value}`` of every sample the collector gives now."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in queue_state()
        for sample in family.samples
    }


def gauge(name: str, **labels: str) -> float | None:
    return values().get((name, tuple(sorted(labels.items()))))


@pytest.mark.parametrize(
    "reason, status",
    [
        (PendingReason.NONE, "active"),
        ("", "active"),
        (PendingReason.RESOURCES, "active"),
        (PendingReason.PRIORITY, "active"),
        (PendingReason.REQUEUED, "active"),
        (PendingReason.NODE_LOST, "active"),
        (PendingReason.PREEMPTED, "active"),
        (PendingReason.QUOTA_EXCEEDED, "inadmissible"),
        (PendingReason.MAX_JOBS_PER_USER, "inadmissible"),
        (PendingReason.MAX_GPUS_PER_USER, "inadmissible"),
        (PendingReason.ARRAY_TASK_LIMIT, "inadmissible"),
        (PendingReason.BUDGET_EXHAUSTED, "inadmissible"),
        (PendingReason.DEPENDENCY, "inadmissible"),
        (PendingReason.CLUSTER_UNAVAILABLE, "inadmissible"),
    ],
    ids=lambda v: v or "blank",
)
def test_pending_reasons_map_to_kueue_statuses(reason, status):
    assert pending_status(reason) == status


@pytest.fixture
def queues(alice):
    vision = make_project("vision", members=(alice,))
    train = make_queue(vision, "train", cohort="gpu-pool")
    idle = make_queue(make_project("speech", members=(alice,)), "batch")
    QueueQuota.objects.create(queue=train, gpu_model=gpu_model("h100"), gpus=16, borrowing_limit=8)
    QueueQuota.objects.create(queue=train, gpu_model=gpu_model("a100"), gpus=4)
    for reason in (PendingReason.RESOURCES, PendingReason.PRIORITY, PendingReason.QUOTA_EXCEEDED):
        make_job(alice, train, gpus=8, reason=reason)
    make_job(alice, train, gpus=8, state=JobState.HELD, reason=PendingReason.HELD)  # not pending here
    make_job(alice, train, gpus=8, nodes=2, state=JobState.RUNNING)  # 16
    make_job(alice, train, gpus=4, state=JobState.STARTING)  # 4
    make_job(alice, train, gpus=4, model="l40s", state=JobState.COMPLETING)  # a model without quota
    make_job(alice, train, gpus=2, state=JobState.SUCCEEDED)  # ended: holds nothing
    return train, idle


@pytest.mark.parametrize(
    "name, labels, expected",
    [
        ("kueue_pending_workloads", {"cluster_queue": "vision/train", "status": "active"}, 2),
        ("kueue_pending_workloads", {"cluster_queue": "vision/train", "status": "inadmissible"}, 1),
        ("kueue_pending_workloads", {"cluster_queue": "speech/batch", "status": "active"}, 0),
        ("kueue_admitted_active_workloads", {"cluster_queue": "vision/train"}, 3),
        ("kueue_admitted_active_workloads", {"cluster_queue": "speech/batch"}, 0),
        (
            "kueue_cluster_queue_nominal_quota",
            {
                "cohort": "gpu-pool",
                "cluster_queue": "vision/train",
                "flavor": "h100-80g",
                "resource": "nvidia.com/gpu",
            },
            16,
        ),
        (
            "kueue_cluster_queue_nominal_quota",
            {
                "cohort": "gpu-pool",
                "cluster_queue": "vision/train",
                "flavor": "a100-80g",
                "resource": "nvidia.com/gpu",
            },
            4,
        ),
        (
            "kueue_cluster_queue_resource_usage",
            {
                "cohort": "gpu-pool",
                "cluster_queue": "vision/train",
                "flavor": "h100-80g",
                "resource": "nvidia.com/gpu",
            },
            20,  # 2 nodes × 8 + 4 (nodes × GPUs, as the quota counts): 4 borrowed beyond its 16
        ),
        (
            "kueue_cluster_queue_resource_usage",
            {
                "cohort": "gpu-pool",
                "cluster_queue": "vision/train",
                "flavor": "a100-80g",
                "resource": "nvidia.com/gpu",
            },
            0,
        ),
        (
            "kueue_cluster_queue_resource_usage",
            {
                "cohort": "gpu-pool",
                "cluster_queue": "vision/train",
                "flavor": "l40s-48g",
                "resource": "nvidia.com/gpu",
            },
            4,
        ),
        (
            "kueue_cluster_queue_nominal_quota",
            {
                "cohort": "gpu-pool",
                "cluster_queue": "vision/train",
                "flavor": "l40s-48g",
                "resource": "nvidia.com/gpu",
            },
            None,  # no quota row, no series
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_gauge_values(queues, name, labels, expected):
    assert gauge(name, **labels) == expected


def test_the_resource_follows_the_models_vendor(queues):
    train, _ = queues
    QueueQuota.objects.create(queue=train, gpu_model=gpu_model("mi300x"), gpus=8)
    labels = {
        "cohort": "gpu-pool",
        "cluster_queue": "vision/train",
        "flavor": "mi300x-192g",
        "resource": "amd.com/gpu",
    }
    assert gauge("kueue_cluster_queue_nominal_quota", **labels) == 8


def test_a_few_grouped_queries_whatever_the_jobs(queues, alice, django_assert_max_num_queries):
    train, _ = queues
    for _ in range(30):
        make_job(alice, train, gpus=1, reason=PendingReason.RESOURCES)
    with django_assert_max_num_queries(5):
        assert gauge("kueue_pending_workloads", cluster_queue="vision/train", status="active") == 32


def test_served_on_metrics_and_never_in_the_default_registry(client, settings, queues):
    from prometheus_client import REGISTRY as DEFAULT

    settings.ORRERY_METRICS_TOKEN = TOKEN
    body = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").content.decode()
    assert 'kueue_pending_workloads{cluster_queue="vision/train",status="inadmissible"} 1.0' in body
    assert "django_http_requests" in body  # django-prometheus' registry is still there
    assert b"kueue_" not in generate_latest(DEFAULT)
    assert b"kueue_admitted_active_workloads" in generate_latest(REGISTRY)
