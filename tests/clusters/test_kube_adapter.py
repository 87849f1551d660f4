"""The Kubernetes adapter through the fake API server (tests/kubefake), with the official client:
onboarding and its connection test, dispatch, sync from watches, logs and cancel.

The fake's simulated controllers stay off here: each test plays the Job controller and the
kubelet itself (``run_pod``), so what the adapter sees is exactly what the test wrote, as in the
recordings of a real server without controllers."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from clusters.adapters.base import AdapterError, Phase, Share, Work
from clusters.adapters.kubernetes.adapter import KubernetesAdapter
from clusters.adapters.kubernetes.client import KubeError, parse_kubeconfig
from clusters.adapters.kubernetes.informer import forget_all
from clusters.adapters.kubernetes.manifests import LABEL_ATTEMPT, LABEL_TAG, job_name
from clusters.models import Cluster, ClusterSecret
from clusters.services.onboarding import onboard_kubernetes
from foundation.models import AuditEntry
from tests.factories import ensure_catalog
from tests.kubefake import FakeKube

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parents[2]
RBAC = ROOT / "docs" / "clusters" / "kubernetes.rbac.yaml"
NS = "orrery"
adapter = KubernetesAdapter()


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    """A fake with the RBAC of docs/clusters/kubernetes.md and two H100 nodes."""
    with FakeKube(adapter_rbac=False, bookmark_interval=0.5, bookmark_before_timeout=0.2) as fake:
        fake.apply_rbac(RBAC.read_text())
        for name in ("gpu-1", "gpu-2"):
            fake.add_gpu_node(name)
        yield fake
        forget_all()


def onboard(kube: FakeKube, name: str = "k8s", **fields: Any) -> Cluster:
    ensure_catalog()
    given = {"url": kube.url, "ca": kube.ca_pem.decode(), "token": kube.adapter_token} | fields
    cluster, _ = onboard_kubernetes(name, **given)
    return Cluster.objects.get(pk=cluster.pk)


@pytest.fixture
def k8s(kube) -> Cluster:
    return onboard(kube)


def work(cluster: Cluster, *, nodes: int = 1, attempt: str = "", **fields: Any) -> Work:
    names = [f"gpu-{i + 1}" for i in range(nodes)]
    ids = dict(cluster.nodes.filter(name__in=names).values_list("name", "pk"))
    base = dict(
        attempt_id=attempt or str(uuid.uuid4()),
        job_id=7,
        number=1,
        epoch=1,
        script="echo hello",
        env={},
        shares=tuple(Share(ids[n], n, (0,)) for n in names),
        image="busybox:1.36",
        time_limit_s=600,
    )
    return Work(**(base | fields))


def dispatch(cluster: Cluster, *works: Work) -> list:
    return list(adapter.dispatch(cluster, list(works)))


def run_pod(
    kube: FakeKube, w: Work, phase: str, *, index: int = 0, exit_code: int | None = None, reason: str = ""
) -> str:
    """Play the Job controller (a pod from the Job's template, on its node) and the kubelet (the
    pod's status); returns the pod's name."""
    job = kube.get("jobs", job_name(w.attempt_id), NS)
    name = f"{job['metadata']['name']}-{index}-pod"
    if kube.get("pods", name, NS) is None:
        template = job["spec"]["template"]
        spec = dict(template["spec"], nodeName=w.nodes[index])
        body = {"metadata": {"name": name, "labels": template["metadata"]["labels"]}, "spec": spec}
        kube.cluster.create("pods", NS, body, manager="kube-controller-manager")
    state: dict[str, Any] = {"running": {"startedAt": "2026-12-01T14:31:01Z"}}
    if phase in ("Succeeded", "Failed"):
        state = {"terminated": {"exitCode": exit_code or 0, "reason": reason or "Completed"}}
    elif phase == "Pending":
        state = {"waiting": {"reason": reason or "ContainerCreating", "message": f"{reason} for busybox"}}
    status = {
        "phase": phase,
        "containerStatuses": [{"name": "main", "state": state, "ready": phase == "Running"}],
    }
    kube.cluster.patch(
        "pods",
        NS,
        name,
        {"status": status},
        "application/merge-patch+json",
        subresource="status",
        manager="kubelet",
    )
    return name


def synced(cluster: Cluster, works: list[Work], until: Any, timeout: float = 10.0):
    """Sync until ``until(result)`` holds (the watch delivers within milliseconds)."""
    end = time.monotonic() + timeout
    while True:
        result = adapter.sync(cluster, works)
        if until(result) or time.monotonic() > end:
            return result
        time.sleep(0.05)


def phase_of(result, w: Work) -> Phase | None:
    return next((s.phase for s in result.states if s.attempt_id == w.attempt_id), None)


# --- onboarding -----------------------------------------------------------------------------------


def test_onboarding_tests_the_connection_adds_the_nodes_and_seals_the_token(kube):
    cluster = onboard(kube)
    assert cluster.kind == "kubernetes" and cluster.identity == "shared" and cluster.state == "ready"
    assert cluster.config["namespace"] == NS and cluster.config["api"] == "v1.33.3" and cluster.config["tag"]
    assert "orrery-adapter" in cluster.state_reason
    assert sorted(cluster.nodes.values_list("name", flat=True)) == ["gpu-1", "gpu-2"]
    row = ClusterSecret.objects.get(cluster=cluster)
    assert kube.adapter_token not in row.sealed and row.data["token"] == kube.adapter_token
    assert kube.adapter_token not in json.dumps(cluster.config)
    entry = AuditEntry.objects.get(target="cluster:k8s")
    assert kube.adapter_token not in json.dumps(entry.details) and entry.details["user"] == "orrery-adapter"
    again = onboard(kube)  # a new credential keeps the tag: the Jobs already there stay this cluster's
    assert again.config["tag"] == cluster.config["tag"]


def test_onboarding_with_a_kubeconfig(kube):
    cluster = onboard(kube, url="", ca="", token="", kubeconfig=kube.kubeconfig("adapter"))
    assert ClusterSecret.objects.get(cluster=cluster).data == {"kubeconfig": kube.kubeconfig("adapter")}
    assert cluster.nodes.count() == 2


@pytest.mark.parametrize(
    "url", ["https://127.0.0.1:9", "https://127.0.0.1:1/"], ids=["refused", "another-refused-port"]
)
def test_an_unreachable_server_gets_the_same_answer_as_anything_else_that_is_not_kubernetes(kube, url):
    with pytest.raises(KubeError) as caught:
        onboard(kube, url=url)
    assert caught.value.field == "url" and not caught.value.apiserver
    assert str(caught.value) == (
        "no Kubernetes API server accepted this credential at this URL (the server's log says why)"
    )
    assert not Cluster.objects.exists()


def test_a_ca_that_did_not_sign_the_servers_certificate_is_named_once_a_kube_apiserver_answered(kube):
    with FakeKube() as other:
        wrong_ca = other.ca_pem.decode()
    with pytest.raises(KubeError, match="certificate is not signed by the given CA") as caught:
        onboard(kube, ca=wrong_ca)
    assert caught.value.field == "caCert" and caught.value.apiserver
    assert not Cluster.objects.exists()


def test_an_unknown_token_is_a_401(kube):
    with pytest.raises(KubeError, match="401") as caught:
        onboard(kube, token="not-a-token")
    assert caught.value.field == "token"


def test_missing_permissions_are_named_by_verb_and_resource(kube):
    minimal = kube.add_user("orrery-minimal")
    kube.apply_rbac(
        (ROOT / "tests" / "kubefake" / "rbac.yaml").read_text().replace("orrery-adapter", "orrery-minimal")
    )
    with pytest.raises(KubeError) as caught:
        onboard(kube, token=minimal)
    message = str(caught.value)
    assert caught.value.field == "token"
    assert (
        "orrery-minimal may not: list pods at the cluster scope; watch pods at the cluster scope;" in message
    )
    assert 'create secrets in namespace "orrery"' in message  # the reference role predates secret env
    with pytest.raises(KubeError) as unbound:
        onboard(kube, token=kube.unbound_token)
    for words in (
        "list nodes at the cluster scope",
        'create jobs.batch in namespace "orrery"',
        'get pods/log in namespace "orrery"',
    ):
        assert words in str(unbound.value)
    assert not Cluster.objects.exists()


def test_the_namespace_must_exist(kube):
    with pytest.raises(KubeError, match="namespace 'absent' does not exist") as caught:
        onboard(kube, token=kube.admin_token, namespace="absent")
    assert caught.value.field == "namespace"


@pytest.mark.parametrize(
    ("user", "words"),
    [
        ({"exec": {"command": "/bin/sh", "args": ["-c", "id"]}}, "would run a program"),
        ({"tokenFile": "/etc/shadow"}, "refers to a file"),
        ({"auth-provider": {"name": "gcp"}}, "would run a program"),
    ],
    ids=["exec", "token-file", "auth-provider"],
)
def test_a_kubeconfig_cannot_run_or_read_anything_on_the_orrery_server(user, words):
    doc = {
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": "https://k8s:6443"}}],
        "users": [{"name": "u", "user": user}],
    }
    with pytest.raises(KubeError, match=words) as caught:
        parse_kubeconfig(json.dumps(doc))
    assert caught.value.field == "kubeconfig"
    insecure = json.loads(json.dumps(doc))
    insecure["users"][0]["user"] = {"token": "t"}
    insecure["clusters"][0]["cluster"]["insecure-skip-tls-verify"] = True
    with pytest.raises(KubeError, match="insecure-skip-tls-verify"):
        parse_kubeconfig(json.dumps(insecure))


def test_operators_onboard_through_the_api_with_field_paths_for_what_is_wrong(kube, api, alice, operator):
    ensure_catalog()
    body = {
        "name": "k8s",
        "kind": "kubernetes",
        "url": kube.url,
        "caCert": kube.ca_pem.decode(),
        "token": kube.adapter_token,
    }
    assert api(alice).post("/api/v1/clusters", body, format="json").status_code == 403
    ops = api(operator)
    bad = [
        ({**body, "token": "nope"}, "token", "401"),
        ({**body, "url": "https://127.0.0.1:9"}, "url", "no Kubernetes API server accepted"),
        ({k: v for k, v in body.items() if k != "token"}, "token", "required"),
        ({**body, "kubeconfig": kube.kubeconfig()}, "url", "not both"),
        ({**body, "namespace": "Not_A_Label"}, "namespace", "DNS label"),
        ({**body, "runAsUser": 0}, "runAsUser", "greater than or equal to 1"),
        ({**body, "caCert": "not pem"}, "caCert", "PEM"),
    ]
    for wrong, path, words in bad:
        answer = ops.post("/api/v1/clusters", wrong, format="json")
        assert answer.status_code == 400, answer.content
        errors = {e["path"]: e["message"] for e in answer.json()["errors"]}
        assert words in errors.get(path, ""), errors
    assert not Cluster.objects.filter(name="k8s").exists()
    created = ops.post("/api/v1/clusters", body | {"runAsUser": 2000}, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["kind"] == "kubernetes" and kube.adapter_token not in created.content.decode()
    assert Cluster.objects.get(name="k8s").config["run_as_uid"] == 2000
    by_kubeconfig = {"name": "k8s-2", "kind": "kubernetes", "kubeconfig": kube.kubeconfig()}
    assert ops.post("/api/v1/clusters", by_kubeconfig, format="json").status_code == 201


def test_add_cluster_kind_kubernetes(kube, tmp_path):
    ensure_catalog()
    (tmp_path / "token").write_text(kube.adapter_token + "\n")
    (tmp_path / "ca.pem").write_bytes(kube.ca_pem)
    out = StringIO()
    call_command(
        "add_cluster",
        "--kind",
        "kubernetes",
        "--name",
        "k8s",
        "--url",
        kube.url,
        "--token-file",
        str(tmp_path / "token"),
        "--ca-file",
        str(tmp_path / "ca.pem"),
        stdout=out,
    )
    assert "Cluster k8s (kubernetes, v1.33.3, namespace orrery): 2 nodes, 16 GPUs." in out.getvalue()
    (tmp_path / "kubeconfig").write_text(kube.kubeconfig("unbound"))
    with pytest.raises(CommandError, match="may not: get nodes"):
        call_command(
            "add_cluster",
            "--kind",
            "kubernetes",
            "--name",
            "k8s-2",
            "--kubeconfig",
            str(tmp_path / "kubeconfig"),
        )


# --- dispatch ---------------------------------------------------------------------------------


def test_a_dispatch_creates_the_job_and_a_retry_finds_it(kube, k8s):
    w = work(k8s)
    (first,) = dispatch(k8s, w)
    (again,) = dispatch(k8s, w)
    assert first.error == again.error == "" and first.remote_id == again.remote_id == job_name(w.attempt_id)
    (job,) = kube.objects("jobs", NS)
    labels = job["metadata"]["labels"]
    assert labels[LABEL_ATTEMPT] == w.attempt_id and labels[LABEL_TAG] == k8s.config["tag"]
    assert job["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 1000


def test_a_foreign_job_under_the_attempts_name_is_refused_not_adopted(kube, k8s):
    w = work(k8s)
    theirs = {
        "metadata": {"name": job_name(w.attempt_id), "labels": {LABEL_ATTEMPT: w.attempt_id}},
        "spec": {
            "template": {
                "spec": {"restartPolicy": "Never", "containers": [{"name": "x", "image": "busybox"}]}
            }
        },
    }
    kube.cluster.create("jobs", NS, theirs)
    (sent,) = dispatch(k8s, w)
    assert sent.remote_id == "" and "already exists" in sent.error and "not this attempt's" in sent.error


def test_a_job_that_cannot_be_made_leaves_no_secret_behind(kube, k8s):
    w = work(k8s, env={"TOKEN": "s3cr3t"}, secret_names=frozenset({"TOKEN"}))
    foreign = {
        "metadata": {"name": job_name(w.attempt_id)},
        "spec": {
            "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "x", "image": "b"}]}}
        },
    }
    kube.cluster.create("jobs", NS, foreign)
    (sent,) = dispatch(k8s, w)
    assert "already exists" in sent.error
    assert kube.objects("secrets", NS) == []


def test_onboarding_again_keeps_the_operators_settings_and_its_namespace(kube, k8s):
    Cluster.objects.filter(pk=k8s.pk).update(
        config=dict(k8s.config, tolerated_taints=["maintenance"], uids={"alice": 1500})
    )
    again = onboard(kube)  # a rotated credential
    assert again.config["tolerated_taints"] == ["maintenance"] and again.config["uids"] == {"alice": 1500}
    with pytest.raises(KubeError) as moved:
        onboard(kube, namespace="default")
    assert moved.value.field == "namespace"


def test_what_can_never_run_fails_at_once(kube, k8s):
    (sent,) = dispatch(k8s, work(k8s, image=""))
    assert sent.phase is Phase.FAILED and "container images only" in sent.message
    (unmapped,) = dispatch(k8s, work(k8s, run_as=None))
    assert unmapped.phase is Phase.FAILED and not kube.objects("jobs", NS)


def test_a_refusal_of_the_api_server_is_a_retried_error_with_its_message(kube, k8s):
    """RBAC taken away after onboarding (here: a namespace the credential has no Role in)."""
    Cluster.objects.filter(pk=k8s.pk).update(config=dict(k8s.config, namespace="default"))
    k8s.refresh_from_db()
    (sent,) = dispatch(k8s, work(k8s))
    assert sent.error.startswith("403 Forbidden") and 'cannot create resource "jobs"' in sent.error
    assert sent.phase is None  # tried again at the next drain, not failed


def test_a_gang_gets_an_indexed_job_a_headless_service_and_its_rendezvous(kube, k8s):
    w = work(k8s, nodes=2)
    (sent,) = dispatch(k8s, w)
    assert sent.error == ""
    (job,) = kube.objects("jobs", NS)
    (service,) = kube.objects("services", NS)
    name = job_name(w.attempt_id)
    assert service["metadata"]["name"] == name and service["spec"]["clusterIP"] == "None"
    assert (job["spec"]["completionMode"], job["spec"]["completions"]) == ("Indexed", 2)
    env = {
        e["name"]: e.get("value") or e.get("valueFrom")
        for e in job["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["MASTER_ADDR"] == f"{name}-0.{name}" and env["WORLD_SIZE"] == "2"
    assert "job-completion-index" in env["RANK"]["fieldRef"]["fieldPath"]
    assert dispatch(k8s, w)[0].error == ""  # the Service found again is ours too


# --- sync, logs, cancel -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "exit_code", "reason", "expected", "words"),
    [
        ("Succeeded", 0, "Completed", Phase.SUCCEEDED, ""),
        ("Failed", 3, "Error", Phase.FAILED, "Error (exit code 3)"),
        ("Failed", 137, "OOMKilled", Phase.FAILED, "OOMKilled (exit code 137)"),
        ("Pending", None, "ErrImagePull", Phase.FAILED, "ErrImagePull"),
        ("Pending", None, "ImagePullBackOff", Phase.FAILED, "ImagePullBackOff"),
    ],
    ids=["success", "exit-3", "oom", "err-image-pull", "image-pull-backoff"],
)
def test_a_pod_runs_to_its_end_and_sync_says_so_from_the_watches(
    kube, k8s, phase, exit_code, reason, expected, words
):
    w = work(k8s)
    w = Work(**{**w.__dict__, "remote_id": dispatch(k8s, w)[0].remote_id})
    first = synced(k8s, [w], lambda r: phase_of(r, w) is Phase.QUEUED)
    assert phase_of(first, w) is Phase.QUEUED  # a Job with no pod yet
    run_pod(kube, w, "Running")
    assert phase_of(synced(k8s, [w], lambda r: phase_of(r, w) is Phase.RUNNING), w) is Phase.RUNNING
    run_pod(kube, w, phase, exit_code=exit_code, reason=reason)
    result = synced(k8s, [w], lambda r: phase_of(r, w) is expected)
    (state,) = result.states
    assert state.phase is expected and words in state.message
    if exit_code is not None:
        assert state.exit_code == exit_code


def test_the_deadline_is_a_timeout(kube, k8s):
    w = work(k8s)
    dispatch(k8s, w)
    run_pod(kube, w, "Failed", exit_code=143, reason="Error")
    status = {
        "startTime": "2026-12-01T14:31:00Z",
        "failed": 1,
        "conditions": [
            {
                "type": t,
                "status": "True",
                "reason": "DeadlineExceeded",
                "message": "Job was active longer than specified deadline",
            }
            for t in ("FailureTarget", "Failed")
        ],
    }
    kube.cluster.patch(
        "jobs",
        NS,
        job_name(w.attempt_id),
        {"status": status},
        "application/merge-patch+json",
        subresource="status",
        manager="kube-controller-manager",
    )
    result = synced(k8s, [w], lambda r: phase_of(r, w) is Phase.TIMEOUT)
    assert phase_of(result, w) is Phase.TIMEOUT


def test_logs_arrive_as_each_nodes_stream_and_a_kubelet_out_of_reach_is_survived(kube, k8s):
    w = work(k8s)
    dispatch(k8s, w)
    pod = run_pod(kube, w, "Running")
    kube.set_kubelet_reachable("gpu-1", False)
    quiet = synced(k8s, [w], lambda r: phase_of(r, w) is Phase.RUNNING)
    assert quiet.output == []  # a 500 from pods/log: nothing this time, no error
    kube.set_kubelet_reachable("gpu-1", True)
    kube.set_pod_log(NS, pod, "hello from the pod\n")
    result = synced(k8s, [w], lambda r: bool(r.output))
    (chunk,) = result.output
    assert (chunk.attempt_id, chunk.node, chunk.offset, chunk.data) == (
        w.attempt_id,
        "gpu-1",
        0,
        "hello from the pod\n",
    )


def test_cancel_deletes_the_job_its_pods_and_its_service_with_no_garbage_collector(kube, k8s):
    w = work(k8s, nodes=2)
    dispatch(k8s, w)
    run_pod(kube, w, "Running", index=0)
    run_pod(kube, w, "Running", index=1)
    assert adapter.cancel(k8s, [job_name(w.attempt_id)]) == 1
    assert kube.objects("jobs", NS) == [] and kube.objects("services", NS) == []
    # Bound running pods are deleted gracefully: marked, then gone once their kubelet stops them.
    assert all(p["metadata"].get("deletionTimestamp") for p in kube.objects("pods", NS))
    assert adapter.cancel(k8s, [job_name(w.attempt_id)]) == 1  # already gone: nothing to refuse


def test_secret_env_lives_in_a_secret_never_in_the_job_and_goes_with_it(kube, k8s):
    w = work(k8s, env={"PLAIN": "p", "HF_TOKEN": "hf-s3cr3t"}, secret_names=frozenset({"HF_TOKEN"}))
    (sent,) = dispatch(k8s, w)
    assert sent.error == "", sent.error
    (job,) = kube.objects("jobs", NS)
    assert "hf-s3cr3t" not in json.dumps(job) and "PLAIN" in json.dumps(job)
    (secret,) = kube.objects("secrets", NS)
    assert secret["metadata"]["name"] == job["metadata"]["name"]
    assert base64.b64decode(secret["data"]["HF_TOKEN"]).decode() == "hf-s3cr3t"
    assert adapter.cancel(k8s, [job_name(w.attempt_id)]) == 1
    assert kube.objects("secrets", NS) == []


def test_jobs_of_attempts_not_asked_about_are_orphans_and_a_vanished_job_fails(kube, k8s):
    asked, other = work(k8s), work(k8s)
    dispatch(k8s, asked, other)
    result = synced(k8s, [asked], lambda r: bool(r.orphans))
    assert [(o.attempt_id, o.remote_id) for o in result.orphans] == [
        (other.attempt_id, job_name(other.attempt_id))
    ]
    kube.cluster.delete("jobs", NS, job_name(asked.attempt_id), {"propagationPolicy": "Background"})
    recorded = Work(**{**asked.__dict__, "remote_id": job_name(asked.attempt_id)})
    gone = synced(k8s, [recorded], lambda r: phase_of(r, recorded) is Phase.FAILED)
    assert gone.states[0].message == "the Job vanished from Kubernetes"


def test_two_orrery_installations_on_one_cluster_never_touch_each_others_work(kube):
    a, b = onboard(kube, "k8s-a"), onboard(kube, "k8s-b")
    assert a.config["tag"] != b.config["tag"]
    w = work(a)
    dispatch(a, w)
    assert synced(b, [], lambda r: False, timeout=0.5).orphans == []  # b sees none of a's Jobs
    (refused,) = dispatch(b, Work(**{**w.__dict__, "shares": work(b).shares}))
    assert "not this attempt's" in refused.error  # same attempt name, another installation's Job
    assert synced(b, [w], lambda r: False, timeout=0.3).states == []
    assert phase_of(synced(a, [w], lambda r: phase_of(r, w) is not None), w) is Phase.QUEUED


def test_an_unreachable_cluster_is_an_adapter_error(kube, k8s):
    config = dict(k8s.config, url="https://127.0.0.1:9")
    Cluster.objects.filter(pk=k8s.pk).update(config=config)
    k8s.refresh_from_db()
    (sent,) = dispatch(k8s, work(k8s))
    assert sent.error and not sent.remote_id
    with pytest.raises(AdapterError):
        adapter.cancel(k8s, ["x"]) or adapter.sync(k8s, [])


# --- end to end -------------------------------------------------------------------------------


def test_one_job_api_places_work_on_kubernetes_next_to_other_kinds_and_the_heatmap_shows_its_nodes(
    kube, api, client, alice, operator, django_capture_on_commit_callbacks
):
    from clusters.choices import NodeState
    from clusters.models import Node
    from scheduling.dispatch.outbox import drain_outbox
    from scheduling.engine.cache import SchedulerCache
    from scheduling.engine.cycle import run_cycle
    from scheduling.models import JobAttempt
    from tests.factories import make_cluster, make_node, make_project, make_queue
    from tests.portal.api.conftest import job_spec

    ensure_catalog()
    lab = make_cluster("lab", kind="native", identity="shared")
    make_node(lab, gpus=8, model="h100", name="lab-1")
    make_queue(make_project("vision", members=(alice,)))
    body = {"name": "k8s", "kind": "kubernetes", "kubeconfig": kube.kubeconfig("adapter")}
    with django_capture_on_commit_callbacks(execute=True):
        assert api(operator).post("/api/v1/clusters", body, format="json").status_code == 201
    Node.objects.filter(cluster__name="k8s").update(state=NodeState.READY)  # as its heartbeats make it

    small = {"spec__resources__gpus": "h100:1", "spec__resources__cpus": 1, "spec__resources__memory": "1Gi"}
    on_k8s = api(alice).post(
        "/api/v1/jobs",
        job_spec(**small, spec__image="busybox:1.36", spec__placement={"clusters": ["k8s"]}),
        format="json",
    )
    bare = api(alice).post("/api/v1/jobs", job_spec(**small), format="json")
    assert on_k8s.status_code == bare.status_code == 201, (on_k8s.content, bare.content)
    assert bare.json()["spec"]["placement"]["clusters"] == ["lab"]  # a bare command never goes to Kubernetes
    assert run_cycle(SchedulerCache()).placed == 2
    drain_outbox()
    (job,) = kube.objects("jobs", NS)
    assert job["metadata"]["labels"]["orrery.io/job-id"] == str(on_k8s.json()["id"])
    attempt = JobAttempt.objects.get(job_id=on_k8s.json()["id"])
    assert attempt.cluster.name == "k8s" and attempt.remote_id == job["metadata"]["name"]
    assert JobAttempt.objects.get(job_id=bare.json()["id"]).cluster == lab

    client.force_login(alice)
    heatmap = client.get("/fleet/nodes.json").json()
    shown = {(c, n) for c, n in zip(heatmap["cluster"], heatmap["name"], strict=True)}
    assert {("k8s", "gpu-1"), ("k8s", "gpu-2"), ("lab", "lab-1")} <= shown


def test_a_disabled_or_deleted_cluster_is_no_longer_watched(kube, k8s):
    from clusters.adapters.kubernetes.informer import watched_clusters
    from clusters.services.inventory import take_inventories

    dispatch(k8s, work(k8s))
    adapter.sync(k8s, [])  # the Job and pod watches start too
    assert k8s.pk in watched_clusters()
    assert take_inventories(paced=False) == 1 and k8s.pk in watched_clusters()
    Cluster.objects.filter(pk=k8s.pk).update(state="disabled")
    assert take_inventories(paced=False) == 0
    assert k8s.pk not in watched_clusters()  # nodes, pods, Jobs: every watch of it stopped
