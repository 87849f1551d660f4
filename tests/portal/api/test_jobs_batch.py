"""POST /api/v1/jobs/batch: many specs in one transaction, array expansion, idempotency, caps."""

from __future__ import annotations

import json

import pytest
import yaml

from scheduling.models import Job, JobEvent
from tests.factories import make_job, make_user
from tests.portal.api.conftest import error_paths, job_spec

pytestmark = pytest.mark.usefixtures("fleet", "queue")

BATCH = "/api/v1/jobs/batch"


def post_batch(client, documents, **extra):
    return client.post(BATCH, json.dumps({"jobs": documents}), content_type="application/json", **extra)


def names(response):
    return [job["name"] for job in response.json()["jobs"]]


def test_batch_json_creates_every_job(api, alice):
    response = post_batch(api(alice), [job_spec(metadata__name=n) for n in ("a", "b", "c")])
    assert response.status_code == 201, response.content
    assert response.json()["count"] == 3 and names(response) == ["a", "b", "c"]
    assert sorted(Job.objects.values_list("name", flat=True)) == ["a", "b", "c"]
    assert JobEvent.objects.count() == 3


def test_batch_yaml_list(api, alice):
    text = yaml.safe_dump([job_spec(metadata__name="a"), job_spec(metadata__name="b")])
    response = api(alice).post(BATCH, text, content_type="application/yaml")
    assert response.status_code == 201, response.content
    assert names(response) == ["a", "b"]


def test_batch_multi_document_yaml(api, alice):
    text = yaml.safe_dump_all([job_spec(metadata__name=n) for n in ("a", "b", "c")])
    assert text.count("---") >= 2 or "\n---" in text  # several documents, not one list
    response = api(alice).post(BATCH, text, content_type="application/yaml")
    assert response.status_code == 201, response.content
    assert names(response) == ["a", "b", "c"]


@pytest.mark.parametrize(
    "bad, path",
    [
        (job_spec(spec__resources__gpus="h100:-1"), "jobs[1].spec.resources.gpus"),
        (job_spec(spec__resources__gpus="z9000:1"), "jobs[1].spec.resources.gpus"),
        (job_spec(metadata__project="nlp"), "jobs[1].metadata.project"),
        (job_spec(spec__queue="gold"), "jobs[1].spec.queue"),
        (job_spec(spec__extra=1), "jobs[1].spec.extra"),
        (job_spec(state="RUNNING"), "jobs[1].state"),
        ("not a spec", "jobs[1]"),
        (None, "jobs[1]"),
    ],
    ids=[
        "negative-gpus",
        "unknown-model",
        "other-project",
        "unknown-queue",
        "unknown-field",
        "state",
        "string",
        "null",
    ],
)
def test_one_bad_spec_refuses_the_whole_batch(api, alice, nlp_queue, bad, path):
    response = post_batch(api(alice), [job_spec(metadata__name="good"), bad, job_spec(metadata__name="x")])
    assert response.status_code == 400, response.content
    assert path in error_paths(response)
    assert not Job.objects.exists()


def test_a_batch_of_only_null_is_a_400(api, alice):
    response = post_batch(api(alice), [None])
    assert response.status_code == 400
    assert error_paths(response) == ["jobs[0]"]


def test_every_bad_spec_of_a_batch_is_reported(api, alice):
    documents = [job_spec(spec__queue="gold"), job_spec(), job_spec(metadata__name=1)]
    response = post_batch(api(alice), documents)
    assert response.status_code == 400
    assert error_paths(response) == ["jobs[0].spec.queue", "jobs[2].metadata.name"]


@pytest.mark.parametrize(
    "body",
    [{"jobs": []}, {"jobs": {"a": 1}}, {}, {"jobs": [job_spec()], "extra": 1}, job_spec(), "[]"],
    ids=["empty-list", "mapping", "empty-object", "extra-key", "single-spec", "string"],
)
def test_batch_needs_a_non_empty_list(api, alice, body):
    response = api(alice).post(BATCH, json.dumps(body), content_type="application/json")
    assert response.status_code == 400
    assert error_paths(response) == ["jobs"]
    assert not Job.objects.exists()


def test_batch_size_is_capped(api, alice):
    response = post_batch(api(alice), [job_spec()] * 1001)
    assert response.status_code == 400
    assert error_paths(response) == ["jobs"]


@pytest.mark.parametrize(
    "array, expected",
    [
        ("0-9", list(range(10))),
        ("0-9:2", [0, 2, 4, 6, 8]),
        ("1,3,5-7", [1, 3, 5, 6, 7]),
        ("7", [7]),
        (4, [4]),
    ],
    ids=["range", "step", "list", "single", "integer"],
)
def test_array_expands_server_side(api, alice, array, expected):
    response = post_batch(api(alice), [job_spec(metadata__name="sweep", spec__array=array)])
    assert response.status_code == 201, response.content
    assert names(response) == [f"sweep-{i}" for i in expected]
    jobs = Job.objects.order_by("id")
    assert jobs.count() == len(expected)
    for job, index in zip(jobs, expected, strict=True):
        assert job.labels == {"orrery.io/array": "sweep", "orrery.io/array-index": str(index)}
        assert job.spec["env"]["ORRERY_ARRAY_INDEX"] == str(index)
        assert job.spec["arrayIndex"] == index


@pytest.mark.parametrize(
    "array",
    ["9-0", "0-9:0", "a-b", "0-10000", "", True],
    ids=["reversed", "zero-step", "letters", "over-max", "empty", "bool"],
)
def test_bad_arrays_are_refused(api, alice, array):
    response = post_batch(api(alice), [job_spec(spec__array=array)])
    assert response.status_code == 400
    assert error_paths(response) == ["jobs[0].spec.array"]
    assert not Job.objects.exists()


def test_array_names_longer_than_a_job_name_may_be_are_a_400(api, alice):
    response = post_batch(api(alice), [job_spec(metadata__name="n" * 128, spec__array="0-1")])
    assert response.status_code == 400, response.content[:300]
    assert any(p.startswith("jobs[0].") for p in error_paths(response))
    assert not Job.objects.exists()


def test_batch_idempotency(api, alice):
    client = api(alice)
    documents = [job_spec(metadata__name="a"), job_spec(metadata__name="b", spec__array="0-2")]
    first = post_batch(client, documents, HTTP_IDEMPOTENCY_KEY="batch-1")
    again = post_batch(client, documents, HTTP_IDEMPOTENCY_KEY="batch-1")
    assert (first.status_code, again.status_code) == (201, 200)
    ids = [j["id"] for j in first.json()["jobs"]]
    assert len(ids) == 4 and [j["id"] for j in again.json()["jobs"]] == ids
    assert Job.objects.count() == 4

    other = post_batch(client, [job_spec(metadata__name="z"), documents[1]], HTTP_IDEMPOTENCY_KEY="batch-1")
    longer = post_batch(client, [*documents, job_spec()], HTTP_IDEMPOTENCY_KEY="batch-1")
    assert (other.status_code, longer.status_code) == (422, 422)
    assert Job.objects.count() == 4


@pytest.mark.parametrize(
    "first, second",
    [(["a", "b"], ["a"]), (["a"], ["a", "b"])],
    ids=["two-then-one", "one-then-two"],
)
def test_a_key_reused_for_a_batch_of_another_size_is_a_422(api, alice, first, second):
    client = api(alice)
    created = post_batch(client, [job_spec(metadata__name=n) for n in first], HTTP_IDEMPOTENCY_KEY="k")
    reused = post_batch(client, [job_spec(metadata__name=n) for n in second], HTTP_IDEMPOTENCY_KEY="k")
    assert created.status_code == 201
    assert reused.status_code == 422, reused.content[:200]
    assert Job.objects.count() == len(first)


def test_idempotency_keys_are_per_user(api, alice, vision):
    carol = make_user("carol")
    vision.memberships.create(user=carol)
    a = post_batch(api(alice), [job_spec()], HTTP_IDEMPOTENCY_KEY="k")
    c = post_batch(api(carol), [job_spec()], HTTP_IDEMPOTENCY_KEY="k")
    assert (a.status_code, c.status_code) == (201, 201)
    assert a.json()["jobs"][0]["id"] != c.json()["jobs"][0]["id"]


def test_project_cap_on_waiting_jobs_refuses_the_batch(api, alice, queue, settings):
    settings.ORRERY_MAX_WAITING_JOBS_PER_PROJECT = 3
    make_job(alice, queue)
    response = post_batch(api(alice), [job_spec(metadata__name=f"j{i}") for i in range(3)])
    assert response.status_code == 429, response.content
    assert int(response["Retry-After"]) > 0
    assert error_paths(response) == []
    assert Job.objects.count() == 1

    fits = post_batch(api(alice), [job_spec(metadata__name=f"j{i}") for i in range(2)])
    assert fits.status_code == 201
    full = api(alice).post("/api/v1/jobs", job_spec(), format="json")
    assert full.status_code == 429 and full.has_header("Retry-After")
    assert Job.objects.count() == 3


def test_queue_cap_on_pending_jobs(api, alice, queue):
    queue.max_pending_jobs = 2
    queue.save()
    response = post_batch(api(alice), [job_spec(metadata__name="sweep", spec__array="0-2")])
    assert response.status_code == 429
    assert response.has_header("Retry-After")
    assert not Job.objects.exists()
    assert post_batch(api(alice), [job_spec(spec__array="0-1")]).status_code == 201


def test_running_jobs_do_not_count_against_the_cap(api, alice, queue, settings):
    settings.ORRERY_MAX_WAITING_JOBS_PER_PROJECT = 1
    for state in ("RUNNING", "SUCCEEDED", "CANCELLED"):
        make_job(alice, queue, state=state)
    assert post_batch(api(alice), [job_spec()]).status_code == 201


def test_a_retry_at_the_cap_still_returns_the_first_jobs(api, alice, settings):
    settings.ORRERY_MAX_WAITING_JOBS_PER_PROJECT = 2
    client = api(alice)
    documents = [job_spec(metadata__name="a"), job_spec(metadata__name="b")]
    first = post_batch(client, documents, HTTP_IDEMPOTENCY_KEY="k")
    again = post_batch(client, documents, HTTP_IDEMPOTENCY_KEY="k")
    assert (first.status_code, again.status_code) == (201, 200)


def test_a_large_batch_keeps_copys_own_markers_as_text(api, alice):
    """A batch of many specs is written with COPY, whose text format gives meaning to a tab, a
    newline, a backslash, ``\\N`` (NULL) and ``\\.`` (end of data). A client may put all of them
    in a command or a label: each must be stored as sent, every job made, nothing cut short."""
    hostile = ["a\tb", "line\nbreak\r", "\\N", "\\.", "\\", "end\\\n\\.\nmore", "zé 🚀 \\t"]
    specs = [
        job_spec(
            metadata__name=f"m{i}",
            metadata__labels={"note": hostile[i % len(hostile)]},
            spec__run=f"echo {hostile[i % len(hostile)]}",
        )
        for i in range(40)
    ]
    response = post_batch(api(alice), specs)
    assert response.status_code == 201, response.content
    stored = {j.name: j for j in Job.objects.filter(owner=alice)}
    assert len(stored) == 40
    for i in range(40):
        text = hostile[i % len(hostile)]
        assert (stored[f"m{i}"].command, stored[f"m{i}"].labels) == (f"echo {text}", {"note": text})
    assert JobEvent.objects.filter(job__owner=alice).count() == 40
