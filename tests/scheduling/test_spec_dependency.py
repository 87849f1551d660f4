"""``spec.dependency``: Slurm's string and the mapping, canonical references, and every refusal
named by its path."""

from __future__ import annotations

import pytest

from scheduling.spec import MAX_DEPENDENCY_REFS, SpecError, parse_dependency, parse_job_spec


def document(dependency):
    return {
        "apiVersion": "orrery/v1",
        "metadata": {"name": "t"},
        "spec": {"run": "true", "dependency": dependency},
    }


ACCEPTED = [
    ("one", "afterok:74", (("afterok", "74"),)),
    (
        "slurm-string",
        "afterok:74:75_3,afterany:80",
        (("afterok", "74"), ("afterok", "75_3"), ("afterany", "80")),
    ),
    ("blanks-case-zeros", " AfterNotOK : 074 : 75_03 ", (("afternotok", "74"), ("afternotok", "75_3"))),
    ("singleton", "singleton", (("singleton", ""),)),
    ("with-singleton", "afterany:9,singleton", (("afterany", "9"), ("singleton", ""))),
    ("duplicates-dropped", "afterok:7:7,afterok:7", (("afterok", "7"),)),
    (
        "mapping",
        {"afterok": [74, "75_3"], "afterany": [80], "singleton": True},
        (("afterok", "74"), ("afterok", "75_3"), ("afterany", "80"), ("singleton", "")),
    ),
    ("mapping-single-ref", {"afternotok": 5}, (("afternotok", "5"),)),
    ("mapping-singleton-false", {"afterok": [1], "singleton": False}, (("afterok", "1"),)),
]


@pytest.mark.parametrize("value, expected", [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_accepted_forms(value, expected):
    assert parse_dependency(value) == expected
    assert parse_job_spec(document(value)).dependency == expected


def test_no_dependency_is_empty():
    assert parse_job_spec(document(None)).dependency == ()


REFUSED = [
    ("any-of", "afterok:1?afterok:2", "spec.dependency", "'?' (any of) is not supported"),
    ("after-start", "after:74", "spec.dependency", "'after' is not a dependency type"),
    ("aftercorr", "aftercorr:74", "spec.dependency", "'aftercorr' is not a dependency type"),
    ("no-ref", "afterok", "spec.dependency", "names no job"),
    ("empty-ref", "afterok:74:", "spec.dependency", "'' is not a job id"),
    ("delay", "afterok:74+30", "spec.dependency", "'74+30' is not a job id"),
    ("negative", "afterok:-1", "spec.dependency", "is not a job id"),
    ("zero", "afterok:0", "spec.dependency", "'0' is not a job id"),
    ("unicode-digits", "afterok:١٢", "spec.dependency", "is not a job id"),
    ("too-many-digits", "afterok:" + "9" * 19, "spec.dependency", "is not a job id"),
    ("singleton-with-ref", "singleton:3", "spec.dependency", "singleton takes no job id"),
    ("empty", "  ", "spec.dependency", "is empty"),
    ("number", 74, "spec.dependency", "not a number"),
    ("list", ["afterok:1"], "spec.dependency", "not a list"),
    (
        "too-many",
        "afterok:" + ":".join(map(str, range(1, MAX_DEPENDENCY_REFS + 2))),
        "spec.dependency",
        "at most",
    ),
    ("too-long", "afterok:1" + " " * 30_000, "spec.dependency", "too long"),
    ("mapping-unknown-kind", {"before": [1]}, "spec.dependency.before", "not a dependency type"),
    ("mapping-bad-item", {"afterok": [1, "x"]}, "spec.dependency.afterok[1]", "'x' is not a job id"),
    ("mapping-bool-item", {"afterok": [True]}, "spec.dependency.afterok[0]", "a boolean is not a job id"),
    ("mapping-nested", {"afterok": [[1]]}, "spec.dependency.afterok[0]", "a list is not a job id"),
    ("mapping-singleton-text", {"singleton": "yes"}, "spec.dependency.singleton", "true or false"),
    ("mapping-huge-int", {"afterok": [10**30]}, "spec.dependency.afterok[0]", "is not a job id"),
]


@pytest.mark.parametrize("value, path, message", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refusals_name_the_field(value, path, message):
    with pytest.raises(SpecError) as refused:
        parse_job_spec(document(value))
    assert [p for p, _ in refused.value.errors] == [path]
    assert message in refused.value.errors[0][1]


def test_a_batch_path_names_the_document():
    with pytest.raises(SpecError) as refused:
        parse_job_spec(document({"afterok": ["x"]}), path="jobs[2]")
    assert refused.value.errors[0][0] == "jobs[2].spec.dependency.afterok[0]"


def test_every_bad_item_is_named():
    with pytest.raises(SpecError) as refused:
        parse_job_spec(document({"afterok": [1, "x", True], "afterany": "7_"}))
    assert [p for p, _ in refused.value.errors] == [
        "spec.dependency.afterok[1]",
        "spec.dependency.afterok[2]",
        "spec.dependency.afterany",
    ]
