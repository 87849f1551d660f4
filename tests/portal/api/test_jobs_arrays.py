"""Arrays through the API: ``ID_INDEX`` refs, the ``%`` throttle, actions on a whole array or a
range of members, the summary rows of the job list and ``arrays/{id}``."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest

from foundation.models import AuditEntry
from portal.choices import Role
from portal.models import Membership
from scheduling.choices import JobState
from scheduling.models import Job
from tests.factories import make_job, make_user
from tests.portal.api.conftest import error_paths, job_spec

pytestmark = pytest.mark.usefixtures("fleet", "queue")

JOBS = "/api/v1/jobs"


def submit_array(client, indices="0-5%2", name="sweep", **more):
    body = {"jobs": [job_spec(metadata__name=name, spec__array=indices, **more)]}
    response = client.post(f"{JOBS}/batch", json.dumps(body), content_type="application/json")
    assert response.status_code == 201, response.content
    return response.json()["jobs"]


def url(ref, action=""):
    return f"{JOBS}/{quote(str(ref), safe='')}" + (f"/{action}" if action else "")


def test_members_share_the_first_members_id_and_are_known_as_id_index(api, alice):
    jobs = submit_array(api(alice))
    first = jobs[0]["id"]
    assert [j["ref"] for j in jobs] == [f"{first}_{i}" for i in range(6)]
    assert {j["arrayId"] for j in jobs} == {first} and [j["arrayIndex"] for j in jobs] == list(range(6))
    assert {j["arrayThrottle"] for j in jobs} == {2}
    member = Job.objects.get(array_id=first, array_index=3)
    assert member.array_throttle == 2 and member.ref == f"{first}_3"
    env = member.spec["env"]
    assert env["ORRERY_ARRAY_ID"] == str(first) and env["ORRERY_ARRAY_INDEX"] == "3"
    assert (env["ORRERY_ARRAY_TASK_COUNT"], env["ORRERY_ARRAY_TASK_MIN"], env["ORRERY_ARRAY_TASK_MAX"]) == (
        "6",
        "0",
        "5",
    )


def test_two_arrays_of_one_batch_get_their_own_ids(api, alice):
    body = {
        "jobs": [
            job_spec(metadata__name="a", spec__array="0-4"),
            job_spec(metadata__name="plain"),
            job_spec(metadata__name="b", spec__array="5-6"),
        ]
    }
    jobs = api(alice).post(f"{JOBS}/batch", json.dumps(body), content_type="application/json").json()["jobs"]
    a, plain, b = jobs[:5], jobs[5], jobs[6:]
    assert {j["arrayId"] for j in a} == {a[0]["id"]} and {j["arrayId"] for j in b} == {b[0]["id"]}
    assert plain["arrayId"] is None and plain["ref"] == str(plain["id"])
    assert [j["ref"] for j in b] == [f"{b[0]['id']}_5", f"{b[0]['id']}_6"]


@pytest.mark.parametrize(
    "array, problem",
    [
        ("0-9%x", "spec.array"),
        ("0-9%-1", "spec.array"),
        ("0-9%20000", "spec.array"),
        ({"indices": "0-9", "throttle": "many"}, "spec.array.throttle"),
        ({"indices": "0-9", "extra": 1}, "spec.array"),
        ({"throttle": 2}, "spec.array.indices"),
        ("0-4000001", "spec.array"),
    ],
    ids=["word", "negative", "huge", "mapping-word", "mapping-extra", "no-indices", "index-too-big"],
)
def test_bad_arrays_and_throttles_are_a_400_at_their_field(api, alice, array, problem):
    body = {"jobs": [job_spec(spec__array=array)]}
    response = api(alice).post(f"{JOBS}/batch", json.dumps(body), content_type="application/json")
    assert response.status_code == 400
    assert error_paths(response) == [f"jobs[0].{problem}"]


def test_a_member_is_read_by_its_ref(api, alice):
    first = submit_array(api(alice))[0]["id"]
    client = api(alice)
    member = client.get(url(f"{first}_3")).json()
    assert member["ref"] == f"{first}_3" and member["arrayIndex"] == 3
    assert client.get(url(f"{first}_3", "events")).json()[0]["kind"] == "submitted"
    assert client.get(url(f"{first}_3", "logs")).json()["ref"] == f"{first}_3"
    assert client.get(url(first)).json()["ref"] == f"{first}_0"  # the array's id is its first member
    ranged = client.get(url(f"{first}_[1-2]"))
    assert ranged.status_code == 400 and error_paths(ranged) == ["ref"]


@pytest.mark.parametrize(
    "ref",
    ["74_", "74_x", "74_[", "74_[]", "74_[5-1]", "74_[1-2", "1" * 30, "0", "74_99999999", "x", "74__3", "-1"],
)
def test_junk_refs_are_a_404_never_a_500(api, alice, ref):
    client = api(alice)
    assert client.get(url(ref)).status_code == 404
    assert client.post(url(ref, "cancel")).status_code == 404
    assert client.patch(url(ref), {"priority": 1}, format="json").status_code == 404


def test_cancel_a_range_then_the_whole_array(api, alice):
    client = api(alice)
    first = submit_array(client, "0-9")[0]["id"]
    ranged = client.post(url(f"{first}_[1-2,7]", "cancel"))
    assert ranged.status_code == 200, ranged.content
    body = ranged.json()
    assert (body["matched"], body["changed"], body["unchanged"]) == (3, 3, 0)
    assert body["changedRefs"] == [f"{first}_1", f"{first}_2", f"{first}_7"] and body["arrayId"] == first
    states = dict(Job.objects.filter(array_id=first).values_list("array_index", "state"))
    assert [i for i, s in sorted(states.items()) if s == JobState.CANCELLED] == [1, 2, 7]

    one = client.post(url(f"{first}_3", "hold"))
    assert one.json()["state"] == JobState.HELD and one.json()["ref"] == f"{first}_3"

    whole = client.post(url(first, "cancel")).json()
    assert (whole["matched"], whole["changed"], whole["unchanged"]) == (10, 7, 3)
    assert set(Job.objects.filter(array_id=first).values_list("state", flat=True)) == {JobState.CANCELLED}
    assert AuditEntry.objects.filter(action="job.cancel", target=f"jobs:{first}").count() == 1

    again = client.post(url(first, "cancel"))
    assert again.status_code == 409 and "CANCELLED" in again.json()["detail"]


def test_hold_and_release_a_whole_array(api, alice, operator):
    client = api(alice)
    first = submit_array(client, "0-3")[0]["id"]
    assert client.post(url(first, "hold")).json()["changed"] == 4
    assert set(Job.objects.filter(array_id=first).values_list("state", flat=True)) == {JobState.HELD}
    # An operator's hold on one member: alice releases the others, not that one.
    Job.objects.filter(array_id=first, array_index=2).update(reason="JobHeldAdmin")
    released = client.post(url(first, "release")).json()
    assert (released["changed"], released["unchanged"]) == (3, 1)
    assert api(operator).post(url(f"{first}_2", "release")).json()["state"] == JobState.PENDING


def test_a_range_reaches_no_other_projects_array(api, alice, bob, nlp_queue):
    theirs = make_job(bob, nlp_queue, name="x-0", array_index=0)
    Job.objects.filter(pk=theirs.pk).update(array_id=theirs.pk)
    client = api(alice)
    for ref in (theirs.pk, f"{theirs.pk}_0", f"{theirs.pk}_[0-5]"):
        assert client.post(url(ref, "cancel")).status_code == 404
        assert client.patch(url(ref), {"priority": 1}, format="json").status_code == 404
    assert client.get(f"/api/v1/arrays/{theirs.pk}").status_code == 404
    assert Job.objects.get(pk=theirs.pk).state == JobState.PENDING


def test_only_owners_managers_and_operators_act_on_an_array(api, alice, vision, operator):
    carol = make_user("carol")
    Membership.objects.create(user=carol, project=vision, role=Role.MEMBER)
    first = submit_array(api(alice), "0-2")[0]["id"]
    refused = api(carol).post(url(f"{first}_[0-1]", "cancel"))
    assert refused.status_code == 403
    assert not Job.objects.filter(array_id=first, state=JobState.CANCELLED).exists()
    Membership.objects.filter(user=carol).update(role=Role.MANAGER)
    assert api(carol).post(url(f"{first}_[0-1]", "hold")).json()["changed"] == 2
    assert api(operator).post(url(first, "cancel")).json()["changed"] == 3


def test_checkpoint_needs_one_job(api, alice):
    first = submit_array(api(alice), "0-2")[0]["id"]
    response = api(alice).post(url(first, "checkpoint"))
    assert response.status_code == 400 and error_paths(response) == ["ref"]


def test_summary_rows_stand_for_waiting_members(api, alice, queue):
    client = api(alice)
    plain = make_job(alice, queue, name="plain")
    first = submit_array(client, "0-9%3")[0]["id"]
    client.post(url(f"{first}_[1,5]", "cancel"))
    client.post(url(f"{first}_[8-9]", "hold"))
    rows = client.get(JOBS, {"arrays": "summary"}).json()["results"]
    by_ref = {row["ref"]: row for row in rows}
    pending = by_ref[f"{first}_[0,2-4,6-7]"]
    assert pending["state"] == JobState.PENDING and pending["arrayTasks"] == {
        "count": 6,
        "indices": "0,2-4,6-7",
        "label": f"{first}_[0,2-4,6-7%3]",
    }
    assert by_ref[f"{first}_[8-9]"]["state"] == JobState.HELD
    assert by_ref[f"{first}_1"]["arrayTasks"] is None and by_ref[f"{first}_5"]["state"] == JobState.CANCELLED
    assert by_ref[str(plain.pk)]["arrayTasks"] is None
    assert len(rows) == 5
    expanded = client.get(JOBS, {"arrays": "expand"}).json()["results"]
    assert len(expanded) == 11
    members = client.get(JOBS, {"array": first}).json()["results"]
    assert sorted(j["arrayIndex"] for j in members) == list(range(10))


@pytest.mark.parametrize("size", [3, 300])
def test_summary_list_takes_a_fixed_number_of_queries(api, alice, size, django_assert_num_queries):
    client = api(alice)
    submit_array(client, f"0-{size - 1}")
    client.get(JOBS, {"arrays": "summary"})
    with django_assert_num_queries(4):  # token, page, placement prefetch, index spans
        rows = client.get(JOBS, {"arrays": "summary"}).json()["results"]
    assert rows[0]["arrayTasks"]["count"] == size


@pytest.mark.parametrize("query", [{"arrays": "all"}, {"array": "x"}, {"array": "1" * 30}])
def test_bad_array_filters_are_a_400(api, alice, query):
    response = api(alice).get(JOBS, query)
    assert response.status_code == 400 and error_paths(response) == [f"query.{next(iter(query))}"]


def test_an_array_as_a_whole(api, alice):
    client = api(alice)
    first = submit_array(client, "2-6%2")[0]["id"]
    client.post(url(f"{first}_[2-3]", "cancel"))
    body = client.get(f"/api/v1/arrays/{first}").json()
    assert body == {
        "arrayId": first,
        "name": "sweep",
        "owner": "alice",
        "project": "vision",
        "queue": "default",
        "throttle": 2,
        "tasks": 5,
        "indices": "2-6",
        "states": {"PENDING": 3, "CANCELLED": 2},
    }
    assert client.get("/api/v1/arrays/999999").status_code == 404


def test_refusals_name_a_member_by_its_ref(api, alice):
    client = api(alice)
    first = submit_array(client, "0-2")[0]["id"]
    client.post(url(f"{first}_2", "cancel"))
    again = client.post(url(f"{first}_2", "cancel"))
    assert again.status_code == 409
    assert again.json()["detail"] == f"job {first}_2: CANCELLED is a final state."
    checkpoint = client.post(url(f"{first}_1", "checkpoint"))
    assert checkpoint.status_code == 409
    assert checkpoint.json()["detail"].startswith(f"job {first}_1 is PENDING")
