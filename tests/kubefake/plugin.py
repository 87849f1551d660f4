"""pytest fixtures for the fake API server; other test packages import them into their conftest::

from tests.kubefake.plugin import kube, kube_client  # noqa: F401
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from kubernetes import client

from tests.kubefake.server import FakeKube


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    """A started HTTPS fake with the namespace ``orrery`` and the adapter's RBAC applied.

    Bookmarks every 0.5 s so tests see them without waiting a minute."""
    with FakeKube(bookmark_interval=0.5, bookmark_before_timeout=0.2, future_rv_wait=0.5) as fake:
        yield fake


@pytest.fixture
def kube_client(kube: FakeKube) -> Callable[[str], client.ApiClient]:
    """``kube_client("adapter")`` → an official-client ApiClient for that identity (admin/adapter/unbound)."""
    made: list[client.ApiClient] = []

    def make(user: str = "adapter") -> client.ApiClient:
        configuration = client.Configuration()
        configuration.host = kube.url
        configuration.ssl_ca_cert = kube.ca_file
        configuration.api_key = {"authorization": f"Bearer {kube.token_for(user)}"}
        api = client.ApiClient(configuration)
        made.append(api)
        return api

    yield make
    for api in made:
        api.close()
