"""Arrays in the scheduling app: ``spec.array`` with Slurm's ``%`` throttle, job references
(``scheduling.refs``), and the numbering of members at submission (``arrays.number``)."""

from __future__ import annotations

import pytest

from scheduling.choices import JobState
from scheduling.models import Job
from scheduling.refs import JobRef, array_label, parse_ref
from scheduling.services.jobs import act_on_jobs, submit_jobs
from scheduling.services.submission import build_requests
from scheduling.spec import SpecError, parse_array, parse_job_spec
from tests.factories import make_cluster, make_node, make_project, make_queue, make_user


@pytest.mark.parametrize(
    "value, indices, throttle",
    [
        ("0-3", [0, 1, 2, 3], None),
        ("0-9%3", list(range(10)), 3),
        ("0-6:3%1", [0, 3, 6], 1),
        ("1,3,5-6", [1, 3, 5, 6], None),
        (" 2 - 3 % 2 ", [2, 3], 2),
        (7, [7], None),
        ({"indices": "0-2", "throttle": 2}, [0, 1, 2], 2),
        ({"indices": 4}, [4], None),
        ("0-3%0", [0, 1, 2, 3], None),  # %0: no throttle
        ("4000000", [4000000], None),
    ],
    ids=[
        "range",
        "throttle",
        "step-throttle",
        "list",
        "blanks",
        "int",
        "mapping",
        "mapping-int",
        "zero",
        "top",
    ],
)
def test_arrays_parse_as_slurm_writes_them(value, indices, throttle):
    assert parse_array(value) == (indices, throttle)


@pytest.mark.parametrize(
    "value",
    ["0-9%", "0-9%x", "0-9%+2", "0-9%١", "%3", "0-9%10001", "4000001", "0-9%3%3", True, {"throttle": 1}],
    ids=[
        "empty",
        "word",
        "sign",
        "not-ascii",
        "no-indices",
        "too-high",
        "index-too-high",
        "twice",
        "bool",
        "map",
    ],
)
def test_bad_arrays_are_refused(value):
    with pytest.raises(ValueError):
        parse_array(value)


def test_a_spec_carries_its_arrays_throttle():
    spec = parse_job_spec(
        {"apiVersion": "orrery/v1", "metadata": {"name": "s"}, "spec": {"run": "x", "array": "0-4%2"}}
    )
    assert (spec.array, spec.array_throttle) == ([0, 1, 2, 3, 4], 2)
    with pytest.raises(SpecError) as refused:
        parse_job_spec(
            {"apiVersion": "orrery/v1", "metadata": {"name": "s"}, "spec": {"run": "x", "array": "0-4%x"}}
        )
    assert [path for path, _ in refused.value.errors] == ["spec.array"]


@pytest.mark.parametrize(
    "text, ref, shown",
    [
        ("74", JobRef(74), "74"),
        ("74_3", JobRef(74, ((3, 3),)), "74_3"),
        ("74_[1-5]", JobRef(74, ((1, 5),), ranged=True), "74_[1-5]"),
        ("74_[7-9,1,3,2]", JobRef(74, ((1, 3), (7, 9)), ranged=True), "74_[1-3,7-9]"),
        ("74_[3]", JobRef(74, ((3, 3),), ranged=True), "74_[3]"),
        ("9223372036854775807", JobRef(2**63 - 1), "9223372036854775807"),
    ],
    ids=["job", "member", "range", "merged", "bracket-one", "largest"],
)
def test_refs_parse_and_print_back(text, ref, shown):
    assert parse_ref(text) == ref and str(parse_ref(text)) == shown


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0",
        "74_",
        "74_x",
        "74_[]",
        "74_[5-1]",
        "74_[1-2",
        "9223372036854775808",
        "74_4000001",
        "٧٤",
        "74_[-1]",
    ],
)
def test_bad_refs_are_refused(text):
    with pytest.raises(ValueError):
        parse_ref(text)


def test_a_range_has_at_most_a_hundred_parts():
    assert parse_ref("1_[" + ",".join(["7"] * 100) + "]").spans == ((7, 7),)
    with pytest.raises(ValueError, match="at most 100"):
        parse_ref("1_[" + ",".join(["7"] * 101) + "]")


@pytest.mark.parametrize(
    "spans, throttle, label",
    [
        (((4, 99),), 10, "74_[4-99%10]"),
        (((5, 5),), None, "74_5"),
        (((5, 5),), 2, "74_[5%2]"),
        (((1, 2), (4, 4)), None, "74_[1-2,4]"),
    ],
)
def test_squeue_labels(spans, throttle, label):
    assert array_label(74, spans, throttle) == label


@pytest.fixture
def world(db):
    alice = make_user("alice")
    queue = make_queue(make_project("vision", members=(alice,)))
    make_node(make_cluster("sim-a"), gpus=8, model="h100")
    return alice, queue


def requests_for(queue, alice, name, array=None):
    spec = {"apiVersion": "orrery/v1", "metadata": {"name": name}, "spec": {"run": "x"}}
    if array is not None:
        spec["spec"]["array"] = array
    return build_requests(parse_job_spec(spec), queue, owner=alice)


def test_members_are_numbered_after_their_first_member(world):
    alice, queue = world
    requests = [
        *requests_for(queue, alice, "a", "0-2%2"),
        *requests_for(queue, alice, "plain"),
        *requests_for(queue, alice, "b", "3,5"),
    ]
    jobs, _ = submit_jobs(requests, actor=alice, batch=True)
    a, plain, b = jobs[:3], jobs[3], jobs[4:]
    stored = {job.pk: job for job in Job.objects.all()}
    assert [stored[j.pk].ref for j in a] == [f"{a[0].pk}_{i}" for i in range(3)]
    assert stored[plain.pk].array_id is None and stored[plain.pk].ref == str(plain.pk)
    assert [stored[j.pk].ref for j in b] == [f"{b[0].pk}_3", f"{b[0].pk}_5"]
    assert {stored[j.pk].array_throttle for j in a} == {2} and {stored[j.pk].array_throttle for j in b} == {
        None
    }
    assert [j.ref for j in jobs] == [stored[j.pk].ref for j in jobs]  # the caller's copies too
    assert stored[b[1].pk].spec["env"]["ORRERY_ARRAY_ID"] == str(b[0].pk)
    assert stored[b[1].pk].spec["env"]["ORRERY_ARRAY_INDEX"] == "5"
    assert "ORRERY_ARRAY_ID" not in stored[plain.pk].spec["env"]


def test_an_action_on_many_moves_each_state_once_and_counts_the_rest(world):
    alice, queue = world
    jobs, _ = submit_jobs(requests_for(queue, alice, "a", "0-3"), actor=alice, batch=True)
    Job.objects.filter(pk=jobs[0].pk).update(state=JobState.SUCCEEDED)
    Job.objects.filter(pk=jobs[1].pk).update(state=JobState.HELD)
    outcome = act_on_jobs("cancel", [j.pk for j in jobs], actor=alice, target="jobs:x")
    assert outcome.moved == [j.pk for j in jobs[1:]] and outcome.unchanged == 1
    states = list(Job.objects.order_by("pk").values_list("state", flat=True))
    assert states == [JobState.SUCCEEDED] + [JobState.CANCELLED] * 3
