"""POST /api/v1/jobs smaller than whole GPUs: a MIG instance, a fraction of a shareable GPU, a
gang's topology — what the job stores and shows back, and requests the fleet can never hold
refused with the field's path.

The fleet (tests/portal/api/conftest.py): three nodes of 8 h100 and one of 4 a100; here the
a100's GPU 0 is in MIG mode (7 × 1g.10gb) and the first h100 node's GPU 0 is shareable."""

from __future__ import annotations

import json

import pytest

from scheduling.models import Job
from tests.factories import make_mig, make_shareable
from tests.portal.api.conftest import DELETE, error_paths, job_spec

JOBS = "/api/v1/jobs"


@pytest.fixture
def fine(fleet, queue):
    make_mig(fleet.a100, 0, ["1g.10gb"] * 7)
    make_shareable(fleet.h100[0], 0)
    return fleet


def post(client, document):
    return client.post(JOBS, json.dumps(document), content_type="application/json")


def small(**resources):
    return job_spec(spec__resources=resources | {"cpus": 4, "memory": "16Gi"}, spec__timeLimit="1h")


@pytest.mark.parametrize(
    ("resources", "stored", "shown"),
    [
        (
            {"gpus": "a100:1g.10gb:2"},
            ("1g.10gb", 0, None),
            {"model": "a100-80g", "count": 2, "mig": "1g.10gb"},
        ),
        ({"gpus": "h100", "gpuMemory": "20Gi"}, ("", 20480, None), {"model": "h100-80g", "count": 1}),
        ({"gpus": "h100", "gpuShare": 0.25}, ("", 0, 0.25), {"model": "h100-80g", "count": 1}),
    ],
    ids=["mig", "memory", "share"],
)
def test_smaller_than_whole_gpus_are_stored_and_shown(api, alice, fine, resources, stored, shown):
    response = post(api(alice), small(**resources))
    assert response.status_code == 201, response.content
    job = Job.objects.get()
    assert (job.gpu_slice, job.gpu_memory_mb, job.gpu_share) == stored
    assert job.spec["resources"]["gpus"] == shown


@pytest.mark.parametrize(
    ("resources", "path"),
    [
        ({"gpus": "a100:3g.40gb"}, "spec.resources.gpus"),
        ({"gpus": "a100:1g.10gb:8"}, "spec.resources.gpus"),
        ({"gpus": "h100:1g.10gb"}, "spec.resources.gpus"),
        ({"gpus": "a100", "gpuMemory": "10Gi"}, "spec.resources.gpuMemory"),
        ({"gpus": "h100", "gpuMemory": "100Gi"}, "spec.resources.gpuMemory"),
        ({"gpus": "h100", "gpuShare": 2}, "spec.resources.gpuShare"),
    ],
    ids=[
        "profile-nobody-has",
        "more-than-one-node-has",
        "model-without-mig",
        "no-shareable",
        "too-big",
        "share",
    ],
)
def test_what_the_fleet_can_never_hold_is_refused_with_its_path(api, alice, fine, resources, path):
    response = post(api(alice), small(**resources))
    assert response.status_code == 400, response.content
    assert path in error_paths(response)
    assert not Job.objects.exists()


def test_a_gang_keeps_its_topology(api, alice, fine):
    document = job_spec(
        spec__resources__nodes=2, spec__placement={"topology": "required"}, spec__timeLimit=DELETE
    )
    response = post(api(alice), document)
    assert response.status_code == 201, response.content
    job = Job.objects.get()
    assert job.placement["topology"] == "required" and job.spec["placement"]["topology"] == "required"
