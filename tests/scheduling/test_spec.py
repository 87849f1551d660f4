"""The spec's bounds on hostile values (scheduling/spec.py): numbers from ASCII digits only and
judged by range before they are converted, no NUL or lone surrogate in any string of the
document, and a simulated duration no longer than a time limit. Pure functions: no database."""

from __future__ import annotations

import copy

import pytest

from scheduling.spec import MAX_TIME_LIMIT_S, SpecError, parse_job_spec

VALID = {
    "apiVersion": "orrery/v1",
    "metadata": {"name": "t"},
    "spec": {
        "resources": {"gpus": "h100:8", "cpus": 32, "memory": "256Gi"},
        "timeLimit": "2h",
        "run": "true",
    },
}


def spec_with(**changes: object) -> dict:
    """The valid spec with ``spec__resources__cpus=…``-style changes."""
    document = copy.deepcopy(VALID)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = document
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return document


def refusals(document: dict, path: str = "") -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as refused:
        parse_job_spec(document, path=path)
    return refused.value.errors


# Arabic-Indic (٣), Devanagari (३) and full-width (３) digits: int(), float() and \d read them all.
NON_ASCII_DIGITS = [
    ("spec__retries", "٣", "spec.retries"),
    ("spec__resources__nodes", "١", "spec.resources.nodes"),
    ("spec__sim__exitCode", "３", "spec.sim.exitCode"),
    ("spec__resources__cpus", "٣٢", "spec.resources.cpus"),
    ("spec__resources__cpus", "५००m", "spec.resources.cpus"),
    ("spec__resources__memory", "٢Gi", "spec.resources.memory"),
    ("spec__resources__gpus", "h100:٨", "spec.resources.gpus"),
    ("spec__timeLimit", "٢h", "spec.timeLimit"),
    ("spec__timeLimit", "०१:००:००", "spec.timeLimit"),
    ("spec__timeLimit", "PT٢H", "spec.timeLimit"),
    ("spec__array", "٠-٣", "spec.array"),
    ("spec__sim__duration", "٥m", "spec.sim.duration"),
]


@pytest.mark.parametrize(
    "field, value, path", NON_ASCII_DIGITS, ids=[f"{f}={v}" for f, v, _ in NON_ASCII_DIGITS]
)
def test_only_ascii_digits_are_numbers(field, value, path):
    assert path in [p for p, _ in refusals(spec_with(**{field: value}))]


LONG = "1" * 5000  # past Python's int() limit of 4300 digits
HUGE_NUMBERS = [
    ("spec__retries", LONG, "spec.retries"),
    ("spec__retries", "-" + LONG, "spec.retries"),
    ("spec__resources__nodes", LONG, "spec.resources.nodes"),
    ("spec__sim__exitCode", LONG, "spec.sim.exitCode"),
    ("spec__resources__cpus", LONG + "m", "spec.resources.cpus"),
    ("spec__resources__cpus", LONG, "spec.resources.cpus"),
    ("spec__resources__gpus", "h100:" + LONG, "spec.resources.gpus"),
    ("spec__resources__gpus", LONG, "spec.resources.gpus"),
    ("spec__timeLimit", LONG + "s", "spec.timeLimit"),
    ("spec__timeLimit", LONG, "spec.timeLimit"),
    ("spec__array", "0-" + LONG, "spec.array"),
    # Integers already built (JSON's parser builds up to 4300 digits): compared, never printed.
    ("spec__retries", 10**4000, "spec.retries"),
    ("spec__priority", -(10**4000), "spec.priority"),
    ("spec__resources__gpus", {"model": "h100", "count": 10**4000}, "spec.resources.gpus"),
    ("spec__resources__memory", 10**4000, "spec.resources.memory"),
    ("spec__array", 10**4000, "spec.array"),
    ("spec__env", {"N": 10**4000}, "spec.env.N"),
    ("spec__timeLimit", 10**4000, "spec.timeLimit"),
]


@pytest.mark.parametrize(
    "field, value, path", HUGE_NUMBERS, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(HUGE_NUMBERS)]
)
def test_huge_numbers_are_refused_by_range_never_by_a_crash(field, value, path):
    errors = refusals(spec_with(**{field: value}))
    assert path in [p for p, _ in errors]
    assert all(len(message) < 300 for _, message in errors)  # the number is not echoed back


@pytest.mark.parametrize(
    "field, value, expected",
    [("spec__retries", " 3 ", 3), ("spec__retries", "+3", 3), ("spec__resources__nodes", "0002", 2)],
)
def test_ascii_digit_strings_still_count(field, value, expected):
    spec = parse_job_spec(spec_with(**{field: value}))
    assert (spec.retries if "retries" in field else spec.nodes) == expected


BAD_TEXT = [
    ("spec__run", "echo \ud800", "spec.run"),
    ("spec__setup", "\udfff", "spec.setup"),
    ("spec__workdir", "/tmp/\ud800", "spec.workdir"),
    ("spec__image", "img\x00", "spec.image"),
    ("metadata__name", "a\ud800", "metadata.name"),
    ("metadata__labels", {"team": "\ud800"}, "metadata.labels.team"),
    ("metadata__labels", {"\ud800": "cv"}, "metadata.labels.\\ud800"),
    ("metadata__labels", {"t\x00": "cv"}, "metadata.labels.t\\x00"),
    ("spec__env", {"A": "\ud800"}, "spec.env.A"),
    ("spec__env", {"\udc00": "x"}, "spec.env.\\udc00"),
    ("spec__placement", {"nodeSelector": {"rack": "r\ud800"}}, "spec.placement.nodeSelector.rack"),
    ("spec__placement", {"clusters": ["\ud800"]}, "spec.placement.clusters[0]"),
    ("spec__resources__gpus", {"model": "h\ud800", "count": 1}, "spec.resources.gpus.model"),
    ("spec__bogus\ud800", 1, "spec.bogus\\ud800"),
]


@pytest.mark.parametrize(
    "field, value, path", BAD_TEXT, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD_TEXT)]
)
def test_nul_and_lone_surrogates_anywhere_are_refused_with_their_path(field, value, path):
    errors = refusals(spec_with(**{field: value}))
    assert path in [p for p, _ in errors]
    for where, message in errors:  # every path and message can be encoded into an answer
        (where + message).encode("utf-8")
        assert "\x00" not in where + message


def test_a_batch_spec_names_its_index():
    errors = refusals(spec_with(spec__run="\ud800"), "jobs[7]")
    assert errors == [("jobs[7].spec.run", errors[0][1])]


def test_a_document_that_refers_to_itself_is_walked_once():
    document = spec_with()
    document["spec"]["env"] = {"A": "\ud800"}
    document["metadata"]["labels"] = document["spec"]["env"]  # shared, as YAML aliases share
    document["spec"]["placement"] = {"nodeSelector": {}}
    document["spec"]["placement"]["nodeSelector"]["self"] = document["spec"]["placement"]
    assert refusals(document)[0][1].startswith("must not contain lone surrogates")


@pytest.mark.parametrize(
    "duration, ok",
    [("5m", True), (0, True), ("365d", True), ("366d", False), (10**398, False), ("99999999999999d", False)],
    ids=["5m", "zero", "a-year", "a-year-and-a-day", "10**398-minutes", "14-digit-days"],
)
def test_a_simulated_duration_is_bounded_like_a_time_limit(duration, ok):
    document = spec_with(spec__sim={"duration": duration})
    if ok:
        assert parse_job_spec(document).sim_duration_s <= MAX_TIME_LIMIT_S
    else:
        assert [p for p, _ in refusals(document)] == ["spec.sim.duration"]


@pytest.mark.parametrize(
    "duration, seconds",
    [("0.5s", 0.5), ("1.25s", 1.25), (" 2.0s ", 2.0), ("90s", 90), ("2m", 120)],
)
def test_a_simulated_duration_may_have_a_fraction_of_a_second(duration, seconds):
    assert parse_job_spec(spec_with(spec__sim={"duration": duration})).sim_duration_s == seconds


@pytest.mark.parametrize("duration", ["0.5m", ".5s", "1.2345s", "1.5"])
def test_a_fraction_is_for_seconds_only(duration):
    assert [p for p, _ in refusals(spec_with(spec__sim={"duration": duration}))] == ["spec.sim.duration"]


def test_values_a_batch_repeats_are_read_once_and_refusals_every_time():
    from scheduling.spec import _KEPT_DURATION, _KEPT_GPUS, parse_gpus

    assert _KEPT_GPUS("h100:8") == parse_gpus("h100:8") and _KEPT_GPUS("h100:8") is _KEPT_GPUS("h100:8")
    assert _KEPT_DURATION(90) == 5400  # not text: read as it is, every time
    for _ in range(2):
        with pytest.raises(ValueError, match="not a duration"):
            _KEPT_DURATION("2 fortnights")


def test_text_shared_at_two_depths_is_checked_where_the_full_walk_checks_it():
    """A list met twice (a YAML alias), first near the top and again past the depth limit: the
    quick walk over clean text goes in the same order as the full one, so it does not skip the
    copy the full walk reads."""
    from scheduling.spec import text_errors

    shared = ["\x00"]
    for _ in range(5):
        shared = [shared]
    deep = shared
    for _ in range(60):
        deep = [deep]
    assert text_errors({"a": shared, "b": deep}) == [
        ("a[0][0][0][0][0][0]", "must not contain NUL characters")
    ]
