"""The native agents' side of the protocol: what a node's agent is told to run, and what its
reports mean. The agent API (``clusters/api/agent.py``) reaches both through the ports the
scheduling app registers at start-up (``clusters.ports``).

* ``desired_for_node(node_id)`` — the attempts the node should be running now, with everything
  the agent needs to start them. Cached per node and dropped whenever an attempt on the node
  changes, so a heartbeat costs one cache read.
* ``apply_reports(node_id, reports, logs)`` — state changes and log chunks from the agent.
  Fencing: a report counts only for the attempt that is still active *and* holds this node; a
  report about anything else (an attempt requeued elsewhere while the node was cut off) is
  ignored, and the agent stops that process because it is not desired.
"""

from __future__ import annotations

from typing import Any

from django.core.cache import cache

from clusters.adapters.base import LogChunk, Phase, RemoteState
from clusters.models import Node
from scheduling.choices import JobState
from scheduling.dispatch.desired import TTL_S, desired_key
from scheduling.dispatch.remote import apply_remote_states
from scheduling.dispatch.works import shell_command
from scheduling.models import Allocation, JobAttempt
from scheduling.services.logs import store_log

RUNNING_ON_NODE = (JobState.SCHEDULED, JobState.STARTING, JobState.RUNNING, JobState.COMPLETING)


def desired_for_node(node_id: int) -> list[dict[str, Any]]:
    cached = cache.get(desired_key(node_id))
    if cached is not None:
        return cached
    desired = []
    rows = (
        Allocation.objects.filter(node_id=node_id, active=True, attempt__active=True)
        .select_related("attempt__job", "gpu")
        .order_by("attempt_id", "gpu__index")
    )
    by_attempt: dict[Any, list[Allocation]] = {}
    for row in rows:
        by_attempt.setdefault(row.attempt_id, []).append(row)
    for attempt_id, allocations in by_attempt.items():
        attempt = allocations[0].attempt
        job = attempt.job
        if job.state not in RUNNING_ON_NODE:
            continue
        nodes = _gang_nodes(attempt_id)
        head = nodes[0] if nodes else node_id
        spec = job.spec or {}
        desired.append(
            {
                "attempt": str(attempt_id),
                "job": job.pk,
                "number": attempt.number,
                "epoch": attempt.epoch,
                "script": shell_command(job.command, spec.get("setup") or "", spec.get("workdir") or ""),
                "env": spec.get("env") or {},
                "gpus": [a.gpu.index for a in allocations if a.gpu_id],
                "time_limit_s": job.time_limit_s,
                "nnodes": len(nodes),
                "node_rank": nodes.index(node_id) if node_id in nodes else 0,
                "head_addr": _address(head),
            }
        )
    cache.set(desired_key(node_id), desired, TTL_S)
    return desired


def _address(node_id: int) -> str:
    name, labels = Node.objects.filter(pk=node_id).values_list("name", "labels").first() or ("", {})
    return (labels or {}).get("orrery.io/address") or name


def _gang_nodes(attempt_id: Any) -> list[int]:
    return sorted(
        set(
            Allocation.objects.filter(attempt_id=attempt_id, gpu__isnull=True).values_list(
                "node_id", flat=True
            )
        )
    )


def apply_reports(node_id: int, reports: list[dict[str, Any]], logs: list[dict[str, Any]]) -> dict[str, int]:
    """Apply what an agent says about its attempts; returns counts of applied and ignored."""
    applied = ignored = 0
    for report in reports:
        attempt = (
            JobAttempt.objects.filter(pk=report["attempt"], active=True).values_list("pk", flat=True).first()
        )
        if (
            attempt is None
            or not Allocation.objects.filter(attempt=attempt, node_id=node_id, active=True).exists()
        ):
            ignored += 1  # fenced: not the attempt (or node) the server considers current
            continue
        if apply_remote_states([_remote_state(node_id, attempt, report)]):
            applied += 1
        else:
            ignored += 1  # already there, or overtaken (a cancel): nothing to do
    if logs:
        node = Node.objects.filter(pk=node_id).values_list("name", flat=True).first() or str(node_id)
        for chunk in logs:
            store_log(LogChunk(str(chunk["attempt"]), node, int(chunk["offset"]), str(chunk["data"])))
    return {"applied": applied, "ignored": ignored}


def _remote_state(node_id: int, attempt_id: Any, report: dict[str, Any]) -> RemoteState:
    phase = Phase(report["state"])
    code = report.get("exit_code")
    if phase.ended:
        message = report.get("reason") or (f"exit code {code}" if code is not None else phase.value)
    else:
        message = f"{phase.value} on node {node_id}"
    # In a gang only the head's success ends the job (a member reports its rank).
    return RemoteState(
        str(attempt_id), phase, exit_code=code, message=message, head=report.get("node_rank", 0) == 0
    )
