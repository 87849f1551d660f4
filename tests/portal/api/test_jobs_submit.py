"""POST /api/v1/jobs: one spec in JSON or YAML, idempotency keys, dry runs, refusals that name
the field at fault, and the units the spec accepts."""

from __future__ import annotations

import json

import pytest
import yaml

from scheduling.choices import JobState
from scheduling.models import Job, JobEvent
from tests.portal.api.conftest import DELETE, error_paths, job_spec

pytestmark = pytest.mark.usefixtures("fleet", "queue")

JOBS = "/api/v1/jobs"
GiB, MiB = 2**30, 2**20


def post_json(client, document, **extra):
    return client.post(JOBS, json.dumps(document), content_type="application/json", **extra)


def post_yaml(client, text, **extra):
    return client.post(JOBS, text, content_type="application/yaml", **extra)


def test_submit_json_creates_a_pending_job_with_a_reason(api, alice):
    response = post_json(api(alice), job_spec())
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["state"], body["stateCode"], body["owner"], body["project"], body["queue"]) == (
        "PENDING",
        "PD",
        "alice",
        "vision",
        "default",
    )
    assert body["reason"] == "None" and body["reasonMessage"]
    assert body["resources"] == {
        "nodes": 1,
        "gpus": {"model": "h100-80g", "count": 8},
        "cpuMillicores": 32_000,
        "memoryBytes": 256 * GiB,
    }
    job = Job.objects.get(pk=body["id"])
    assert (job.state, job.owner.username, job.command) == (JobState.PENDING, "alice", "python train.py")
    assert body["spec"] == job.spec and body["spec"]["metadata"]["project"] == "vision"
    assert list(JobEvent.objects.filter(job=job).values_list("to_state", "actor__username")) == [
        ("PENDING", "alice")
    ]


@pytest.mark.parametrize("content_type", ["application/yaml", "application/x-yaml", "text/yaml"])
def test_submit_yaml(api, alice, content_type):
    response = api(alice).post(JOBS, yaml.safe_dump(job_spec()), content_type=content_type)
    assert response.status_code == 201, response.content
    assert response.json()["state"] == "PENDING"
    assert Job.objects.get().gpus_per_node == 8


def test_project_defaults_to_the_users_only_project(api, alice):
    response = post_json(api(alice), job_spec(metadata__project=DELETE))
    assert response.status_code == 201, response.content
    assert response.json()["project"] == "vision"


def test_same_idempotency_key_and_body_returns_the_same_job(api, alice):
    client = api(alice)
    first = post_json(client, job_spec(), HTTP_IDEMPOTENCY_KEY="retry-1")
    again = post_json(client, job_spec(), HTTP_IDEMPOTENCY_KEY="retry-1")
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    assert Job.objects.count() == 1


def test_same_idempotency_key_with_another_body_is_a_422(api, alice):
    client = api(alice)
    first = post_json(client, job_spec(), HTTP_IDEMPOTENCY_KEY="retry-1")
    other = post_json(client, job_spec(spec__resources__gpus="h100:4"), HTTP_IDEMPOTENCY_KEY="retry-1")
    assert other.status_code == 422, other.content
    assert other.json()["jobId"] == first.json()["id"]
    assert error_paths(other) == []
    assert Job.objects.count() == 1


@pytest.mark.parametrize("key", ["", "   ", "k" * 101, "bad\tkey"], ids=["empty", "blank", "long", "tab"])
def test_bad_idempotency_keys_are_refused(api, alice, key):
    response = post_json(api(alice), job_spec(), HTTP_IDEMPOTENCY_KEY=key)
    assert response.status_code == 400
    assert error_paths(response) == ["header.Idempotency-Key"]
    assert not Job.objects.exists()


@pytest.mark.parametrize("flag", ["true", "1", "yes", "True"])
def test_dry_run_validates_and_creates_nothing(api, alice, flag):
    response = api(alice).post(f"{JOBS}?dryRun={flag}", job_spec(), format="json")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["valid"] is True and body["jobs"] == 1
    assert body["spec"]["resources"]["memoryBytes"] == 256 * GiB
    assert not Job.objects.exists() and not JobEvent.objects.exists()


def test_dry_run_still_refuses_an_invalid_spec(api, alice):
    response = api(alice).post(f"{JOBS}?dryRun=true", job_spec(spec__queue="nope"), format="json")
    assert response.status_code == 400
    assert error_paths(response) == ["spec.queue"]


# --- refusals ------------------------------------------------------------------------------

RESOURCES = "spec__resources__"
BAD_SPECS = [
    ("wrong-type-name", {"metadata__name": 7}, "metadata.name"),
    ("wrong-type-run", {"spec__run": ["python"]}, "spec.run"),
    ("wrong-type-nodes", {RESOURCES + "nodes": "two"}, "spec.resources.nodes"),
    ("wrong-type-resources", {"spec__resources": "lots"}, "spec.resources"),
    ("wrong-type-metadata", {"metadata": ["vision"]}, "metadata"),
    ("bool-cpus", {RESOURCES + "cpus": True}, "spec.resources.cpus"),
    ("negative-gpus", {RESOURCES + "gpus": "h100:-1"}, "spec.resources.gpus"),
    ("negative-gpu-int", {RESOURCES + "gpus": -2}, "spec.resources.gpus"),
    ("negative-gpu-count", {RESOURCES + "gpus": {"model": "h100", "count": -1}}, "spec.resources.gpus"),
    ("negative-cpus", {RESOURCES + "cpus": -1}, "spec.resources.cpus"),
    ("negative-memory", {RESOURCES + "memory": -5}, "spec.resources.memory"),
    ("zero-nodes", {RESOURCES + "nodes": 0}, "spec.resources.nodes"),
    ("negative-nodes", {RESOURCES + "nodes": -3}, "spec.resources.nodes"),
    ("unknown-top-field", {"status": "RUNNING"}, "status"),
    ("unknown-metadata-field", {"metadata__uid": "x"}, "metadata.uid"),
    ("unknown-spec-field", {"spec__gpu": 8}, "spec.gpu"),
    ("unknown-resources-field", {RESOURCES + "tpus": 8}, "spec.resources.tpus"),
    ("unknown-gpu-model", {RESOURCES + "gpus": "z9000:1"}, "spec.resources.gpus"),
    ("too-many-gpus-per-node", {RESOURCES + "gpus": "h100:16"}, "spec.resources.gpus"),
    ("more-a100s-than-a-node-has", {RESOURCES + "gpus": "a100:8"}, "spec.resources.gpus"),
    ("model-absent-from-fleet", {RESOURCES + "gpus": "mi300x:1"}, "spec.resources.gpus"),
    ("too-many-nodes", {RESOURCES + "nodes": 4}, "spec.resources.gpus"),
    ("nodes-over-the-maximum", {RESOURCES + "nodes": 5000}, "spec.resources.nodes"),
    ("unknown-queue", {"spec__queue": "gold"}, "spec.queue"),
    ("bad-queue-name", {"spec__queue": "Not A Queue"}, "spec.queue"),
    ("other-project", {"metadata__project": "nlp"}, "metadata.project"),
    ("unknown-project", {"metadata__project": "nowhere"}, "metadata.project"),
    ("missing-run", {"spec__run": DELETE}, "spec.run"),
    ("blank-run", {"spec__run": "   "}, "spec.run"),
    ("missing-name", {"metadata__name": DELETE}, "metadata.name"),
    ("bad-name", {"metadata__name": "-starts-with-dash"}, "metadata.name"),
    ("missing-api-version", {"apiVersion": DELETE}, "apiVersion"),
    ("wrong-api-version", {"apiVersion": "orrery/v2"}, "apiVersion"),
    ("wrong-kind", {"kind": "Pod"}, "kind"),
    ("missing-spec", {"spec": DELETE}, "spec"),
    ("time-limit-words", {"spec__timeLimit": "two hours"}, "spec.timeLimit"),
    ("time-limit-zero", {"spec__timeLimit": "0h"}, "spec.timeLimit"),
    ("time-limit-negative", {"spec__timeLimit": -5}, "spec.timeLimit"),
    ("time-limit-float", {"spec__timeLimit": 1.5}, "spec.timeLimit"),
    ("time-limit-over-a-year", {"spec__timeLimit": "400d"}, "spec.timeLimit"),
    ("time-limit-bare-iso", {"spec__timeLimit": "PT"}, "spec.timeLimit"),
    ("time-limit-bool", {"spec__timeLimit": True}, "spec.timeLimit"),
    ("bad-memory-unit", {RESOURCES + "memory": "256Qi"}, "spec.resources.memory"),
    ("bad-priority", {"spec__priority": "urgent"}, "spec.priority"),
    ("array-on-single-submit", {"spec__array": "0-3"}, "spec.array"),
    ("unknown-cluster", {"spec__placement": {"clusters": ["nowhere"]}}, "spec.placement.clusters[0]"),
    ("bad-env-name", {"spec__env": {"1BAD": "x"}}, "spec.env.1BAD"),
    ("nul-in-name", {"metadata__name": "a\x00b"}, "metadata.name"),
    ("nul-in-run", {"spec__run": "echo \x00"}, "spec.run"),
    ("nul-in-env", {"spec__env": {"A": "x\x00y"}}, "spec.env.A"),
    ("nul-in-label", {"metadata__labels": {"team": "\x00"}}, "metadata.labels.team"),
    ("nul-in-queue", {"spec__queue": "def\x00ault"}, "spec.queue"),
    ("nul-in-project", {"metadata__project": "vis\x00ion"}, "metadata.project"),
    ("nul-in-gpu-model", {RESOURCES + "gpus": "h1\x0000:8"}, "spec.resources.gpus"),
    (
        "nul-in-gpu-model-object",
        {RESOURCES + "gpus": {"model": "\x00", "count": 1}},
        "spec.resources.gpus.model",
    ),
    ("name-with-trailing-newline", {"metadata__name": "train\n"}, "metadata.name"),
    ("infinite-cpus-string", {RESOURCES + "cpus": "inf"}, "spec.resources.cpus"),
    ("huge-float-cpus", {RESOURCES + "cpus": 1e308}, "spec.resources.cpus"),
    ("memory-with-400-digits", {RESOURCES + "memory": "9" * 400}, "spec.resources.memory"),
    ("run-over-a-million-chars", {"spec__run": "x" * 1_000_001}, "spec.run"),
]


@pytest.mark.parametrize("changes, path", [c[1:] for c in BAD_SPECS], ids=[c[0] for c in BAD_SPECS])
def test_invalid_specs_are_a_400_naming_the_field(api, alice, nlp_queue, changes, path):
    response = post_json(api(alice), job_spec(**changes))
    assert response.status_code == 400, response.content
    assert path in error_paths(response)
    assert not Job.objects.exists()


def test_every_problem_is_reported_at_once(api, alice):
    document = job_spec(metadata__name=5, spec__queue=3, spec__timeLimit="soon", spec__nodes=2)
    response = post_json(api(alice), document)
    assert response.status_code == 400
    assert set(error_paths(response)) == {"metadata.name", "spec.queue", "spec.timeLimit", "spec.nodes"}


@pytest.mark.parametrize(
    "body, content_type, detail",
    [
        ('{"apiVersion": "orrery/v1",', "application/json", "JSON parse error"),
        ("{'single': 'quotes'}", "application/json", "JSON parse error"),
        ('{"cpus": NaN}', "application/json", "JSON parse error"),
        (b"\xff\xfe{}", "application/json", "JSON parse error"),
        ("metadata: {name: [unclosed", "application/yaml", "Malformed YAML"),
        ("a: b: c", "application/yaml", "Malformed YAML"),
        ("!!python/object/apply:os.system ['true']", "application/yaml", "Malformed YAML"),
        ("", "application/yaml", ""),
        ("- " + json.dumps(job_spec()), "application/yaml", "jobs/batch"),
        (json.dumps([job_spec()]), "application/json", "jobs/batch"),
        ("[" * 100_000 + "]" * 100_000, "application/json", "nested too deeply"),
        ('{"a":' * 100_000 + "1" + "}" * 100_000, "application/json", "nested too deeply"),
        ("[" * 100_000 + "]" * 100_000, "application/yaml", ""),
    ],
    ids=[
        "json-truncated",
        "json-single-quotes",
        "json-nan",
        "json-not-utf8",
        "yaml-unclosed",
        "yaml-bad-mapping",
        "yaml-python-tag",
        "yaml-empty",
        "yaml-list",
        "json-list",
        "json-nested-lists",
        "json-nested-objects",
        "yaml-nested-lists",
    ],
)
def test_unreadable_bodies_are_a_400(api, alice, body, content_type, detail):
    response = api(alice).post(JOBS, body, content_type=content_type)
    assert response.status_code == 400, response.content[:300]
    assert detail in response.json()["detail"]
    assert not Job.objects.exists()


def test_yaml_values_python_cannot_build_are_a_400(api, alice):
    response = post_yaml(api(alice), "apiVersion: orrery/v1\nmetadata: {name: 2026-02-30}\n")
    assert response.status_code == 400
    assert "Malformed YAML" in response.json()["detail"]


@pytest.mark.parametrize("charset", ["rot13", "bz2_codec", "no-such-charset"])
@pytest.mark.parametrize("content_type", ["application/json", "application/yaml"])
def test_odd_charsets_are_refused_or_ignored_never_a_500(api, alice, content_type, charset):
    response = api(alice).post(
        JOBS, json.dumps(job_spec()), content_type=f"{content_type}; charset={charset}"
    )
    assert response.status_code in (201, 400, 415), response.content


def test_null_document_is_a_400_naming_the_body(api, alice):
    response = post_json(api(alice), None)
    assert response.status_code == 400
    assert error_paths(response) == ["(body)"]


def test_unsupported_media_type_is_a_415(api, alice):
    response = api(alice).post(JOBS, "name=t", content_type="application/x-www-form-urlencoded")
    assert response.status_code == 415
    assert error_paths(response) == []


def test_a_body_over_the_upload_limit_is_a_413_in_the_error_format(api, alice):
    # A spec every field of which is within its own limits, 9 MiB in all.
    env = {f"VAR_{i}": "x" * 4000 for i in range(9 * 2**20 // 4000)}
    response = post_json(api(alice), job_spec(spec__env=env))
    assert response.status_code == 413, response.content[:200]
    assert response["Content-Type"] == "application/json"
    assert error_paths(response) == []
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    "field, value",
    [("state", "RUNNING"), ("owner", "bob"), ("id", 1), ("attempts", 3), ("exitCode", 0)],
)
@pytest.mark.parametrize("where", ["top", "metadata", "spec"])
def test_mass_assignment_is_refused_as_unknown_fields(api, alice, field, value, where):
    document = job_spec()
    target = document if where == "top" else document[where]
    target[field] = value
    response = post_json(api(alice), document)
    assert response.status_code == 400
    # How a top-level path is spelled is checked in test_invalid_specs_are_a_400_naming_the_field.
    paths = [p.removeprefix("(body).") for p in error_paths(response)]
    assert paths == [field if where == "top" else f"{where}.{field}"]
    assert not Job.objects.exists()


def test_labels_cannot_smuggle_state(api, alice):
    response = post_json(api(alice), job_spec(metadata__labels={"state": "RUNNING", "owner": "bob"}))
    assert response.status_code == 201
    job = Job.objects.get()
    assert (job.state, job.owner.username) == (JobState.PENDING, "alice")


# --- units ----------------------------------------------------------------------------------

UNITS = [
    ("memory-Gi", {RESOURCES + "memory": "256Gi"}, "memory_bytes_per_node", 256 * GiB),
    ("memory-G-is-binary", {RESOURCES + "memory": "256G"}, "memory_bytes_per_node", 256 * GiB),
    ("memory-GB-is-binary", {RESOURCES + "memory": "256GB"}, "memory_bytes_per_node", 256 * GiB),
    ("memory-bare-number-is-MiB", {RESOURCES + "memory": 512}, "memory_bytes_per_node", 512 * MiB),
    ("memory-bare-string-is-MiB", {RESOURCES + "memory": "512"}, "memory_bytes_per_node", 512 * MiB),
    ("memory-Mi", {RESOURCES + "memory": "1536Mi"}, "memory_bytes_per_node", 1536 * MiB),
    ("memory-fraction", {RESOURCES + "memory": "1.5Ti"}, "memory_bytes_per_node", 1536 * GiB),
    ("memory-absent", {RESOURCES + "memory": DELETE}, "memory_bytes_per_node", 0),
    ("cpus-millicores", {RESOURCES + "cpus": "500m"}, "cpu_millicores_per_node", 500),
    ("cpus-fraction", {RESOURCES + "cpus": 0.5}, "cpu_millicores_per_node", 500),
    ("cpus-string", {RESOURCES + "cpus": "2"}, "cpu_millicores_per_node", 2000),
    ("cpus-integer", {RESOURCES + "cpus": 32}, "cpu_millicores_per_node", 32_000),
    ("time-hours", {"spec__timeLimit": "2h"}, "time_limit_s", 7200),
    ("time-compound", {"spec__timeLimit": "1h30m"}, "time_limit_s", 5400),
    ("time-slurm-days", {"spec__timeLimit": "1-00:00:00"}, "time_limit_s", 86400),
    ("time-slurm-hms", {"spec__timeLimit": "01:30:00"}, "time_limit_s", 5400),
    ("time-slurm-mm-ss", {"spec__timeLimit": "90:30"}, "time_limit_s", 5430),
    ("time-iso", {"spec__timeLimit": "PT2H"}, "time_limit_s", 7200),
    ("time-iso-days", {"spec__timeLimit": "P1DT2H"}, "time_limit_s", 93600),
    ("time-bare-minutes", {"spec__timeLimit": 90}, "time_limit_s", 5400),
    ("time-string-minutes", {"spec__timeLimit": "90"}, "time_limit_s", 5400),
    ("time-absent", {"spec__timeLimit": DELETE}, "time_limit_s", None),
    ("gpus-gres-form", {RESOURCES + "gpus": "gpu:h100:4"}, "gpus_per_node", 4),
    ("gpus-object", {RESOURCES + "gpus": {"model": "H100", "count": 2}}, "gpus_per_node", 2),
    ("gpus-model-only", {RESOURCES + "gpus": "h100"}, "gpus_per_node", 1),
    ("gpus-zero", {RESOURCES + "gpus": 0}, "gpus_per_node", 0),
    ("gpus-slug", {RESOURCES + "gpus": "a100-80g:4"}, "gpus_per_node", 4),
    ("priority-name", {"spec__priority": "high"}, "priority", 100),
    ("priority-number", {"spec__priority": -7}, "priority", -7),
    ("nodes-gang", {RESOURCES + "nodes": 3}, "nodes", 3),
]


@pytest.mark.parametrize("changes, field, expected", [u[1:] for u in UNITS], ids=[u[0] for u in UNITS])
def test_units_are_normalised(api, alice, changes, field, expected):
    response = post_json(api(alice), job_spec(**changes))
    assert response.status_code == 201, response.content
    assert getattr(Job.objects.get(pk=response.json()["id"]), field) == expected


@pytest.mark.parametrize(
    "gpus, model",
    [("h100:8", "h100-80g"), ("a100:4", "a100-80g"), (0, None), ("h100:0", None)],
)
def test_gpu_model_is_resolved_from_aliases(api, alice, gpus, model):
    response = post_json(api(alice), job_spec(spec__resources__gpus=gpus))
    assert response.status_code == 201, response.content
    job = Job.objects.get()
    assert (job.gpu_model.slug if job.gpu_model else None) == model
    assert response.json()["resources"]["gpus"]["model"] == model


def test_an_image_job_goes_only_where_images_run(api, alice):
    from tests.factories import make_cluster, make_node

    lab = make_cluster("lab", kind="native")
    make_node(lab, gpus=8, model="h100", name="lab-1")
    image_only = job_spec(spec__image="ghcr.io/acme/train:1", spec__run=DELETE)
    answer = post_json(api(alice), image_only)
    assert answer.status_code == 201, answer.content
    assert answer.json()["spec"]["placement"]["clusters"] == ["sim-a"]  # not the native lab
    assert Job.objects.get(pk=answer.json()["id"]).placement["clusters"] == ["sim-a"]


def test_an_image_job_for_clusters_that_cannot_run_images_is_refused_at_submission(api, alice):
    from tests.factories import make_cluster, make_node

    lab = make_cluster("lab", kind="native")
    make_node(lab, gpus=8, model="h100", name="lab-1")
    pinned = job_spec(
        spec__image="ghcr.io/acme/train:1", spec__run=DELETE, spec__placement={"clusters": ["lab"]}
    )
    answer = post_json(api(alice), pinned)
    assert answer.status_code == 400
    assert error_paths(answer) == ["spec.image"]
    assert "none of the clusters lab can run container images" in answer.content.decode()
    assert not Job.objects.exists()


def test_a_command_job_never_goes_where_only_images_run(api, alice):
    from tests.factories import make_cluster, make_node

    k8s = make_cluster("k8s", kind="kubernetes", identity="shared")
    make_node(k8s, gpus=8, model="h100", name="k8s-1")
    answer = post_json(api(alice), job_spec())
    assert answer.status_code == 201, answer.content
    assert answer.json()["spec"]["placement"]["clusters"] == ["sim-a"]  # anywhere but Kubernetes
    pinned = post_json(api(alice), job_spec(spec__placement={"clusters": ["k8s"]}))
    assert pinned.status_code == 400
    assert error_paths(pinned) == ["spec.image"]
    assert "cluster k8s runs container images only; give `image`" in pinned.content.decode()
    image = job_spec(spec__image="ghcr.io/acme/train:1", spec__placement={"clusters": ["k8s"]})
    assert post_json(api(alice), image).status_code == 201
