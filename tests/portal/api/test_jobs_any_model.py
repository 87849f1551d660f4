"""POST /api/v1/jobs with GPUs of any model and with preemption settings: what the job stores,
what is refused (unknown models in a preference, a request no model of the fleet can ever
hold, a grace period beyond the queue's), and that each refusal names its field.

The fleet (tests/portal/api/conftest.py): three nodes of 8 h100 and one of 4 a100."""

from __future__ import annotations

import json

import pytest

from scheduling.models import Job
from scheduling.services.preemption import stop_terms
from tests.portal.api.conftest import error_paths, job_spec

pytestmark = pytest.mark.usefixtures("fleet", "queue")

JOBS = "/api/v1/jobs"
GPUS = "spec__resources__gpus"


def post(client, document, **extra):
    return client.post(JOBS, json.dumps(document), content_type="application/json", **extra)


@pytest.mark.parametrize("gpus", [2, "2", "gpu:2", {"count": 2}, {"count": 2, "models": []}])
def test_any_model_waits_without_a_model_and_allows_every_model(api, alice, gpus):
    response = post(api(alice), job_spec(**{GPUS: gpus}))
    assert response.status_code == 201, response.content
    job = Job.objects.get()
    assert (job.gpu_model, job.gpus_per_node, job.placement["gpuModels"]) == (None, 2, [])
    body = response.json()
    assert (body["gpuModel"], body["gpuModels"], body["resources"]["gpus"]) == (
        None,
        [],
        {"model": None, "count": 2},
    )
    assert body["spec"]["resources"]["gpus"] == {"model": None, "models": [], "count": 2}


def test_a_preference_is_stored_as_slugs_best_first(api, alice):
    document = job_spec(**{GPUS: {"count": 4, "models": ["a100", "H100", "h100-80g"]}})
    response = post(api(alice), document)
    assert response.status_code == 201, response.content
    job = Job.objects.get()
    # Aliases are resolved, and an alias and its slug are one model.
    assert job.gpu_model is None and job.placement["gpuModels"] == ["a100-80g", "h100-80g"]
    assert response.json()["gpuModels"] == ["a100-80g", "h100-80g"]
    assert job.spec["resources"]["gpus"]["models"] == ["a100-80g", "h100-80g"]


def test_a_named_model_is_unchanged_and_has_no_preference(api, alice):
    response = post(api(alice), job_spec(**{GPUS: "h100:8"}))
    assert response.status_code == 201, response.content
    job = Job.objects.get()
    assert job.gpu_model.slug == "h100-80g" and "gpuModels" not in job.placement
    body = response.json()
    assert (body["gpuModel"], body["gpuModels"]) == ("h100-80g", None)
    assert body["spec"]["resources"]["gpus"] == {"model": "h100-80g", "count": 8}


def test_no_gpus_has_no_preference(api, alice):
    response = post(api(alice), job_spec(**{GPUS: 0}))
    assert response.status_code == 201, response.content
    assert "gpuModels" not in Job.objects.get().placement
    assert (response.json()["gpuModel"], response.json()["gpuModels"]) == (None, None)


REFUSED = [
    (
        "unknown-in-preference",
        {GPUS: {"count": 1, "models": ["h100", "z9000"]}},
        "spec.resources.gpus.models[1]",
    ),
    ("absent-from-fleet", {GPUS: {"count": 1, "models": ["mi300x"]}}, "spec.resources.gpus"),
    ("more-than-the-allowed-model-has", {GPUS: {"count": 8, "models": ["a100"]}}, "spec.resources.gpus"),
    # Four nodes of 4 GPUs of one model: three h100 nodes and one a100 node make four nodes,
    # but a gang is of one model, so it can never run.
    ("gang-across-models", {GPUS: 4, "spec__resources__nodes": 4}, "spec.resources.gpus"),
    ("more-nodes-than-any-model", {GPUS: 1, "spec__resources__nodes": 4}, "spec.resources.gpus"),
    ("over-a-node", {GPUS: 16}, "spec.resources.gpus"),
    ("model-and-models", {GPUS: {"model": "h100", "models": ["a100"]}}, "spec.resources.gpus.models"),
    ("bad-preference-item", {GPUS: {"count": 1, "models": [{"h100": 1}]}}, "spec.resources.gpus.models[0]"),
    ("grace-over-the-queues", {"spec__preemption": {"grace": "31s"}}, "spec.preemption.grace"),
    ("grace-bare-minutes", {"spec__preemption": {"grace": 1}}, "spec.preemption.grace"),
    ("bad-signal", {"spec__preemption": {"signal": "KILL"}}, "spec.preemption.signal"),
    ("preemptible-text", {"spec__preemptible": "false"}, "spec.preemptible"),
]


@pytest.mark.parametrize("changes, path", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refusals_name_the_field(api, alice, changes, path):
    response = post(api(alice), job_spec(**changes))
    assert response.status_code == 400, response.content
    assert error_paths(response) == [path]
    assert not Job.objects.exists()


def test_every_unknown_model_of_a_preference_is_named(api, alice):
    response = post(api(alice), job_spec(**{GPUS: {"count": 1, "models": ["z1", "a100", "z2"]}}))
    assert response.status_code == 400
    assert error_paths(response) == ["spec.resources.gpus.models[0]", "spec.resources.gpus.models[2]"]


def test_an_unknown_model_of_a_preference_is_named_in_the_message(api, alice):
    response = post(api(alice), job_spec(**{GPUS: {"count": 1, "models": ["h100", "z9000"]}}))
    assert response.json()["errors"][0]["message"] == "unknown GPU model 'z9000'"


def test_the_capacity_refusal_says_which_models_it_considered(api, alice):
    response = post(api(alice), job_spec(**{GPUS: {"count": 8, "models": ["a100"]}}))
    message = response.json()["errors"][0]["message"]
    assert "any of a100-80g" in message and "the most of one model on one node is 4" in message
    anything = post(api(alice), job_spec(**{GPUS: 4, "spec__resources__nodes": 4}))
    assert "any model" in anything.json()["errors"][0]["message"]


def test_an_any_model_gang_that_one_model_can_hold_is_accepted(api, alice):
    response = post(api(alice), job_spec(**{GPUS: {"count": 8}, "spec__resources__nodes": 3}))
    assert response.status_code == 201, response.content
    assert Job.objects.get().nodes == 3


def test_a_batch_names_the_spec_and_the_model_at_fault(api, alice):
    body = {
        "jobs": [
            job_spec(**{GPUS: 1}),
            job_spec(**{GPUS: {"count": 1, "models": ["a100", "nope"]}}),
        ]
    }
    response = api(alice).post(f"{JOBS}/batch", body, format="json")
    assert response.status_code == 400, response.content
    assert error_paths(response) == ["jobs[1].spec.resources.gpus.models[1]"]
    assert not Job.objects.exists()


def test_an_any_model_array_shares_its_preference(api, alice):
    spec = job_spec(**{GPUS: {"count": 1, "models": ["h100", "a100"]}}, spec__array="0-2")
    response = api(alice).post(f"{JOBS}/batch", {"jobs": [spec]}, format="json")
    assert response.status_code == 201, response.content
    assert [j.placement["gpuModels"] for j in Job.objects.order_by("pk")] == [["h100-80g", "a100-80g"]] * 3


def test_a_retry_with_the_same_key_finds_the_any_model_job(api, alice):
    client, document = api(alice), job_spec(**{GPUS: {"count": 2, "models": ["h100"]}})
    first = post(client, document, HTTP_IDEMPOTENCY_KEY="k")
    again = post(client, document, HTTP_IDEMPOTENCY_KEY="k")
    assert (first.status_code, again.status_code) == (201, 200)
    other = post(client, job_spec(**{GPUS: {"count": 2, "models": ["a100"]}}), HTTP_IDEMPOTENCY_KEY="k")
    assert other.status_code == 422  # another preference is another request
    assert Job.objects.count() == 1


def test_dry_run_shows_the_normalised_request(api, alice):
    document = job_spec(**{GPUS: {"count": 2, "models": ["a100"]}}, spec__preemption={"signal": "SIGUSR1"})
    response = api(alice).post(f"{JOBS}?dryRun=true", document, format="json")
    assert response.status_code == 200, response.content
    spec = response.json()["spec"]
    assert spec["resources"]["gpus"] == {"model": None, "models": ["a100-80g"], "count": 2}
    assert (spec["preemptible"], spec["preemption"]) == (True, {"signal": "USR1", "graceSeconds": None})
    assert not Job.objects.exists()


# --- preemption settings -----------------------------------------------------------------------


def test_a_job_is_preemptible_unless_it_says_otherwise(api, alice):
    client = api(alice)
    default = post(client, job_spec())
    never = post(client, job_spec(spec__preemptible=False))
    assert (default.json()["preemptible"], never.json()["preemptible"]) == (True, False)
    assert list(Job.objects.order_by("pk").values_list("preemptible", flat=True)) == [True, False]
    assert never.json()["spec"]["preemptible"] is False


def test_the_stored_preemption_is_what_a_preemption_reads(api, alice, queue):
    response = post(api(alice), job_spec(spec__preemption={"signal": "SIGUSR1", "grace": "20s"}))
    assert response.status_code == 201, response.content
    job = Job.objects.get()
    assert job.spec["preemption"] == {"signal": "USR1", "graceSeconds": 20}
    assert stop_terms(job.spec, queue.preemption_grace_s) == ("USR1", 20)


def test_without_a_grace_the_queues_applies(api, alice, queue):
    post(api(alice), job_spec())
    job = Job.objects.get()
    assert job.spec["preemption"] == {"signal": "TERM", "graceSeconds": None}
    assert stop_terms(job.spec, queue.preemption_grace_s) == ("TERM", queue.preemption_grace_s)


def test_a_grace_up_to_the_queues_is_accepted_and_past_it_refused_with_the_maximum(api, alice, queue):
    queue.preemption_grace_s = 300
    queue.save(update_fields=["preemption_grace_s"])
    client = api(alice)
    assert post(client, job_spec(spec__preemption={"grace": "5m"})).status_code == 201
    refused = post(client, job_spec(spec__preemption={"grace": "5m1s"}))
    assert refused.status_code == 400
    assert refused.json()["errors"] == [
        {
            "path": "spec.preemption.grace",
            "message": "queue vision/default gives a preempted job at most 300 seconds between its "
            "signal and the kill; ask for less (a bare number is minutes: write e.g. 30s)",
        }
    ]
    assert Job.objects.count() == 1
