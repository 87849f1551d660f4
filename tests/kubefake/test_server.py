"""Behaviours of the fake that the recordings cannot show at test speed: bookmarks on a short
interval, the end of a watch at timeoutSeconds, the 410 ERROR once the watch cache moved on, the
etcd-served watch, TLS with the generated CA through the official client, kubeconfig, access reviews."""

from __future__ import annotations

import json
import time

import pytest
import yaml
from kubernetes import client, config

from tests.kubefake.server import FakeKube


def _watch_lines(api: client.ApiClient, **query) -> list[dict]:
    response = client.CoreV1Api(api).list_node(watch=True, _preload_content=False, **query)
    return [json.loads(line) for line in response.read().splitlines() if line]


def test_bookmarks_come_on_the_configured_interval_and_the_watch_ends_at_timeout(kube, kube_client):
    kube.add_gpu_node("gpu-1")
    api = kube_client("adapter")
    rv = client.CoreV1Api(api).list_node().metadata.resource_version
    started = time.monotonic()
    events = _watch_lines(api, resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=2)
    elapsed = time.monotonic() - started
    assert 1.8 < elapsed < 4
    bookmarks = [e for e in events if e["type"] == "BOOKMARK"]
    assert bookmarks, events
    assert bookmarks[0]["object"]["metadata"]["creationTimestamp"] is None
    assert bookmarks[0]["object"]["status"]["daemonEndpoints"] == {"kubeletEndpoint": {"Port": 0}}


def test_no_bookmarks_unless_asked(kube, kube_client):
    events = _watch_lines(kube_client("adapter"), resource_version="0", timeout_seconds=1)
    assert all(e["type"] != "BOOKMARK" for e in events)


def test_watch_from_an_expired_rv_gets_one_error_event(kube, kube_client):
    kube.add_gpu_node("gpu-1")
    old = kube.resource_version
    kube.set_node_ready("gpu-1", False)
    kube.expire_watch_cache("nodes")
    events = _watch_lines(kube_client("adapter"), resource_version=str(old), timeout_seconds=5)
    assert [e["type"] for e in events] == ["ERROR"]
    assert events[0]["object"]["code"] == 410
    assert events[0]["object"]["message"].startswith(f"too old resource version: {old} (")


def test_without_the_watch_cache_the_error_is_etcds_and_there_are_no_bookmarks():
    with FakeKube(tls=False, watch_cache=False, bookmark_interval=0.2, watch_cache_size=1) as fake:
        fake.add_gpu_node("gpu-1")
        old = fake.resource_version
        fake.set_node_ready("gpu-1", False)
        fake.set_node_ready("gpu-1", True)
        configuration = client.Configuration()
        configuration.host = fake.url
        configuration.api_key = {"authorization": f"Bearer {fake.admin_token}"}
        with client.ApiClient(configuration) as api:
            events = _watch_lines(api, resource_version=str(old - 1), timeout_seconds=2)
            assert events[0]["object"]["message"] == "The resourceVersion for the provided watch is too old."
            live = _watch_lines(api, resource_version="0", allow_watch_bookmarks=True, timeout_seconds=1)
            assert [e["type"] for e in live] == ["ADDED"]


def test_a_selector_watch_sees_leaving_as_deleted_with_the_old_state(kube, kube_client):
    kube.add_gpu_node("gpu-1", labels={"pool": "infer"})
    api = kube_client("adapter")
    rv = client.CoreV1Api(api).list_node().metadata.resource_version
    kube.patch_node("gpu-1", {"metadata": {"labels": {"pool": "train"}}})
    events = _watch_lines(api, resource_version=rv, label_selector="pool=infer", timeout_seconds=1)
    assert [e["type"] for e in events] == ["DELETED"]
    assert events[0]["object"]["metadata"]["labels"]["pool"] == "infer"
    assert events[0]["object"]["metadata"]["resourceVersion"] == str(kube.resource_version)


def test_the_kubeconfig_works_with_the_official_client_over_tls(kube):
    document = yaml.safe_load(kube.kubeconfig("adapter"))
    api = config.new_client_from_config_dict(document)
    nodes = client.CoreV1Api(api).list_node()
    assert nodes.items == []


def test_a_client_without_the_ca_is_refused(kube):
    configuration = client.Configuration()
    configuration.host = kube.url
    configuration.api_key = {"authorization": f"Bearer {kube.adapter_token}"}
    configuration.retries = False
    with client.ApiClient(configuration) as api, pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
        client.CoreV1Api(api).list_node()


@pytest.mark.parametrize(
    ("user", "status"),
    [("admin", 200), ("adapter", 403), ("unbound", 403)],
    ids=["admin", "adapter", "unbound"],
)
def test_rbac_on_node_patch(kube, kube_client, user, status):
    kube.add_gpu_node("gpu-1")
    try:
        client.CoreV1Api(kube_client(user)).patch_node("gpu-1", {"spec": {"unschedulable": True}})
        got = 200
    except client.ApiException as error:
        got = error.status
        body = json.loads(error.body)
        assert body["reason"] == "Forbidden"
        assert 'cannot patch resource "nodes" in API group "" at the cluster scope' in body["message"]
    assert got == status


def test_an_unknown_token_is_401(kube):
    configuration = client.Configuration()
    configuration.host = kube.url
    configuration.ssl_ca_cert = kube.ca_file
    configuration.api_key = {"authorization": "Bearer nope"}
    with client.ApiClient(configuration) as api, pytest.raises(client.ApiException) as raised:
        client.CoreV1Api(api).list_node()
    assert raised.value.status == 401


@pytest.mark.parametrize(
    ("verb", "resource", "namespace", "allowed"),
    [
        ("list", "nodes", "", True),
        ("create", "jobs", "orrery", True),
        ("create", "jobs", "default", False),
        ("patch", "nodes", "", False),
    ],
    ids=["list-nodes", "create-jobs-orrery", "create-jobs-default", "patch-nodes"],
)
def test_self_subject_access_review_answers_for_the_adapter(
    kube, kube_client, verb, resource, namespace, allowed
):
    group = "batch" if resource == "jobs" else ""
    review = {
        "spec": {
            "resourceAttributes": {"verb": verb, "group": group, "resource": resource, "namespace": namespace}
        }
    }
    answer = client.AuthorizationV1Api(kube_client("adapter")).create_self_subject_access_review(review)
    assert answer.status.allowed is allowed


def test_pod_log_text_and_unreachable_kubelet(kube, kube_client):
    kube.add_gpu_node("gpu-1")
    pod = {
        "metadata": {"name": "p"},
        "spec": {"nodeName": "gpu-1", "containers": [{"name": "main", "image": "x:1"}]},
    }
    core = client.CoreV1Api(kube_client("adapter"))
    core.create_namespaced_pod("orrery", pod)
    kube.set_pod_log("orrery", "p", "one\ntwo\nthree\n")
    assert core.read_namespaced_pod_log("p", "orrery", tail_lines=2) == "two\nthree\n"
    kube.set_kubelet_reachable("gpu-1", False)
    with pytest.raises(client.ApiException) as raised:
        core.read_namespaced_pod_log("p", "orrery")
    assert raised.value.status == 500
    assert "connect: connection refused" in json.loads(raised.value.body)["message"]


def test_five_thousand_nodes_list_and_a_change_reaches_a_watch(kube, kube_client):
    for index in range(5000):
        kube.add_gpu_node(f"gpu-{index:04d}")
    api = kube_client("adapter")
    response = client.CoreV1Api(api).list_node(_preload_content=False)
    body = json.loads(response.data)
    assert len(body["items"]) == 5000
    watch = client.CoreV1Api(api).list_node(
        watch=True,
        resource_version=body["metadata"]["resourceVersion"],
        timeout_seconds=2,
        _preload_content=False,
    )
    kube.set_node_ready("gpu-4999", False)
    lines = [json.loads(line) for line in watch.read().splitlines() if line]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in lines] == [("MODIFIED", "gpu-4999")]
