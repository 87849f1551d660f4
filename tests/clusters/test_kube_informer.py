"""The informer (list + watch of one resource into a local store) against the fake API server,
through the official client. ``spy`` wraps a client method to see (and, at a chosen moment, to
act on the server) what the informer asks; the requests and answers are the fake's own."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from clusters.adapters.kubernetes import informer as informers
from clusters.adapters.kubernetes.informer import Informer, forget, forget_all, key_of, watched
from tests.kubefake import plugin
from tests.kubefake.server import ADAPTER

kube, kube_client = plugin.kube, plugin.kube_client  # the fake's fixtures


def eventually(check: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s: {what or check}")


class Spy:
    """A ``list_*`` method of the official client that remembers what it was asked and may run
    ``before(params)`` first (to change the server at an exact point of the protocol)."""

    def __init__(self, method: Callable[..., Any], before: Callable[[dict[str, Any]], None] | None = None):
        self.method, self.before = method, before
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **params: Any) -> Any:
        shown = {k: v for k, v in params.items() if not k.startswith("_") or k == "_continue"}
        self.calls.append(shown)
        if self.before is not None:
            self.before(shown)
        return self.method(**params)

    def lists(self) -> list[dict[str, Any]]:
        return [c for c in self.calls if not c.get("watch")]

    def watches(self) -> list[dict[str, Any]]:
        return [c for c in self.calls if c.get("watch")]


@pytest.fixture
def nodes_api(kube_client):
    return client.CoreV1Api(kube_client("adapter")).list_node


@pytest.fixture
def started():
    made: list[Informer] = []

    def start(list_call: Callable[..., Any], **options: Any) -> Informer:
        informer = Informer(list_call, backoff_s=0.05, max_backoff_s=0.4, **options)
        made.append(informer.start())
        return informer

    yield start
    for informer in made:
        informer.stop()
    forget_all()


def test_lists_in_pages_then_watches_from_the_lists_version(kube, nodes_api, started):
    for i in range(7):
        kube.add_gpu_node(f"gpu-{i}")
    spy = Spy(nodes_api)
    informer = started(spy, page_size=3)
    assert informer.wait_synced(10)
    assert sorted(informer.objects()) == [f"gpu-{i}" for i in range(7)]
    pages = spy.lists()
    assert [p["limit"] for p in pages] == [3, 3, 3]
    assert pages[0]["_continue"] is None and pages[1]["_continue"] and pages[2]["_continue"]
    watch = eventually(spy.watches, what="a watch")[0]
    assert watch["resource_version"] == informer.resource_version == str(kube.resource_version)
    assert watch["allow_watch_bookmarks"] is True and watch["timeout_seconds"] > 0


def test_watch_events_change_the_store_and_are_told(kube, nodes_api, started):
    kube.add_gpu_node("gpu-0")
    informer = started(nodes_api)
    seen: list[tuple[str, str]] = []
    informer.on_change(lambda kind, obj: seen.append((kind, key_of(obj))))
    assert informer.wait_synced(10)
    assert seen == [("ADDED", "gpu-0")]  # listeners are told of the first list before it counts as synced
    seen.clear()
    before = informer.changes
    kube.add_gpu_node("gpu-1")
    kube.cordon("gpu-0")
    kube.delete_node("gpu-1")
    eventually(lambda: ("DELETED", "gpu-1") in seen, what="the deletion")
    # add_gpu_node is a create then a kubelet's status patch: ADDED, then MODIFIED
    assert seen == [("ADDED", "gpu-1"), ("MODIFIED", "gpu-1"), ("MODIFIED", "gpu-0"), ("DELETED", "gpu-1")]
    assert sorted(informer.objects()) == ["gpu-0"]
    assert informer.get("gpu-0")["spec"]["unschedulable"] is True
    assert informer.changes == before + 4
    assert informer.resource_version == str(kube.resource_version)


def test_bookmarks_move_the_version_and_are_never_objects(kube, nodes_api, started):
    kube.add_gpu_node("gpu-0")
    informer = started(nodes_api)
    assert informer.wait_synced(10)
    changes = informer.changes
    eventually(lambda: informer.stats["bookmarks"] >= 2, what="two bookmarks (every 0.5 s here)")
    assert list(informer.objects()) == ["gpu-0"]
    assert informer.changes == changes  # a bookmark changes nothing


def test_a_410_in_the_stream_relists(kube, nodes_api, started):
    """The watch cache moved on while the informer was away (its window is 75 s): the server
    answers the watch with a 410 ERROR event, and only a new list catches up."""
    kube.add_gpu_node("gpu-0")

    def before(params: dict[str, Any]) -> None:
        if params.get("watch") and len(spy.watches()) == 2:  # the informer comes back...
            kube.add_gpu_node("late")  # ...after a change it will never be sent
            kube.expire_watch_cache("nodes")

    spy = Spy(nodes_api, before)
    informer = started(spy)
    assert informer.wait_synced(10)
    eventually(lambda: kube.store.subscriptions, what="the watch open on the server")
    kube.store.close_all()  # the server drops the stream
    eventually(lambda: informer.stats["relists"] == 1, what="a relist")
    eventually(lambda: "late" in informer.objects(), what="the node made while away")
    assert len(spy.lists()) == 2
    assert informer.stats["errors"] == 0


def test_an_expired_continue_token_restarts_the_list(kube, nodes_api, started):
    for i in range(5):
        kube.add_gpu_node(f"gpu-{i}")

    def before(params: dict[str, Any]) -> None:
        if params.get("_continue") and len(spy.lists()) == 2:  # between the first and second page
            kube.add_gpu_node("gpu-9")
            kube.compact()  # etcd compacts the first page's snapshot away: 410 on the token

    spy = Spy(nodes_api, before)
    informer = started(spy, page_size=2)
    assert informer.wait_synced(10)
    assert sorted(informer.objects()) == [*(f"gpu-{i}" for i in range(5)), "gpu-9"]
    # the list began again, in one request (no token left to expire)
    assert [(c.get("limit"), bool(c.get("_continue"))) for c in spy.lists()] == [
        (2, False),
        (2, True),
        (None, False),
    ]
    assert informer.stats["full_lists"] == 1 and informer.stats["errors"] == 0


def test_a_closed_watch_resumes_from_the_last_version_without_relisting(kube, nodes_api, started):
    kube.add_gpu_node("gpu-0")
    spy = Spy(nodes_api)
    informer = started(spy)
    assert informer.wait_synced(10)
    eventually(spy.watches)
    kube.cordon("gpu-0")
    eventually(lambda: informer.get("gpu-0")["spec"].get("unschedulable"))
    version = informer.resource_version
    eventually(lambda: kube.store.subscriptions, what="the watch open on the server")
    kube.store.close_all()
    eventually(lambda: len(spy.watches()) >= 2, what="a new watch")
    assert spy.watches()[1]["resource_version"] == version
    kube.add_gpu_node("gpu-1")
    eventually(lambda: "gpu-1" in informer.objects())
    assert len(spy.lists()) == 1 and informer.stats["relists"] == 0


def test_leaving_the_selector_removes_the_object(kube, nodes_api, started):
    kube.add_gpu_node("gpu-0")
    informer = started(nodes_api, label_selector="orrery.io/pool=infer")
    seen: list[str] = []
    informer.on_change(lambda kind, obj: seen.append(kind))
    assert informer.wait_synced(10) and informer.objects() == {}
    kube.patch_node("gpu-0", {"metadata": {"labels": {"orrery.io/pool": "infer"}}})
    eventually(lambda: "gpu-0" in informer.objects())
    kube.patch_node("gpu-0", {"metadata": {"labels": {"orrery.io/pool": "train"}}})
    eventually(lambda: informer.objects() == {}, what="the node leaving")
    assert seen == ["ADDED", "DELETED"]
    assert kube.get("nodes", "gpu-0") is not None  # it still exists: it only left the selection


def test_errors_back_off_and_recover(kube, kube_client, started):
    """A forbidden list is retried with a growing, capped delay — never in a tight loop — and
    the informer syncs once the server lets it."""
    kube.add_gpu_node("gpu-0")
    informer = started(client.CoreV1Api(kube_client("unbound")).list_node)
    time.sleep(1.5)
    assert not informer.has_synced()
    assert "403" in informer.last_error
    # 0.05 s doubling to 0.4 s (plus up to half again): about 6 tries in 1.5 s; a loop without
    # backoff would make hundreds
    assert 2 <= informer.stats["errors"] <= 12
    kube.users[kube.unbound_token] = ADAPTER  # an operator grants the rights
    assert informer.wait_synced(5)
    assert list(informer.objects()) == ["gpu-0"]


def test_backoff_doubles_with_jitter_up_to_its_cap():
    informer = Informer(lambda **_: None, backoff_s=1.0, max_backoff_s=8.0)
    delays = [informer._next_backoff() for _ in range(6)]
    for delay, base in zip(delays, [1, 2, 4, 8, 8, 8], strict=True):
        assert base <= delay <= min(base * 1.5, 8.0)


def test_an_unreachable_server_is_an_error_not_a_crash(started):
    informer = started(client.CoreV1Api(_client_for("http://127.0.0.1:9")).list_node)
    eventually(lambda: informer.stats["errors"] >= 2, what="two failed tries")
    assert informer.running and not informer.has_synced()


def test_stop_ends_an_open_watch_at_once(kube, nodes_api, started):
    spy = Spy(nodes_api)
    informer = started(spy)
    assert informer.wait_synced(10)
    eventually(spy.watches)
    began = time.monotonic()
    informer.stop()
    assert not informer._thread.is_alive()
    assert time.monotonic() - began < 3


def test_the_registry_starts_one_informer_per_key_and_replaces_on_new_credentials(kube, kube_client):
    try:
        core = client.CoreV1Api(kube_client("adapter"))
        first = watched("c1", "nodes", core.list_node, generation="a")
        assert watched("c1", "nodes", core.list_node, generation="a") is first
        other = watched("c1", "nodes", core.list_node, generation="a", label_selector="x=y")
        assert other is not first
        rotated = watched("c1", "nodes", core.list_node, generation="b")
        assert rotated is not first and not first.running and rotated.running
        assert forget("c1") == 2
        assert not rotated.running and not other.running
        assert informers._informers == {}
    finally:
        forget_all()


def _client_for(url: str) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = url
    return client.ApiClient(configuration)
