"""POST /api/v1/jobs with ``spec.dependency``: a dependent waits with the reason ``Dependency``
and shows what it waits for; junk, jobs one cannot see and dependencies that can never be met
are refused with the field's path."""

from __future__ import annotations

import json

import pytest

from scheduling.choices import JobState
from scheduling.models import Job
from scheduling.services.transitions import transition_job
from tests.factories import make_job
from tests.portal.api.conftest import error_paths, job_spec

pytestmark = pytest.mark.usefixtures("fleet", "queue")

JOBS = "/api/v1/jobs"


def post(client, document, url=JOBS):
    return client.post(url, json.dumps(document), content_type="application/json")


def test_a_dependent_waits_and_shows_what_for(api, alice, queue):
    target = make_job(alice, queue, state=JobState.RUNNING)
    response = post(api(alice), job_spec(spec__dependency=f"afterok:{target.pk}"))
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["state"], body["reason"], body["reasonMessage"]) == (
        "PENDING",
        "Dependency",
        f"waits for {target.pk} (afterok)",
    )
    assert body["dependency"] == [{"kind": "afterok", "job": str(target.pk), "state": "waiting"}]
    transition_job(target.pk, JobState.SUCCEEDED)
    shown = api(alice).get(f"{JOBS}/{body['id']}").json()
    assert (shown["reason"], shown["dependency"][0]["state"]) == ("None", "met")


def test_a_job_without_dependencies_shows_none(api, alice):
    response = post(api(alice), job_spec())
    assert response.json()["dependency"] == []


REFUSED = [
    ("junk", "afterok:x", "spec.dependency"),
    ("any-of", "afterok:1?afterany:2", "spec.dependency"),
    ("mapping-item", {"afterok": ["1", "1_x"]}, "spec.dependency.afterok[1]"),
    ("missing", "afterok:987654321", "spec.dependency"),
]


@pytest.mark.parametrize("dependency, path", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refusals_name_the_field(api, alice, dependency, path):
    response = post(api(alice), job_spec(spec__dependency=dependency))
    assert response.status_code == 400, response.content
    assert error_paths(response) == [path]
    assert not Job.objects.exists()


def test_a_dependency_that_can_never_be_met_is_refused(api, alice, queue):
    failed = make_job(alice, queue, state=JobState.FAILED)
    response = post(api(alice), job_spec(spec__dependency=f"afterok:{failed.pk}"))
    assert response.status_code == 400
    assert response.json()["errors"] == [
        {
            "path": "spec.dependency",
            "message": f"job {failed.pk} already ended FAILED; afterok can never be met",
        }
    ]


def test_another_projects_job_is_not_revealed(api, alice, bob_job):
    Job.objects.filter(pk=bob_job.pk).update(state=JobState.FAILED)
    response = post(api(alice), job_spec(spec__dependency=f"afterany:{bob_job.pk}"))
    assert response.status_code == 400
    assert response.json()["errors"][0]["message"] == f"no job {bob_job.pk} you can see"


def test_a_batch_names_the_job_at_fault(api, alice):
    documents = [
        job_spec(metadata__name="fine"),
        job_spec(metadata__name="bad", spec__dependency="afterok:99999"),
    ]
    response = post(api(alice), {"jobs": documents}, url=f"{JOBS}/batch")
    assert response.status_code == 400
    assert response.json()["errors"] == [
        {"path": "spec.dependency", "message": "bad: no job 99999 you can see"}
    ]
    assert not Job.objects.exists()
