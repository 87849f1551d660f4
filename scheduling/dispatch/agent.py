"""The native agents' side of the protocol: what a node's agent is told to run, and what its
reports mean. The agent API (``clusters/api/agent.py``) reaches both through the ports the
scheduling app registers at start-up (``clusters.ports``).

* ``desired_for_node(node_id)`` — the attempts the node should be running now, with everything
  the agent needs to start them (on MIG instances: their profile and UUIDs; on a shared GPU:
  its memory and share). Cached per node and dropped whenever an attempt on the node
  changes, so a heartbeat costs one cache read. An attempt of a preempted job stays listed,
  with ``stop: {signal, grace_s}``: the agent sends that signal to all its processes and kills
  them ``grace_s`` seconds later (one not started yet is never started), and reports it
  ``preempted``, which requeues the job.
* ``apply_reports(node_id, reports, logs)`` — state changes and log chunks from the agent.
  Fencing: a report counts only for the attempt that is still active *and* holds this node; a
  report about anything else (an attempt requeued elsewhere while the node was cut off) is
  ignored, and the agent stops that process because it is not desired.
"""

from __future__ import annotations

from typing import Any

from django.core.cache import cache

from clusters.adapters.base import LogChunk, Phase, RemoteState, Share
from clusters.adapters.launch import launch_env
from clusters.models import Node
from foundation.sealing import seal, unseal
from scheduling.choices import ACTIVE_STATES
from scheduling.dispatch.desired import TTL_S, desired_key
from scheduling.dispatch.ports import assign_master_ports
from scheduling.dispatch.remote import apply_remote_states
from scheduling.dispatch.works import load_works
from scheduling.models import Allocation, JobAttempt
from scheduling.services.logs import store_log

MAX_LOG_GAP = 64 << 20  # a chunk may skip at most this much output (an agent's lost spool)


def desired_for_node(node_id: int) -> list[dict[str, Any]]:
    cached = cache.get(desired_key(node_id))
    if cached is None:
        cached = _desired(node_id)
        cache.set(desired_key(node_id), cached, TTL_S)
    return [_opened(entry) for entry in cached]


def _opened(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry as the agent gets it: secret values unsealed into ``env`` (the cache, Redis in
    production, holds them sealed)."""
    sealed = entry.get("sealed_env")
    if not sealed:
        return {k: v for k, v in entry.items() if k != "sealed_env"}
    return {k: v for k, v in entry.items() if k != "sealed_env"} | {"env": entry["env"] | unseal(sealed)}


def _desired(node_id: int) -> list[dict[str, Any]]:
    works = load_works(
        JobAttempt.objects.filter(
            active=True,
            job__state__in=ACTIVE_STATES,
            pk__in=Allocation.objects.filter(node_id=node_id, active=True).values("attempt_id"),
        )
    )
    heads = dict(
        Node.objects.filter(pk__in={w.shares[0].node_id for w in works if w.shares}).values_list(
            "pk", "labels"
        )
    )
    # An agent may read an attempt before the drain has acknowledged its start: it is dispatched
    # now, with its gang's port (the same the drain keeps, and every other node of it gets).
    ports = assign_master_ports(w.attempt_id for w in works if w.master_port is None)
    desired = []
    for work in works:
        ranks = [s.node_id for s in work.shares]
        if node_id not in ranks:
            continue
        head = work.shares[0]
        head_addr = (heads.get(head.node_id) or {}).get("orrery.io/address") or head.node
        rank = ranks.index(node_id)
        share = work.shares[rank]
        desired.append(
            {
                "attempt": work.attempt_id,
                "job": work.job_id,
                "number": work.number,
                "epoch": work.epoch,
                "script": work.script,
                "env": {k: v for k, v in work.env.items() if k not in work.secret_names},
                "sealed_env": seal({k: work.env[k] for k in work.secret_names}) if work.secret_names else "",
                # the POSIX account to run as: a name, "" for the cluster's shared account,
                # None when the job's owner has none here (the agent refuses to start it)
                "user": work.run_as,
                "image": work.image,
                "cpu_millicores": work.cpu_millicores,
                "memory_bytes": work.memory_bytes,
                "gpus": list(share.gpu_indices),
                "time_limit_s": work.time_limit_s,
                "nnodes": len(ranks),
                "node_rank": rank,
                "head_addr": head_addr,
                # the launch environment of this node (clusters/adapters/launch.py): the agent
                # sets it after the job's own env, which cannot override it
                "launch": launch_env(
                    nnodes=len(ranks),
                    gpus_per_node=work.gpus_per_node,
                    master_port=work.master_port or ports.get(work.attempt_id),
                    node_rank=rank,
                    head_addr=head_addr,
                ),
            }
            | _fraction(share)
            | ({"stop": {"signal": work.stop.signal, "grace_s": work.stop.grace_s}} if work.stop else {})
        )
    return desired


def _fraction(share: Share) -> dict[str, Any]:
    """What a share smaller than whole GPUs adds to a desired entry: the MIG instances' profile
    and UUIDs (``gpus`` then lists their parent GPUs, one entry each), or the memory and share of
    the shared GPU ``gpus[0]``; nothing for whole GPUs."""
    if share.mig_uuids:
        return {"mig_profile": share.mig_profile, "mig_uuids": list(share.mig_uuids)}
    if share.gpu_memory_mb:
        return {"gpu_memory_mb": share.gpu_memory_mb, "gpu_share": share.gpu_share}
    return {}


def apply_reports(node_id: int, reports: list[dict[str, Any]], logs: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply what an agent says about its attempts (items already well-formed); returns counts
    of applied and ignored reports, and the log chunks refused (``refused_logs``: position and
    why): output is kept only for attempts placed on this node, and a chunk may not start more
    than ``MAX_LOG_GAP`` bytes past what is stored (an absurd offset would freeze the log)."""
    applied = ignored = 0
    node = Node.objects.filter(pk=node_id).values_list("name", flat=True).first() or str(node_id)
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
        if apply_remote_states([_remote_state(node_id, node, attempt, report)]):
            applied += 1
        else:
            ignored += 1  # already there, or overtaken (a cancel): nothing to do
    refused: list[tuple[int, str]] = []
    if logs:
        # Output may arrive after its attempt ended: what counts is that it ran on this node.
        ours = {
            str(a)
            for a in Allocation.objects.filter(
                node_id=node_id, attempt_id__in={c["attempt"] for c in logs}
            ).values_list("attempt_id", flat=True)
        }
        for k, chunk in enumerate(logs):
            attempt_id = str(chunk["attempt"]).lower()
            if attempt_id not in ours:
                refused.append((k, "not an attempt placed on this node"))
            elif not store_log(
                LogChunk(attempt_id, node, int(chunk["offset"]), str(chunk["data"])), max_gap=MAX_LOG_GAP
            ):
                refused.append((k, f"starts more than {MAX_LOG_GAP} bytes past the output stored"))
    return {"applied": applied, "ignored": ignored, "refused_logs": refused}


def _remote_state(node_id: int, node: str, attempt_id: Any, report: dict[str, Any]) -> RemoteState:
    phase = Phase(report["state"])
    code = report.get("exit_code")
    if phase.ended:
        message = report.get("reason") or (f"exit code {code}" if code is not None else phase.value)
    else:
        message = f"{phase.value} on {node}"
    # In a gang only the head's success ends the job (any failure ends it at once). The server
    # knows which node is the head (the lowest node id, rank 0): a report does not say so.
    head = phase is not Phase.SUCCEEDED or node_id == _head_node(attempt_id)
    return RemoteState(str(attempt_id), phase, exit_code=code, message=message, head=head)


def _head_node(attempt_id: Any) -> int | None:
    return (
        Allocation.objects.filter(attempt_id=attempt_id, gpu__isnull=True)
        .order_by("node_id")
        .values_list("node_id", flat=True)
        .first()
    )
