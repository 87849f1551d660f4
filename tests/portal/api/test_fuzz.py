"""Property-based fuzzing of POST /api/v1/jobs: whatever the document, the answer is a 2xx, a 400
that names what is wrong, or a 429 — never a server error."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rest_framework.throttling import SimpleRateThrottle

from tests.portal.api.conftest import VALID_SPEC

JOBS = "/api/v1/jobs"
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Values that have broken parsers before: a fuzzer's dictionary, mixed in with random ones.
TRICKY = [
    "",
    " ",
    "\x00",
    "h100\x00:8",
    "h100:-1",
    "gpu:h100:8:1",
    "inf",
    "-inf",
    "nan",
    "1e999",
    "9" * 400,
    "500m",
    "m",
    "256Gi",
    "-1Gi",
    "0x10",
    "2h",
    "PT",
    "P1D",
    "1-",
    "99999999999999999999d",
    "0-9",
    "\u202e",
    "\ud7ff",
    "default\n",
    0,
    -1,
    2**63,
    -(2**63),
    10**30,
    1e308,
    -1e308,
    5e-324,
    True,
]
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
unit_like_text = st.text(alphabet="\x00\n :-.0123456789hmsdGiPTa", max_size=12)
documents = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=15), children, max_size=5)
    ),
    max_leaves=25,
)


def leaf_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(node, dict):
        return [p for key, value in node.items() for p in leaf_paths(value, (*prefix, key))]
    return [prefix]


LEAVES = leaf_paths(VALID_SPEC)


@st.composite
def mutated_specs(draw: st.DrawFn) -> dict[str, Any]:
    """The valid spec with one to three leaves (``spec.resources.gpus``…) replaced by anything."""
    document = copy.deepcopy(VALID_SPEC)
    for path in draw(st.lists(st.sampled_from(LEAVES), min_size=1, max_size=3, unique=True)):
        node = document
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = draw(st.one_of(st.sampled_from(TRICKY), unit_like_text, documents))
    return document


@pytest.fixture
def client(api, alice, queue, fleet, monkeypatch):
    """Alice's client, with rates high enough that a fuzzing run is never throttled."""
    monkeypatch.setattr(
        SimpleRateThrottle, "THROTTLE_RATES", {"submit": "1000000/min", "read": "1000000/min"}
    )
    return api(alice)


def check(response) -> None:
    assert response.status_code in (200, 201, 400, 429), (response.status_code, response.content[:300])
    if response.status_code == 400:
        body = response.json()
        assert isinstance(body["detail"], str) and body["detail"]
        assert body["errors"], body
        for error in body["errors"]:
            assert isinstance(error["path"], str) and error["path"], error
            assert isinstance(error["message"], str) and error["message"], error


@FUZZ
@given(document=documents)
def test_arbitrary_json_documents(client, document):
    check(client.post(JOBS, json.dumps(document), content_type="application/json"))


@FUZZ
@given(document=mutated_specs())
def test_mutations_of_a_valid_spec(client, document):
    check(client.post(JOBS, json.dumps(document), content_type="application/json"))
