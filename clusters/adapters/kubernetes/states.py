"""What Kubernetes says about an attempt, in Orrery's neutral terms (pure: tested on recorded
Job and Pod objects, as the API serves them).

========================================================  ==========  ============================
Kubernetes                                                 phase       shown
========================================================  ==========  ============================
no pod yet; pod Pending, not scheduled                     queued      the scheduler's reason
pod Pending on its node (pulling, creating)                starting
pod Running                                                running     its node
Job ``Complete`` / ``SuccessCriteriaMet``; every pod       succeeded   exit code 0
Succeeded
Job ``Failed``/``FailureTarget`` with ``DeadlineExceeded``  timeout     activeDeadlineSeconds
Job ``Failed``; a pod Failed                               failed      exit code, reason
                                                                       (``OOMKilled``, ``Error``)
a container waiting on ``ErrImagePull``,                   failed      the reason and message
``ImagePullBackOff``, ``InvalidImageName``,
``CreateContainerConfigError``, ``CreateContainerError``
a pod lost with its node (deleted by pod GC, or its        running     "node X left the cluster";
node gone from the cluster)                                            node loss handling decides
the attempt's Job gone                                     failed      "the Job vanished"
========================================================  ==========  ============================

A pod lost with its node is not reported as a failure: the node's loss reaches Orrery through
inventory (the node stops reporting), and the failover policy then requeues the attempt, as on
every other kind, without counting it as the job's own failure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from clusters.adapters.base import Phase, RemoteState

#: Container waiting reasons that never resolve by themselves: the attempt fails at once.
STUCK = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
#: Why a pod was removed with its node (a ``DisruptionTarget`` condition's reason).
# DisruptionTarget reasons that mean the node went away under the pod: the pod garbage
# collector, the kubelet's shutdown, and the taint manager evicting from a node that stopped
# answering (300 s after NotReady by default). Orrery's failover, not the job's exit, decides.
NODE_LOSS = frozenset({"DeletionByPodGC", "TerminationByKubelet", "DeletionByTaintManager"})


def attempt_state(
    attempt_id: str,
    job: dict[str, Any] | None,
    pods: Sequence[dict[str, Any]],
    *,
    remote_id: str = "",
    nodes: Iterable[str] = (),
    gone_nodes: Iterable[str] = (),
) -> RemoteState | None:
    """The state of one attempt from its Job and its pods. None when nothing is known yet (no
    Job seen and none recorded: a delivery may be on its way). ``nodes`` are the attempt's
    nodes, ``gone_nodes`` those the cluster no longer has: a Job that did not succeed with one
    of its nodes gone waits for node loss handling (its pods may be gone already)."""
    gone = frozenset(gone_nodes)
    if job is None:
        if remote_id:
            return RemoteState(
                attempt_id, Phase.FAILED, remote_id, message="the Job vanished from Kubernetes"
            )
        return None
    remote_id = remote_id or str(_get(job, "metadata", "name") or "")
    conditions = {
        c.get("type"): c for c in _get(job, "status", "conditions") or [] if c.get("status") == "True"
    }
    succeeded = "Complete" in conditions or "SuccessCriteriaMet" in conditions
    lost = [str(_get(p, "spec", "nodeName") or "?") for p in pods if _lost_with_node(p, gone)]
    lost += sorted(gone.intersection(nodes))
    if lost and not succeeded:
        node = lost[0]
        return RemoteState(
            attempt_id,
            Phase.RUNNING,
            remote_id,
            message=f"its node {node} left the Kubernetes cluster; waiting for node loss handling",
        )
    for kind in ("Failed", "FailureTarget"):
        if kind in conditions:
            return _failed(attempt_id, remote_id, conditions[kind], pods)
    if succeeded:
        return RemoteState(
            attempt_id, Phase.SUCCEEDED, remote_id, exit_code=0, message="completed in Kubernetes"
        )
    for pod in pods:
        stuck = _stuck(pod)
        if stuck:
            return RemoteState(attempt_id, Phase.FAILED, remote_id, message=stuck[:1000])
    failed = [p for p in pods if _get(p, "status", "phase") == "Failed"]
    if failed:
        return _failed(attempt_id, remote_id, None, failed)
    live = [p for p in pods if not _get(p, "metadata", "deletionTimestamp")]
    wanted = int(_get(job, "spec", "completions") or 1)
    if live and len(live) >= wanted and all(_get(p, "status", "phase") == "Succeeded" for p in live):
        return RemoteState(
            attempt_id, Phase.SUCCEEDED, remote_id, exit_code=0, message="completed in Kubernetes"
        )
    running = [p for p in live if _get(p, "status", "phase") == "Running"]
    if running:
        nodes = ", ".join(sorted({str(_get(p, "spec", "nodeName") or "?") for p in running}))
        return RemoteState(
            attempt_id, Phase.RUNNING, remote_id, message=f"running on {nodes}", started_at=_started(running)
        )
    scheduled = [p for p in live if _get(p, "spec", "nodeName")]
    if scheduled:
        return RemoteState(attempt_id, Phase.STARTING, remote_id, message=_waiting(scheduled) or "starting")
    return RemoteState(attempt_id, Phase.QUEUED, remote_id, message=_unscheduled(live))


def exit_of(pod: dict[str, Any]) -> tuple[int | None, str]:
    """The main container's exit code and reason, once it terminated."""
    for status in _get(pod, "status", "containerStatuses") or []:
        terminated = (status.get("state") or {}).get("terminated")
        if terminated:
            return terminated.get("exitCode"), str(terminated.get("reason") or "")
    return None, ""


def _failed(
    attempt_id: str, remote_id: str, condition: dict[str, Any] | None, pods: Sequence[dict[str, Any]]
) -> RemoteState:
    reason = str((condition or {}).get("reason") or "")
    if reason == "DeadlineExceeded":
        return RemoteState(
            attempt_id,
            Phase.TIMEOUT,
            remote_id,
            message="ran past its time limit (activeDeadlineSeconds) in Kubernetes",
        )
    # The pod that failed first is the cause; the others were stopped because of it (143).
    failed = sorted(
        (p for p in pods if _get(p, "status", "phase") == "Failed"),
        key=lambda p: (exit_of(p)[0] == 143, _finished(p)),
    )
    if failed:
        code, why = exit_of(failed[0])
        node = _get(failed[0], "spec", "nodeName") or "?"
        why = why or str(_get(failed[0], "status", "reason") or "") or "failed"
        text = f"failed in Kubernetes on {node}: {why}" + (f" (exit code {code})" if code is not None else "")
        return RemoteState(attempt_id, Phase.FAILED, remote_id, exit_code=code, message=text)
    message = str((condition or {}).get("message") or reason or "the Job failed")
    return RemoteState(attempt_id, Phase.FAILED, remote_id, message=f"failed in Kubernetes: {message}"[:1000])


def _stuck(pod: dict[str, Any]) -> str:
    for status in _get(pod, "status", "containerStatuses") or []:
        waiting = (status.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK:
            text = str(waiting.get("message") or "")
            return f"{waiting['reason']}: {text}" if text else str(waiting["reason"])
    return ""


def _waiting(pods: Sequence[dict[str, Any]]) -> str:
    for pod in pods:
        for status in _get(pod, "status", "containerStatuses") or []:
            waiting = (status.get("state") or {}).get("waiting") or {}
            if waiting.get("reason"):
                return f"starting on {_get(pod, 'spec', 'nodeName')}: {waiting['reason']}"
    return ""


def _unscheduled(pods: Sequence[dict[str, Any]]) -> str:
    for pod in pods:
        for condition in _get(pod, "status", "conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                return f"waiting in Kubernetes: {condition.get('message') or condition.get('reason')}"[:512]
    return "waiting in Kubernetes for its pods" if not pods else "waiting in Kubernetes to be scheduled"


def _lost_with_node(pod: dict[str, Any], gone: frozenset[str]) -> bool:
    if _get(pod, "status", "phase") == "Succeeded":
        return False
    if _get(pod, "spec", "nodeName") in gone:
        return True
    return any(
        c.get("type") == "DisruptionTarget" and c.get("status") == "True" and c.get("reason") in NODE_LOSS
        for c in _get(pod, "status", "conditions") or []
    )


def _started(pods: Sequence[dict[str, Any]]) -> float | None:
    times = []
    for pod in pods:
        for status in _get(pod, "status", "containerStatuses") or []:
            at = ((status.get("state") or {}).get("running") or {}).get("startedAt")
            if at:
                times.append(_epoch(at))
    return min(times) if times else None


def _finished(pod: dict[str, Any]) -> float:
    for status in _get(pod, "status", "containerStatuses") or []:
        at = ((status.get("state") or {}).get("terminated") or {}).get("finishedAt")
        if at:
            return _epoch(at)
    return float("inf")


def _epoch(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _get(obj: dict[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)  # type: ignore[assignment]
    return obj
