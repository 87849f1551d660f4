"""Kubernetes Jobs and pods → Orrery's states (``clusters/adapters/kubernetes/states.py``), on
objects a real kube-apiserver returned (tests/kubefake/recordings/050–059), and on those
objects changed the way only the missing controllers would (a deadline, an image that cannot be
pulled, a node that went away)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from clusters.adapters.base import Phase
from clusters.adapters.kubernetes.adapter import group
from clusters.adapters.kubernetes.manifests import LABEL_ATTEMPT
from clusters.adapters.kubernetes.states import attempt_state

RECORDINGS = Path(__file__).resolve().parents[1] / "kubefake" / "recordings"


def bodies(number: str) -> list[dict[str, Any]]:
    """The response bodies of one recording, in order."""
    (path,) = RECORDINGS.glob(f"{number}-*.json")
    doc = json.loads(path.read_text())
    return [e["response"].get("body") for e in doc.get("exchanges") or [doc]]


def objects(number: str, kind: str) -> list[dict[str, Any]]:
    """Copies of the objects of ``kind`` a recording's responses carry, in order."""
    return [copy.deepcopy(b) for b in bodies(number) if isinstance(b, dict) and b.get("kind") == kind]


def last(number: str, kind: str) -> dict[str, Any]:
    return objects(number, kind)[-1]


def job_with(conditions: list[tuple[str, str]], base: dict[str, Any] | None = None) -> dict[str, Any]:
    job = copy.deepcopy(base or last("041", "Job"))
    job["status"] = {"conditions": [{"type": t, "status": "True", "reason": r} for t, r in conditions]}
    return job


def test_a_pod_the_kubelet_is_starting_is_starting_then_running_then_failed_with_its_code():
    job = last("041", "Job")
    pods = objects("052", "Pod")
    seen = [attempt_state("a1", job, [pod]) for pod in pods[:3]]
    assert [s.phase for s in seen] == [Phase.STARTING, Phase.RUNNING, Phase.FAILED]
    assert seen[1].started_at and "dgx-h100-001" in seen[1].message
    assert seen[2].exit_code == 3 and "Error (exit code 3)" in seen[2].message


def test_a_job_failed_by_its_controller_fails_with_the_pods_exit_code():
    job = objects("053", "Job")[-1]
    assert any(c["type"] == "Failed" for c in job["status"]["conditions"])
    pod = last("052", "Pod")
    state = attempt_state("a1", job, [pod])
    assert (state.phase, state.exit_code) == (Phase.FAILED, 3)


def test_a_complete_job_succeeds():
    job = objects("056", "Job")[-1]
    assert any(c["type"] == "Complete" for c in job["status"]["conditions"])
    state = attempt_state("a1", job, [last("055", "Pod")])
    assert (state.phase, state.exit_code) == (Phase.SUCCEEDED, 0)


def test_success_criteria_met_is_success_before_complete():
    job = job_with([("SuccessCriteriaMet", "CompletionsReached")])
    assert attempt_state("a1", job, []).phase is Phase.SUCCEEDED


def test_an_oomkilled_gang_member_is_the_cause_not_the_one_stopped_after_it():
    job = objects("058", "Job")[-1]
    pods = {b["metadata"]["name"]: b for b in objects("058", "Pod")}
    state = attempt_state("a1", job, list(pods.values())[::-1])
    assert (state.phase, state.exit_code) == (Phase.FAILED, 137)
    assert "OOMKilled" in state.message


def test_the_deadline_is_a_timeout():
    job = job_with([("FailureTarget", "DeadlineExceeded"), ("Failed", "DeadlineExceeded")])
    state = attempt_state("a1", job, [last("052", "Pod")])
    assert state.phase is Phase.TIMEOUT and "time limit" in state.message


@pytest.mark.parametrize("reason", ["ErrImagePull", "ImagePullBackOff", "InvalidImageName"])
def test_an_image_that_cannot_be_pulled_fails_the_attempt_with_the_reason(reason):
    pod = objects("052", "Pod")[0]
    waiting = {"reason": reason, "message": 'failed to pull image "nvcr.io/nope:1"'}
    pod["status"]["containerStatuses"][0]["state"] = {"waiting": waiting}
    state = attempt_state("a1", last("041", "Job"), [pod])
    assert state.phase is Phase.FAILED and reason in state.message and "nvcr.io/nope:1" in state.message


def test_an_unscheduled_pod_is_queued_with_the_schedulers_reason():
    pod = objects("057", "Pod")[0]
    assert not pod["spec"].get("nodeName")
    pod["status"]["conditions"] = [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/4 nodes are available",
        }
    ]
    state = attempt_state("a1", last("045", "Job"), [pod])
    assert state.phase is Phase.QUEUED and "0/4 nodes are available" in state.message
    assert attempt_state("a1", last("045", "Job"), []).phase is Phase.QUEUED  # no pod yet


@pytest.mark.parametrize("reason", ["DeletionByPodGC", "DeletionByTaintManager", "TerminationByKubelet"])
def test_a_pod_lost_with_its_node_waits_for_node_loss_handling_instead_of_failing(reason):
    running = objects("052", "Pod")[1]
    gc = copy.deepcopy(running)
    gc["status"]["phase"] = "Failed"
    gc["status"]["conditions"].append({"type": "DisruptionTarget", "status": "True", "reason": reason})
    failed_job = job_with([("FailureTarget", "BackoffLimitExceeded"), ("Failed", "BackoffLimitExceeded")])
    for job, pod, gone in ((failed_job, gc, ()), (last("041", "Job"), running, ("dgx-h100-001",))):
        state = attempt_state("a1", job, [pod], gone_nodes=gone)
        assert state.phase is Phase.RUNNING and "left the Kubernetes cluster" in state.message


def test_a_job_failed_after_its_node_left_waits_for_node_loss_handling_even_with_its_pod_gone():
    failed = job_with([("FailureTarget", "BackoffLimitExceeded"), ("Failed", "BackoffLimitExceeded")])
    state = attempt_state("a1", failed, [], nodes=("dgx-h100-001",), gone_nodes=("dgx-h100-001",))
    assert state.phase is Phase.RUNNING and "dgx-h100-001 left" in state.message
    assert (
        attempt_state("a1", failed, [], nodes=("dgx-h100-001",), gone_nodes=("other",)).phase is Phase.FAILED
    )
    done = job_with([("SuccessCriteriaMet", "CompletionsReached"), ("Complete", "CompletionsReached")])
    gone = attempt_state("a1", done, [], nodes=("dgx-h100-001",), gone_nodes=("dgx-h100-001",))
    assert gone.phase is Phase.SUCCEEDED  # what finished before the node left stays finished


def test_a_job_gone_fails_once_recorded_and_says_nothing_before():
    assert attempt_state("a1", None, [], remote_id="orrery-a1").phase is Phase.FAILED
    assert attempt_state("a1", None, []) is None


def test_the_recorded_watches_replayed_give_each_attempt_its_states_in_order():
    """059: the pod and Job watches across 041–073, merged in resourceVersion order, as the
    adapter's informers would hold them. (The recording names the attempt label
    ``orrery.io/attempt``; it is read here under the adapter's name for it.)"""
    (path,) = RECORDINGS.glob("059-*.json")
    events = [
        (int(ev["object"]["metadata"]["resourceVersion"]), i, ev)
        for i, exchange in enumerate(json.loads(path.read_text())["exchanges"])
        for ev in exchange["response"]["events"]
        if ev["type"] != "BOOKMARK"
    ]
    stores: dict[str, dict[str, Any]] = {"Job": {}, "Pod": {}}
    phases: dict[str, list[Phase]] = {}
    for _, _, ev in sorted(events, key=lambda e: (e[0], e[1])):
        obj = ev["object"]
        labels = obj["metadata"].get("labels") or {}
        if "orrery.io/attempt" in labels:
            labels[LABEL_ATTEMPT] = labels.pop("orrery.io/attempt")
        store = stores[obj["kind"]]
        if ev["type"] == "DELETED":
            store.pop(obj["metadata"]["name"], None)
        else:
            store[obj["metadata"]["name"]] = obj
        jobs, pods = group(stores["Job"].values(), stores["Pod"].values())
        for attempt, job in jobs.items():
            state = attempt_state(attempt, job, pods.get(attempt, []))
            if not phases.get(attempt) or phases[attempt][-1] is not state.phase:
                phases.setdefault(attempt, []).append(state.phase)
    first_end = {a: next(p for p in seen if p.ended) for a, seen in phases.items()}
    assert first_end == {"a-4f2c9e": Phase.FAILED, "a-5c81e0": Phase.SUCCEEDED, "a-9e5a11": Phase.FAILED}
    assert phases["a-4f2c9e"][:4] == [Phase.QUEUED, Phase.STARTING, Phase.RUNNING, Phase.FAILED]
    assert Phase.RUNNING in phases["a-9e5a11"] and phases["a-9e5a11"][-1] is Phase.FAILED
    # The probe pods carry the attempt's label but are no Job's: they never count.
    assert all(not name.startswith("orrery-delete-probe") for name in pods.get("a-4f2c9e", []))
