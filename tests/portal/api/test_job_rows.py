"""``job_rows`` writes out what ``JobSerializer`` would: the same rows, keys in the same order,
the same JSON, for jobs in every shape the API shows (waiting, held, an array's members with and
without the ``arrays=summary`` rows, placed, finished, fine-grained, any-model, an estimated
start), and for the jobs a batch submission answers with from memory."""

from __future__ import annotations

import json
from datetime import timedelta

from django.utils import timezone
from rest_framework.renderers import JSONRenderer

from portal.api.serializers import JobSerializer, job_rows
from scheduling.choices import JobState
from scheduling.models import Job
from scheduling.selectors import array_rows, collapse_waiting_members, jobs_with_placement
from scheduling.services.allocations import NodePlacement, bind_job
from tests.factories import make_job
from tests.portal.api.conftest import job_spec


def same(rows: list[dict], data: list[dict]) -> None:
    assert [list(row) for row in rows] == [list(row) for row in data]  # keys, in order
    assert rows == [dict(row) for row in data]
    assert JSONRenderer().render(rows) == JSONRenderer().render(data)


def varied_jobs(api, alice, queue, fleet) -> None:
    now = timezone.now()
    response = api(alice).post(
        "/api/v1/jobs/batch",
        {"jobs": [job_spec(metadata__name="sweep", spec__array="0-5%2"), job_spec(metadata__name="one")]},
        format="json",
    )
    assert response.status_code == 201, response.content
    make_job(alice, queue, state=JobState.HELD, reason="Held", labels={"team": "ml", "ünï": "cödé"})
    make_job(alice, queue, reason_message="Waiting for 8 GPUs of h100", priority=7, time_limit_s=3600)
    make_job(
        alice, queue, estimated_start_at=now + timedelta(minutes=5), estimated_where="sim-a", reserved=True
    )
    make_job(alice, queue, gpus=0, model="", preemptible=False)
    make_job(alice, queue, gpus=1, gpu_slice="1g.10gb")
    make_job(alice, queue, gpus=1, gpu_memory_mb=20_000)
    make_job(alice, queue, gpus=1, gpu_share=0.25)
    any_model = make_job(alice, queue, gpus=2, placement={"gpuModels": ["h100", "a100"]})
    Job.objects.filter(pk=any_model.pk).update(gpu_model=None)
    placed = make_job(alice, queue, gpus=2)
    bind_job(placed, [NodePlacement(fleet.h100[1], [3, 5])])
    make_job(
        alice,
        queue,
        state=JobState.FAILED,
        started_at=now - timedelta(hours=1),
        finished_at=now,
        exit_code=137,
        checkpointed_at=now - timedelta(minutes=30),
    )


def test_rows_read_back_are_the_serializers(api, alice, queue, fleet):
    varied_jobs(api, alice, queue, fleet)
    jobs = list(jobs_with_placement(Job.objects.order_by("id")))
    assert len(jobs) == 17
    same(job_rows(jobs), JobSerializer(jobs, many=True).data)


def test_summary_rows_are_the_serializers(api, alice, queue, fleet):
    varied_jobs(api, alice, queue, fleet)
    filtered = Job.objects.all()
    page = list(jobs_with_placement(collapse_waiting_members(filtered).order_by("id")))
    context = {"array_rows": array_rows(filtered, page)}
    assert any(row.count > 1 for row in context["array_rows"].values())
    same(job_rows(page, context), JobSerializer(page, many=True, context=context).data)


def test_a_batch_answers_with_the_rows_a_read_shows(api, alice, queue, fleet):
    specs = [job_spec(metadata__name=f"j{i}", metadata__labels={"i": str(i)}) for i in range(40)]
    specs.append(job_spec(metadata__name="sweep", spec__array="0-3"))
    response = api(alice).post("/api/v1/jobs/batch", {"jobs": specs}, format="json")
    assert response.status_code == 201, response.content
    answered = response.json()["jobs"]
    read = JobSerializer(jobs_with_placement(Job.objects.order_by("id")), many=True).data
    assert answered == json.loads(JSONRenderer().render(read))


def test_a_one_job_answer_is_the_jobs_detail(api, alice, queue, fleet):
    """``POST jobs`` answers a new job from memory with ``job_rows`` and its spec: the very body
    ``GET jobs/{id}`` (``JobDetailSerializer``) then shows, keys in the same order."""
    client = api(alice)
    for document in (job_spec(), job_spec(metadata__labels={"team": "ünï"}, spec__timeLimit="90m")):
        answer = client.post("/api/v1/jobs", document, format="json")
        assert answer.status_code == 201, answer.content
        shown = client.get(f"/api/v1/jobs/{answer.json()['id']}")
        assert list(answer.json()) == list(shown.json())
        assert answer.json() == shown.json()
