"""Demo seeding, and the portal on the seeded demo."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command

from clusters.models import Cluster, GpuDevice, MigInstance, Node
from portal.services.demo import DemoRefused, seed_demo
from scheduling.choices import JobState
from scheduling.models import Allocation, Job, JobEvent

pytestmark = pytest.mark.django_db


def snapshot():
    return (
        Cluster.objects.count(),
        Node.objects.count(),
        GpuDevice.objects.count(),
        Job.objects.count(),
        JobEvent.objects.count(),
        Allocation.objects.count(),
        get_user_model().objects.count(),
    )


def test_seed_is_idempotent_and_varied():
    seed_demo()
    first = snapshot()
    seed_demo()
    assert snapshot() == first
    kinds = set(Cluster.objects.values_list("nodes__gpus__model__slug", flat=True))
    assert len(kinds) == 3
    states = set(Job.objects.values_list("state", flat=True))
    assert {
        JobState.PENDING,
        JobState.HELD,
        JobState.RUNNING,
        JobState.SUCCEEDED,
        JobState.FAILED,
        JobState.CANCELLED,
    } <= states
    assert Job.objects.filter(state=JobState.PENDING).exclude(reason_message="").exists()
    admin = get_user_model().objects.get(username="admin")
    assert admin.is_staff and admin.check_password("admin")


def test_seed_refuses_a_production_configuration(settings):
    settings.PRODUCTION = True
    with pytest.raises(DemoRefused):
        seed_demo()
    with pytest.raises(CommandError, match="production"):
        call_command("seed_demo")
    assert not Cluster.objects.exists()


def test_the_portal_opens_on_the_seeded_demo(client):
    seed_demo()
    assert client.get("/").status_code == 302  # sign in first
    signed_in = client.post("/accounts/login/", {"username": "alice", "password": "alice"})
    assert signed_in.status_code == 302
    for path in ("/", "/submit/", "/jobs/", "/clusters/", "/clusters/sim-a/", "/fleet/", "/queues/"):
        assert client.get(path).status_code == 200, path
    assert "sim-a" in client.get("/clusters/").content.decode()


def test_metrics_endpoint(client, settings):
    settings.ORRERY_METRICS_TOKEN = "scrape-0123456789abcdefghijklmnopqrstuvwxyz"
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {settings.ORRERY_METRICS_TOKEN}")
    assert response.status_code == 200
    assert b"django_http_requests" in response.content


def test_the_demo_fleet_has_mig_instances_and_shared_gpus_and_its_workload_fits(monkeypatch):
    """Every kind of job the demo keeps submitting is accepted on the seeded fleet, MIG and
    shared-GPU ones included (a request the fleet could never hold would be refused)."""
    from portal.services import demo

    seed_demo()
    seed_demo()  # idempotent: the MIG layout is made once
    assert MigInstance.objects.count() == sum(len(layout) for layout in demo.DEMO_MIG.values())
    assert GpuDevice.objects.filter(shareable=True).count() == 2
    assert (
        Cluster.objects.filter(energy_price_per_kwh__isnull=False, carbon_g_per_kwh__isnull=False).count()
        == 3
    )
    for entry in demo.DEMO_WORKLOAD:
        monkeypatch.setattr("random.choice", lambda seq, entry=entry: entry)
        assert demo.submit_demo_jobs(1) == 1, entry
    assert (
        Job.objects.filter(gpu_slice="1g.10gb").exists() and Job.objects.filter(gpu_memory_mb=20480).exists()
    )
