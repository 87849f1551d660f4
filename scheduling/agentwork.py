"""What node agents are told to run, and what they report back (the native cluster kind).

The clusters app owns the agent protocol but not jobs; it reaches these two functions through
the settings ``ORRERY_AGENT_DESIRED`` and ``ORRERY_AGENT_REPORTS``.

* ``desired_for_node(node_id)`` — the attempts the node should be running now, with everything
  the agent needs to start them. Cached per node and dropped whenever an attempt on the node
  changes, so a heartbeat costs one cache read.
* ``apply_reports(node_id, reports, logs)`` — state changes and log chunks from the agent.
  Fencing: a report counts only for the attempt that is still active *and* holds this node; a
  report about anything else (an attempt requeued elsewhere while the node was cut off) is
  ignored, and the agent stops that process because it is not desired.
"""

from __future__ import annotations

import logging
import shlex
from typing import Any

from django.core.cache import cache
from django.db import transaction

from clusters.choices import ClusterKind, NodeState
from clusters.models import Node
from scheduling.choices import ACTIVE_STATES, FailoverPolicy, JobState, PendingReason
from scheduling.desired import TTL_S, desired_key, forget_desired
from scheduling.models import Allocation, DispatchOutbox, JobAttempt, JobLog
from scheduling.services.transitions import InvalidTransition, TransitionConflict, transition_job

log = logging.getLogger(__name__)
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


_EXIT = {
    "succeeded": JobState.SUCCEEDED,
    "failed": JobState.FAILED,
    "timeout": JobState.TIMEOUT,
    "cancelled": JobState.CANCELLED,
}


def apply_reports(node_id: int, reports: list[dict[str, Any]], logs: list[dict[str, Any]]) -> dict[str, int]:
    """Apply what an agent says about its attempts; returns counts of applied and ignored."""
    applied = ignored = 0
    for report in reports:
        attempt = JobAttempt.objects.filter(pk=report["attempt"], active=True).select_related("job").first()
        if (
            attempt is None
            or not Allocation.objects.filter(attempt=attempt, node_id=node_id, active=True).exists()
        ):
            ignored += 1  # fenced: not the attempt (or node) the server considers current
            continue
        try:
            _apply(attempt, node_id, report)
            applied += 1
        except (InvalidTransition, TransitionConflict):
            ignored += 1  # already there, or overtaken (a cancel): nothing to do
    for chunk in logs:
        store_log(node_id, chunk)
    return {"applied": applied, "ignored": ignored}


def _apply(attempt: JobAttempt, node_id: int, report: dict[str, Any]) -> None:
    state, job = report["state"], attempt.job
    if state == "starting":
        transition_job(
            job.pk, JobState.STARTING, only_from=[JobState.SCHEDULED], message=f"starting on node {node_id}"
        )
    elif state == "running":
        if job.state == JobState.RUNNING:
            return
        transition_job(
            job.pk,
            JobState.RUNNING,
            only_from=[JobState.SCHEDULED, JobState.STARTING],
            message=f"running on node {node_id}",
        )
    elif state in _EXIT:
        code = report.get("exit_code")
        outcome = _EXIT[state]
        if (
            outcome == JobState.SUCCEEDED
            and len(_gang_nodes(attempt.pk)) > 1
            and report.get("node_rank", 0) != 0
        ):
            return  # in a gang, the head's exit decides success; any failure decides at once
        why = report.get("reason") or (f"exit code {code}" if code is not None else state)
        transition_job(job.pk, outcome, only_from=ACTIVE_STATES, exit_code=code, message=why)
    else:
        raise InvalidTransition(job.pk, job.state, state)


def store_log(node_id: int, chunk: dict[str, Any]) -> None:
    """Append a chunk of output, in bytes: ``offset`` is where the chunk starts in the stream,
    so a chunk sent again (the agent missed our answer) is recognised and only its new bytes
    are kept."""
    attempt = JobAttempt.objects.filter(pk=chunk["attempt"]).values_list("pk", "job_id").first()
    if attempt is None:
        return
    node = Node.objects.filter(pk=node_id).values_list("name", flat=True).first() or str(node_id)
    offset, data = int(chunk["offset"]), str(chunk["data"]).encode()
    with transaction.atomic():
        row, _ = JobLog.objects.select_for_update().get_or_create(
            attempt_id=attempt[0], node=node, defaults={"job_id": attempt[1]}
        )
        if offset + len(data) <= row.end:
            return  # already have it (a replay)
        if offset > row.end:
            data = f"[… {offset - row.end} bytes not received …]\n".encode() + data
        else:
            data = data[row.end - offset :]
        text = row.text.encode() + data
        if len(text) > JobLog.MAX_BYTES:
            cut = len(text) - JobLog.MAX_BYTES
            text, row.start = text[cut:], row.start + cut
        row.text = text.decode("utf-8", "replace")
        row.end = max(row.end, offset + len(str(chunk["data"]).encode()))
        row.save()


def log_tail(job_id: int, lines: int) -> tuple[list[str], bool]:
    """The last ``lines`` lines of the job's latest attempt (all its nodes, head first)."""
    attempt = (
        JobAttempt.objects.filter(job_id=job_id).order_by("-number").values_list("pk", flat=True).first()
    )
    if attempt is None:
        return [], False
    chunks = JobLog.objects.filter(attempt_id=attempt).order_by("node")
    out: list[str] = []
    truncated = False
    for chunk in chunks:
        truncated |= chunk.start > 0
        prefix = f"[{chunk.node}] " if chunks.count() > 1 else ""
        out += [prefix + line for line in chunk.text.splitlines()]
    return out[-lines:], truncated or len(out) > lines


def shell_command(command: str, setup: str, workdir: str) -> str:
    """The script an agent runs for an attempt: into the work dir, the setup, then the command."""
    parts = [f"cd {shlex.quote(workdir)}"] if workdir else []
    return " && ".join([*parts, *([setup] if setup else []), command])


def handle_node_lost(node_ids: list[int]) -> int:
    """The failover policy of every job still holding a node that is now ``down``: ``requeue``
    (a new attempt elsewhere), ``hold`` (wait for an operator) or ``fail``. Idempotent, and run
    both when the lifecycle takes nodes down and as a periodic sweep, so a job whose failover
    lost a race or an error is decided again. Returns how many jobs it moved."""
    attempts = JobAttempt.objects.filter(
        active=True, allocations__node_id__in=node_ids, allocations__active=True
    )
    moved = 0
    for job_id, policy in attempts.values_list("job_id", "job__failover_policy").distinct():
        message = "its node was lost"
        for _ in range(3):  # a conflict means the job moved meanwhile: decide again
            try:
                if policy == FailoverPolicy.REQUEUE:
                    transition_job(
                        job_id,
                        JobState.PENDING,
                        reason=PendingReason.NODE_LOST,
                        message=message,
                        only_from=ACTIVE_STATES,
                    )
                elif policy == FailoverPolicy.HOLD:
                    transition_job(
                        job_id,
                        JobState.HELD,
                        reason=PendingReason.NODE_LOST,
                        message=message + "; release or cancel it",
                        only_from=ACTIVE_STATES,
                    )
                else:
                    transition_job(job_id, JobState.FAILED, message=message, only_from=ACTIVE_STATES)
                moved += 1
                break
            except TransitionConflict:
                continue
            except InvalidTransition:
                break  # no longer active: nothing to do
            except Exception:
                log.exception("failover of job %s failed; the next sweep tries again", job_id)
                break
    forget_desired(node_ids)
    return moved


def sweep_lost_nodes() -> int:
    """Failover for jobs still holding a ``down`` node (the periodic safety net)."""
    down = list(Node.objects.filter(state=NodeState.DOWN).values_list("pk", flat=True))
    return handle_node_lost(down) if down else 0


def dispatch_outbox(limit: int = 5000) -> int:
    """Deliver pending ``start`` outbox rows of native clusters: their agents pull work with
    each heartbeat, so delivering is making the node's desired list fresh and marking the row
    sent. Idempotent: a row delivered twice changes nothing. Runs as a periodic sweep (and so
    re-drives anything a lost wake-up left behind); simulated clusters deliver their own rows,
    other kinds their dispatchers."""
    rows = list(
        DispatchOutbox.objects.filter(state=DispatchOutbox.State.PENDING, cluster__kind=ClusterKind.NATIVE)
        .order_by("id")
        .values_list("pk", "attempt_id")[:limit]
    )
    if not rows:
        return 0
    nodes = sorted(
        set(
            Allocation.objects.filter(attempt_id__in=[a for _, a in rows], gpu__isnull=True).values_list(
                "node_id", flat=True
            )
        )
    )
    DispatchOutbox.objects.filter(pk__in=[pk for pk, _ in rows], state=DispatchOutbox.State.PENDING).update(
        state=DispatchOutbox.State.SENT
    )
    forget_desired(nodes)
    return len(rows)
