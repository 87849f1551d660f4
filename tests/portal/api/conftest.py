"""Fixtures of the API tests: a bearer-token client per user, a small fleet, two projects.

The cache is the real Redis of ``make test``: submission caches the fleet's GPU capacity there
and DRF counts throttled requests there, so every test starts and ends with an empty cache."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.cache import cache

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
