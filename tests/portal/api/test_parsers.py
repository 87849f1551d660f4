"""Request bodies within bounds (portal/api/parsers.py): YAML under the same size limit as JSON and
parsed by libyaml within node and depth bounds, numbers Python cannot build, and text that can
be neither stored nor shown back — each refused with a 400 naming the value, never a 500 and
never minutes of parsing."""

from __future__ import annotations

import importlib
import io
import json
import time

import pytest
import yaml
from django.core.exceptions import ImproperlyConfigured, RequestDataTooBig
from hypothesis import given, settings
from hypothesis import strategies as st

from portal.api import parsers
from portal.api.parsers import BodyRefused, _Refused, check_document
from scheduling.models import Job
from scheduling.spec import text_errors
from tests.portal.api.conftest import error_paths, job_spec

pytestmark = pytest.mark.usefixtures("fleet", "queue")

JOBS = "/api/v1/jobs"
MiB = 2**20


def post(client, body: str | bytes, content_type: str, url: str = JOBS):
    return client.post(url, body, content_type=content_type)


def spec_yaml(**changes) -> str:
    return yaml.safe_dump(job_spec(**changes))


def test_without_libyaml_the_parsers_refuse_to_load(monkeypatch):
    assert issubclass(parsers._BoundedYamlLoader, yaml.CSafeLoader)
    monkeypatch.setattr(yaml, "__with_libyaml__", False)
    with pytest.raises(ImproperlyConfigured, match="libyaml"):
        importlib.reload(parsers)


# --- size and shape ----------------------------------------------------------------------------


@pytest.mark.parametrize("dry_run", [False, True], ids=["submit", "dry-run"])
def test_a_yaml_body_over_the_limit_is_a_413_at_once(api, alice, dry_run):
    # 8.5 MiB of comments after a valid spec: the pure-Python loader used to scan it for minutes.
    body = spec_yaml() + ("# " + "x" * 1022 + "\n") * int(8.5 * 1024)
    started = time.monotonic()
    response = post(api(alice), body, "application/yaml", JOBS + ("?dryRun=true" if dry_run else ""))
    assert response.status_code == 413, response.content[:300]
    assert response["Content-Type"] == "application/json"
    assert error_paths(response) == []
    assert time.monotonic() - started < 5  # generous: it is refused before any parsing
    assert not Job.objects.exists()


class CountingStream(io.BytesIO):
    """A body stream that records how many bytes were asked of it."""

    taken = 0

    def read(self, size: int | None = -1) -> bytes:
        chunk = super().read(size)
        self.taken += len(chunk)
        return chunk


@pytest.mark.parametrize("parser", [parsers.YamlParser(), parsers.StrictJsonParser()], ids=["yaml", "json"])
def test_the_limit_is_counted_while_reading_not_taken_from_content_length(parser, settings):
    # The parser sees the stream alone, as with a chunked body that declares no length.
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    stream = CountingStream(b"[" + b"1," * 5000 + b"1]")
    with pytest.raises(RequestDataTooBig):
        parser.parse(stream, parser_context={})
    assert stream.taken == 1001  # one byte past the limit, never the rest


def test_a_wide_yaml_body_under_the_limit_is_refused_after_a_bounded_number_of_events():
    # Four MiB of one flat list: two million values. The walk stops one past the bound.
    text = "[" + ",".join(["1"] * 2_000_000) + "]"
    consumed = 0

    def events():
        nonlocal consumed
        for event in yaml.parse(text, Loader=yaml.CSafeLoader):
            consumed += 1
            yield event

    with pytest.raises(parsers.BodyRefused) as refused:
        parsers.check_yaml_events(events())
    assert refused.value.errors[0][0] == "(body)"
    assert consumed <= parsers.MAX_NODES + 5  # stream, document and list starts, then the values


@pytest.mark.parametrize(
    "body, what",
    [
        ("[" + ",".join(["1"] * 2_000_000) + "]", "values"),
        ("[" * 200_000 + "]" * 200_000, "deep"),
        (
            "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
            + "".join(
                f"{n}: &{n} [{', '.join(['*' + p] * 10)}]\n"
                for p, n in zip("abcdefg", "bcdefgh", strict=True)
            )
            + "i: [*h, *h, *h, *h, *h, *h, *h, *h, *h, *h]\n",
            "values",
        ),
        (
            "a: &a [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]\n"
            "b: [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[*a]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]\n",
            "deep",
        ),
    ],
    ids=["two-million-values", "nested-200k", "anchor-bomb", "deep-through-an-alias"],
)
@pytest.mark.parametrize("url", [JOBS, JOBS + "/batch"], ids=["jobs", "batch"])
def test_yaml_bodies_too_wide_or_too_deep_are_a_400_within_seconds(api, alice, body, what, url):
    started = time.monotonic()
    response = post(api(alice), body, "application/yaml", url)
    assert response.status_code == 400, response.content[:300]
    assert error_paths(response) == ["(body)"]
    message = response.json()["errors"][0]["message"]
    if what == "values":
        assert f"more than {parsers.MAX_NODES} values" in message
    else:  # libyaml's own bound (1000) may come first, when its scanner looks far ahead
        assert "levels deep" in message or "maximum nesting depth" in message
    assert time.monotonic() - started < 5  # generous; the old loader took minutes on the first


def test_a_batch_of_a_thousand_specs_still_parses(api, alice):
    documents = "".join("---\n" + spec_yaml(metadata__name=f"t{i}") for i in range(1000))
    response = post(api(alice), documents, "application/yaml", JOBS + "/batch")
    assert response.status_code == 201, response.content[:300]
    assert response.json()["count"] == 1000


@pytest.mark.parametrize("content_type", ["application/json", "application/yaml"])
def test_nesting_is_bounded_in_json_and_yaml_alike(api, alice, content_type):
    deep = job_spec(metadata__labels={"a": json.loads("[" * 70 + "]" * 70)})
    response = post(api(alice), json.dumps(deep), content_type)
    assert response.status_code == 400
    assert any("levels deep" in e["message"] for e in response.json()["errors"])


# --- numbers -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, content_type, path",
    [
        (
            '{"apiVersion": "orrery/v1", "spec": {"retries": ' + "1" * 5000 + "}}",
            "application/json",
            "spec.retries",
        ),
        ("apiVersion: orrery/v1\nspec: {retries: " + "1" * 5000 + "}\n", "application/yaml", "spec.retries"),
        (
            "apiVersion: orrery/v1\nspec: {retries: 0x" + "f" * 4000 + "}\n",
            "application/yaml",
            "spec.retries",
        ),
        (
            "apiVersion: orrery/v1\nmetadata: {name: " + ":1".join(["1"] * 3000) + "}\n",
            "application/yaml",
            "metadata.name",
        ),
        ('{"apiVersion": "orrery/v1", "spec": {"retries": 1e999}}', "application/json", "spec.retries"),
        ("apiVersion: orrery/v1\nspec: {retries: .nan}\n", "application/yaml", "spec.retries"),
    ],
    ids=[
        "json-5000-digits",
        "yaml-5000-digits",
        "yaml-hex-16000-bits",
        "yaml-base-60",
        "json-1e999",
        "yaml-nan",
    ],
)
def test_numbers_python_cannot_build_are_a_400_naming_the_field(api, alice, body, content_type, path):
    response = post(api(alice), body, content_type)
    assert response.status_code == 400, response.content[:300]
    assert error_paths(response) == [path]


# --- text that can be neither stored nor shown back --------------------------------------------


SURROGATE = "LONE-SURROGATE"  # written as \ud800 into the JSON text, which Python decodes as is


def with_surrogates(document) -> str:
    return json.dumps(document).replace(SURROGATE, "\\ud800")


@pytest.mark.parametrize(
    "changes, path",
    [
        ({"spec__run": f"echo {SURROGATE}"}, "spec.run"),
        ({"spec__setup": SURROGATE}, "spec.setup"),
        ({"metadata__name": SURROGATE}, "metadata.name"),
        ({"metadata__labels": {"team": SURROGATE}}, "metadata.labels.team"),
        ({"metadata__labels": {SURROGATE: "cv"}}, "metadata.labels.\\ud800"),
        ({"spec__env": {"A": SURROGATE}}, "spec.env.A"),
        ({"spec__placement": {"nodeSelector": {"rack": SURROGATE}}}, "spec.placement.nodeSelector.rack"),
        ({"spec__placement": {"clusters": [SURROGATE]}}, "spec.placement.clusters[0]"),
        ({"spec__unknown" + SURROGATE: 1}, "spec.unknown\\ud800"),
        ({"spec__env": {"A\x00": "x"}}, "spec.env.A\\x00"),
    ],
    ids=[
        "run",
        "setup",
        "name",
        "label-value",
        "label-key",
        "env",
        "node-selector",
        "cluster",
        "unknown-key",
        "nul-key",
    ],
)
@pytest.mark.parametrize("dry_run", [False, True], ids=["submit", "dry-run"])
def test_lone_surrogates_and_nul_anywhere_are_a_400_naming_the_field(api, alice, changes, path, dry_run):
    body = with_surrogates(job_spec(**changes))
    response = post(api(alice), body, "application/json", JOBS + ("?dryRun=1" if dry_run else ""))
    assert response.status_code == 400, response.content[:300]
    assert path in error_paths(response)
    assert not Job.objects.exists()


def test_a_lone_surrogate_in_a_batch_names_the_spec(api, alice):
    body = with_surrogates({"jobs": [job_spec(), job_spec(spec__run=SURROGATE)]})
    response = post(api(alice), body, "application/json", JOBS + "/batch")
    assert response.status_code == 400, response.content[:300]
    assert error_paths(response) == ["jobs[1].spec.run"]


@pytest.mark.parametrize(
    "fault, error",
    [
        ({"spec__env": {"A": "x\ud800"}}, ("jobs[377].spec.env.A", "must not contain lone surrogates")),
        (
            {"metadata__labels": {"t\x00": "x"}},
            ("jobs[377].metadata.labels.t\\x00", "its name must not contain NUL"),
        ),
        ({"spec__retries": float("inf")}, ("jobs[377].spec.retries", "is not a finite number")),
        (
            {"spec__retries": _Refused("is a number of more than 4300 digits")},
            ("jobs[377].spec.retries", "is a number"),
        ),
    ],
    ids=["surrogate", "nul-key", "infinite", "long-number"],
)
def test_one_fault_deep_in_a_large_document_is_named(fault, error):
    """A clean document is checked without building paths; the one fault among 500 specs is
    still found, and named, by the body's check and by the spec reader's alike."""
    specs = [job_spec(metadata__name=f"j{i}") for i in range(500)]
    check_document({"jobs": specs})
    assert text_errors({"jobs": specs}) == []
    specs[377] = job_spec(metadata__name="j377", **fault)
    with pytest.raises(BodyRefused) as refused:
        check_document({"jobs": specs})
    [(path, message)] = refused.value.errors
    assert (path, message[: len(error[1])]) == error
    if isinstance(fault.get("spec__retries"), float | _Refused):
        return  # not text: the spec reader's business is only text
    [(path, message)] = text_errors({"jobs": specs})
    assert (path, message[: len(error[1])]) == error


_TEXT = st.text(alphabet=st.sampled_from(["a", "-", "\x00", "\ud800", "\udfff", "é"]), max_size=4)
_DOCUMENTS = st.recursive(
    st.none() | st.booleans() | st.integers() | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=20,
)


@given(_DOCUMENTS)
@settings(max_examples=300, deadline=None)
def test_the_body_check_refuses_every_document_the_spec_reader_would(document):
    """The fast path reads specs without the spec reader's own text check (``text_checked``):
    that is sound only while the body's check refuses every document that check would."""
    if text_errors(document):
        with pytest.raises(BodyRefused):
            check_document(document)


def test_a_lone_surrogate_in_another_endpoint_is_a_400(api, alice):
    response = post(api(alice), '{"name": "ci\\udfff"}', "application/json", "/api/v1/tokens")
    assert response.status_code == 400, response.content[:300]
    assert error_paths(response) == ["name"]


@pytest.mark.parametrize("charset", ["utf-16", "unicode_escape", "utf-7"])
def test_only_utf8_bodies_are_read(api, alice, charset):
    # Some codecs decode to lone surrogates (b"\\ud800" through unicode_escape): read none of them.
    response = post(api(alice), json.dumps(job_spec()).encode(), f"application/json; charset={charset}")
    assert response.status_code in (400, 415), response.content[:300]


@pytest.mark.parametrize("query", ["project=%ED%A0%80", "state=%ED%B0%80x", "limit=%D9%A3"])
def test_broken_utf8_in_a_query_never_reaches_the_database(api, alice, query):
    # Django decodes query strings with replacement characters: no lone surrogate gets through.
    response = api(alice).get(f"{JOBS}?{query}")
    assert response.status_code in (200, 400), response.content[:300]
