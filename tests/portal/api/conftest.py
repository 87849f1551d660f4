"""Fixtures of the API tests: a bearer-token client per user, a small fleet, two projects.

The cache is the real Redis of ``make test``: submission caches the fleet's GPU capacity there
and DRF counts throttled requests there, so every test starts and ends with an empty cache.

The tests of modules that submit jobs run twice: through Django's views (``django``, as under
ASGI) and through the WSGI fast path the production server puts in front of them (``fast``,
``portal.api.fastpath``), so one suite holds both to the same answers."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.cache import cache
from django.core.handlers.wsgi import WSGIRequest
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from django.http import HttpResponse
from rest_framework.test import APIClient

from portal.api.fastpath import SubmissionFastPath
from tests.factories import make_cluster, make_job, make_node, make_project, make_queue

VALID_SPEC: dict[str, Any] = {
    "apiVersion": "orrery/v1",
    "kind": "Job",
    "metadata": {"name": "t", "project": "vision"},
    "spec": {
        "queue": "default",
        "resources": {"gpus": "h100:8", "cpus": 32, "memory": "256Gi"},
        "timeLimit": "2h",
        "run": "python train.py",
    },
}


DELETE = object()

# The modules whose tests submit jobs (POST jobs, jobs/batch): they run on both paths.
SUBMITTING = {
    "test_accounts",
    "test_budgets",
    "test_fairness",
    "test_fuzz",
    "test_jobs_any_model",
    "test_jobs_arrays",
    "test_jobs_batch",
    "test_jobs_dependency",
    "test_jobs_fine_grained",
    "test_job_rows",
    "test_jobs_submit",
    "test_parsers",
    "test_policy",
    "test_redis_away",
    "test_scopes",
    "test_throttling",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    module = metafunc.module.__name__.rsplit(".", 1)[-1]
    if "submission_path" in metafunc.fixturenames and module in SUBMITTING:
        metafunc.parametrize("submission_path", ["django", "fast"])


@pytest.fixture
def submission_path() -> str:
    return "django"


class FastPathHandler:
    """The test client's handler behind the submission fast path, as ``portal.wsgi`` puts it:
    what the fast path answers becomes the response; the rest goes to Django's handler."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler
        self.fast = SubmissionFastPath(None)  # type: ignore[arg-type]
        self.answered = 0

    def __call__(self, environ: dict[str, Any]) -> Any:
        # As Django's test handler does: a test's transaction must outlive its requests.
        request_started.disconnect(close_old_connections)
        request_finished.disconnect(close_old_connections)
        try:
            answer = self.fast.answer(environ)
        finally:
            request_started.connect(close_old_connections)
            request_finished.connect(close_old_connections)
        if answer is None:
            return self.handler(environ)
        self.answered += 1
        status, headers, payload = answer
        response = HttpResponse(payload, status=status)
        for name, value in headers:
            response[name] = value
        response.wsgi_request = WSGIRequest(environ)
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handler, name)


@pytest.fixture
def api(api: Callable[..., APIClient], submission_path: str) -> Callable[..., APIClient]:
    """``api(alice)``: as everywhere, and on the ``fast`` path through the fast path."""
    if submission_path == "django":
        return api

    def make(*args: Any, **kwargs: Any) -> APIClient:
        client = api(*args, **kwargs)
        client.handler = FastPathHandler(client.handler)
        return client

    return make


def job_spec(**changes: Any) -> dict[str, Any]:
    """A fresh copy of the minimal valid spec; ``changes`` use ``__`` for nesting:
    ``job_spec(spec__resources__gpus="a100:1", metadata__name="x")``. A value of ``DELETE``
    removes the key."""
    document = copy.deepcopy(VALID_SPEC)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = document
        for key in parents:
            node = node.setdefault(key, {})
        if value is DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return document


def error_paths(response: Any) -> list[str]:
    """The ``path`` of every entry of an error body, checking the body's shape on the way."""
    body = response.json()
    assert set(body) >= {"detail", "errors"}, body
    assert isinstance(body["detail"], str) and body["detail"], body
    return [e["path"] for e in body["errors"]]


@pytest.fixture(autouse=True)
def empty_cache() -> Iterator[None]:
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def fleet(db) -> SimpleNamespace:
    """One ready cluster: three 8×h100 nodes and one 4×a100 node."""
    cluster = make_cluster("sim-a", display_name="Simulated A", config={"endpoint": "http://a.invalid"})
    h100 = [make_node(cluster, gpus=8, model="h100", name=f"a-h{i}") for i in range(3)]
    a100 = make_node(cluster, gpus=4, model="a100", name="a-a0")
    return SimpleNamespace(cluster=cluster, h100=h100, a100=a100, nodes=[*h100, a100])


@pytest.fixture
def nlp(bob):
    return make_project("nlp", members=(bob,))


@pytest.fixture
def nlp_queue(nlp):
    return make_queue(nlp)


@pytest.fixture
def alice_job(alice, queue):
    return make_job(alice, queue, name="alice-train")


@pytest.fixture
def bob_job(bob, nlp_queue):
    return make_job(bob, nlp_queue, name="bob-train")
