"""The stop of a preemption on Kubernetes (clusters/adapters/kubernetes/adapter.py ``signal``),
through the fake API server of tests/kubefake with the official client: the Job goes, and its
running pods are deleted with the job's grace period (their kubelet's SIGTERM, then SIGKILL when
it is over), not the pods' own 30 s."""

from __future__ import annotations

import pytest

from clusters.adapters.kubernetes.manifests import job_name
from tests.clusters.test_kube_adapter import NS, adapter, dispatch, k8s, kube, run_pod, work  # noqa: F401

pytestmark = pytest.mark.django_db


def test_a_preempted_job_is_deleted_with_its_grace_period(kube, k8s):  # noqa: F811
    w = work(k8s, nodes=2)
    dispatch(k8s, w)
    for index in (0, 1):
        run_pod(kube, w, "Running", index=index)
    assert adapter.signal(k8s, [job_name(w.attempt_id)], "TERM", 7) == 1
    assert kube.objects("jobs", NS) == [] and kube.objects("services", NS) == []
    pods = kube.objects("pods", NS)
    assert len(pods) == 2
    for pod in pods:
        assert pod["metadata"].get("deletionTimestamp")  # the kubelet now stops it…
        assert pod["metadata"]["deletionGracePeriodSeconds"] == 7  # …within the job's grace
    assert adapter.signal(k8s, [job_name(w.attempt_id)], "TERM", 7) == 1  # already gone: fine


def test_a_cancel_keeps_the_pods_own_grace_period(kube, k8s):  # noqa: F811
    w = work(k8s)
    dispatch(k8s, w)
    run_pod(kube, w, "Running")
    assert adapter.cancel(k8s, [job_name(w.attempt_id)]) == 1
    (pod,) = kube.objects("pods", NS)
    assert pod["metadata"]["deletionGracePeriodSeconds"] == 30
