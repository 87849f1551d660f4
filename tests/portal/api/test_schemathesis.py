"""Schemathesis against the app's own OpenAPI document (/api/schema/): every operation, called
in-process through the WSGI app with a valid bearer token, never answers with a server error.

Besides schemathesis' own positive and negative cases, a third mode ("hostile") takes positive
cases and plants one value that has broken parsers before: integers of 5000 digits, lone
surrogates, NUL, digits that are not ASCII (``٣``), deep nesting — in a body (JSON or YAML, as a
value or as a key), a query parameter or a path parameter — and, for every operation with a
body, whole YAML bodies that are too big (8.5 MiB), too wide, too deep, or an anchor bomb.
(The agent API is not in the document; tests/clusters/test_agent_api.py covers it.)

Driven by hand rather than through schemathesis' pytest plugin so that the cases run inside
pytest-django's test transaction: one hypothesis run per operation and generation mode."""

from __future__ import annotations

import copy
import json
from functools import cache
from typing import Any

import pytest
import schemathesis
import yaml
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from rest_framework.throttling import SimpleRateThrottle
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core import NotSet

from portal.choices import Scope
from portal.services.tokens import issue_token
from scheduling.models import Job
from tests.factories import make_job

MAX_EXAMPLES = 20
MAX_HOSTILE_BODIES = 60  # per operation that takes a body: a value planted somewhere in it
HOSTILE = "hostile"
SLOT = "HOSTILE_SLOT_7Q"  # stands for the planted value until the body is written out

# Raw JSON text of one value: what json.dumps cannot write (5000 digits, a lone surrogate).
JSON_VALUES = [
    "1" * 5000,
    "-" + "9" * 5000,
    "1e999",
    '"' + "1" * 5000 + '"',
    '"\\ud800"',
    '"x\\udfff"',
    '"a\\u0000b"',
    '"\\u0663"',  # ٣
    '"\\u0661\\u0662h"',  # ١٢h
    '"h100:\\u0668"',  # h100:٨
    '"\\u096b\\u0966\\u0966m"',  # ५००m
    "[" * 100 + "]" * 100,
    '{"a":' * 100 + "1" + "}" * 100,
]
JSON_KEYS = ['"\\ud800"', '"a\\u0000"', '"\\u0663"']
YAML_VALUES = [
    "1" * 5000,
    "0x" + "f" * 5000,
    "1" + ":1" * 3000,  # base 60: quadratic for Python to build
    ".inf",
    '"a\\0b"',
    "٣",
    "١٢h",
    "h100:٨",
    "[" * 100 + "]" * 100,
    "*undefined",
]
YAML_KEYS = ['"a\\0"', "٣"]
# Query and path values (a lone surrogate cannot be put in a URL: percent-encoded, it is
# invalid UTF-8, which Django replaces).
TEXT_VALUES = ["\x00", "a\x00b", "١٢", "٣h", "h100:٨", "1" * 5000, "-" + "9" * 30]


def yaml_bodies() -> list[str]:
    """Whole bodies: over the size limit, too wide, too deep, and an anchor bomb."""
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{n}: &{n} [{', '.join(['*' + p] * 10)}]\n" for p, n in zip("abcdefg", "bcdefgh", strict=True)
    )
    return [
        "a: " + "x" * int(8.5 * 2**20),
        "[" + ",".join(["1"] * 1_000_000) + "]",
        "[" * 100_000 + "]" * 100_000,
        bomb + "i: [*h, *h, *h, *h, *h, *h, *h, *h, *h, *h]\n",
    ]


@cache
def load_schema() -> schemathesis.BaseSchema:
    """The document the running app serves, fetched through its WSGI interface."""
    return schemathesis.openapi.from_wsgi(
        "/api/schema/", get_wsgi_application(), headers={"Accept": "application/json"}
    )


def operations() -> list[tuple[str, str]]:
    return [
        (op.path, op.method.upper()) for op in (result.ok() for result in load_schema().get_all_operations())
    ]


@pytest.fixture
def in_test_transaction():
    """The WSGI handler closes "old" connections around each request; inside a test transaction
    that would drop the transaction. Django's own test client disconnects the same signal."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def world(alice, operator, vision, queue, fleet, bob_job, monkeypatch):
    """Objects for path parameters to hit: a job, a token to delete, the cluster. Alice calls;
    hostile cases come from an operator, whom no operation refuses before reading the body."""
    monkeypatch.setattr(SimpleRateThrottle, "THROTTLE_RATES", {"submit": "100000/min", "read": "100000/min"})
    _, plaintext = issue_token(alice, name="schemathesis")
    _, operators = issue_token(operator, name="schemathesis", scopes=tuple(Scope.values))
    spare, _ = issue_token(alice, name="spare")
    job = make_job(alice, queue)
    member = make_job(alice, queue, name="sweep-0", array_index=0, array_throttle=2)
    Job.objects.filter(pk=member.pk).update(array_id=member.pk)  # an array of one: arrays/{id}
    return {
        "headers": {"Authorization": f"Bearer {plaintext}"},
        "operator_headers": {"Authorization": f"Bearer {operators}"},
        "path_parameters": {"id": member.pk, "ref": str(job.pk), "name": fleet.cluster.name},
        "spare_token": spare.pk,
        "other_job": bob_job.pk,
    }


def slots(value: Any, trail: tuple = ()) -> list[tuple]:
    """Every place in a body where a value can be planted: each value, and a new key of each
    mapping (the trail ends with None)."""
    places = [trail]
    if isinstance(value, dict):
        places.append((*trail, None))
        places += [p for key, item in value.items() for p in slots(item, (*trail, key))]
    elif isinstance(value, list):
        places += [p for i, item in enumerate(value) for p in slots(item, (*trail, i))]
    return places


def planted(body: Any, trail: tuple, yaml_text: bool, raw: str) -> bytes:
    """The body written out as JSON or YAML with ``raw`` at ``trail`` (a key when it ends with None)."""
    document = {} if body is None else copy.deepcopy(body)
    if not trail:
        document = SLOT
    else:
        node = document
        for step in trail[:-1]:
            node = node[step]
        if trail[-1] is None:
            node[SLOT] = 1
        else:
            node[trail[-1]] = SLOT
    text = yaml.safe_dump(document) if yaml_text else json.dumps(document)
    return text.replace(SLOT if yaml_text else f'"{SLOT}"', raw, 1).encode()


@st.composite
def hostile_cases(draw: st.DrawFn, operation: Any, fixed: dict[str, Any]) -> schemathesis.Case:
    """A positive case with one hostile value planted in its body, its query or its path."""
    case = draw(operation.as_strategy(generation_mode=GenerationMode.POSITIVE, path_parameters=fixed or None))
    media_types = [body.media_type for body in operation.body]
    # An undeclared query parameter too: middleware sees every one.
    places = [("query", "x"), *(("query", p.name) for p in operation.query)]
    places += [("path", p.name) for p in operation.path_parameters]
    where = draw(st.sampled_from([("body", None)] * bool(media_types) * 3 + places))
    if where[0] == "query":
        case.query = {**(case.query or {}), where[1]: draw(st.sampled_from(TEXT_VALUES))}
    elif where[0] == "path":
        case.path_parameters = {**case.path_parameters, where[1]: draw(st.sampled_from(TEXT_VALUES))}
    else:
        media_type = draw(st.sampled_from(media_types))
        yaml_text = "yaml" in media_type
        body = None if isinstance(case.body, NotSet) else case.body
        trail = draw(st.sampled_from(slots(body)))
        choices = (YAML_KEYS if yaml_text else JSON_KEYS) if trail and trail[-1] is None else None
        raw = draw(st.sampled_from(choices or (YAML_VALUES if yaml_text else JSON_VALUES)))
        case.body, case.media_type = planted(body, trail, yaml_text, raw), media_type
    return case


def fixed_path_parameters(path: str, world: dict[str, Any]) -> dict[str, Any]:
    """Path parameters naming objects that exist, so that cases reach the views."""
    return {
        name: world["spare_token"] if path.startswith("/api/v1/tokens") else value
        for name, value in world["path_parameters"].items()
        if "{" + name + "}" in path
    }


def strategies_for(operation: Any, path: str, mode: Any, world: dict[str, Any]) -> list[Any]:
    fixed = fixed_path_parameters(path, world)
    if mode == HOSTILE:
        return [hostile_cases(operation, fixed)]
    strategies = [operation.as_strategy(generation_mode=mode)]
    if fixed:
        strategies.append(operation.as_strategy(generation_mode=mode, path_parameters=fixed))
        if path.startswith("/api/v1/jobs/"):
            other = {"ref": str(world["other_job"])}
            strategies.append(operation.as_strategy(generation_mode=mode, path_parameters=other))
    return strategies


@pytest.mark.parametrize(
    "mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE, HOSTILE], ids=lambda m: getattr(m, "value", m)
)
@pytest.mark.parametrize("path, method", operations(), ids=lambda v: v)
def test_no_server_errors(in_test_transaction, world, path, method, mode):
    operation = load_schema()[path][method]
    strategies = strategies_for(operation, path, mode, world)

    @settings(
        max_examples=MAX_HOSTILE_BODIES if mode == HOSTILE and list(operation.body) else MAX_EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=st.one_of(strategies))
    def call(case: schemathesis.Case) -> None:
        response = case.call(headers=headers)
        seen.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error], headers=headers)

    headers = world["operator_headers" if mode == HOSTILE else "headers"]
    yaml_types = sorted(body.media_type for body in operation.body if "yaml" in body.media_type)
    if mode == HOSTILE and yaml_types:  # every whole hostile YAML body, to each operation that takes one
        fixed = fixed_path_parameters(path, world)
        for text in yaml_bodies():
            case = operation.Case(body=text.encode(), media_type=yaml_types[0], path_parameters=fixed)
            call = example(case=case)(call)

    seen: list[int] = []
    call()
    if mode == HOSTILE and yaml_types:
        assert 413 in seen, seen  # the body over the limit was sent, and refused as too large
    # The token got through at least once: the run exercised the views, not just authentication.
    assert set(seen) - {401}, seen
