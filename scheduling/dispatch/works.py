"""Attempts as ``Work`` for adapters: the one place the scheduling ORM is read for them."""

from __future__ import annotations

import shlex
import uuid
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from django.db.models import QuerySet

from clusters.adapters.base import Share, Simulation, Stop, Work
from clusters.services.identity import run_as_names
from foundation.sealing import unseal
from scheduling.models import Allocation, JobAttempt


def load_works(attempts: QuerySet[JobAttempt] | Iterable[Any], *, gpus: bool = True) -> list[Work]:
    """The ``Work`` of each attempt — given as a queryset, or as ids (kept in that order; unknown
    ids are left out) — in two queries whatever their number. ``gpus=False`` leaves the GPU
    indices out of the shares (a sync needs only where an attempt runs, and reads one row per
    node instead of one per GPU)."""
    if isinstance(attempts, QuerySet):
        chosen, order = attempts.order_by("created_at", "pk"), None
    else:
        order = [a if isinstance(a, uuid.UUID) else uuid.UUID(str(a)) for a in attempts]
        if not order:
            return []
        chosen = JobAttempt.objects.filter(pk__in=order)
    rows = {
        pk: rest
        for pk, *rest in chosen.values_list(
            "pk",
            "job_id",
            "number",
            "epoch",
            "remote_id",
            "started_at",
            "job__command",
            "job__spec",
            "job__time_limit_s",
            "job__cpu_millicores_per_node",
            "job__memory_bytes_per_node",
            "job__secret_env",
            "stop_requested_at",
            "stop_signal",
            "stop_grace_s",
            "signalled_at",
            "master_port",
            "cluster_id",
            "job__owner_id",
        )
    }
    if not rows:
        return []
    held = Allocation.objects.filter(attempt_id__in=list(rows))
    if not gpus:
        held = held.filter(gpu__isnull=True)
    # Shares by node id: the lowest is the head of a gang (rank 0) on every kind.
    shares: dict[Any, dict[int, _Held]] = defaultdict(dict)
    for attempt, node_id, node, gpu, profile, mig_uuid, shared_mb, gpu_mb in held.order_by(
        "node_id", "gpu__index", "mig_instance__slot"
    ).values_list(
        "attempt_id",
        "node_id",
        "node__name",
        "gpu__index",
        "mig_instance__profile",
        "mig_instance__uuid",
        "gpu_memory_mb",
        "gpu__memory_mb",
    ):
        share = shares[attempt].setdefault(node_id, _Held(node))
        if gpu is not None:
            share.add(gpu, profile or "", mig_uuid or "", shared_mb or 0, gpu_mb or 0)
    accounts = run_as_names((row[-2], row[-1]) for row in rows.values())
    return [
        _work(pk, rows[pk], shares[pk], accounts[(rows[pk][-2], rows[pk][-1])])
        for pk in (order or rows)
        if pk in rows
    ]


class _Held:
    """What one attempt holds on one node, as read from its allocation rows."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.gpus: list[int] = []
        self.profile, self.uuids, self.memory_mb, self.share = "", [], 0, 0.0

    def add(self, gpu: int, profile: str, mig_uuid: str, shared_mb: int, gpu_mb: int) -> None:
        self.gpus.append(gpu)
        if profile:
            self.profile = profile
            self.uuids.append(mig_uuid)
        if shared_mb:
            self.memory_mb = shared_mb
            self.share = round(shared_mb / gpu_mb, 4) if gpu_mb else 0.0

    def share_of(self, node_id: int) -> Share:
        return Share(
            node_id, self.node, tuple(self.gpus), self.profile, tuple(self.uuids), self.memory_mb, self.share
        )


def _work(pk: Any, row: list[Any], shares: dict[int, _Held], run_as: str | None) -> Work:
    job_id, number, epoch, remote_id, started_at, command, spec, time_limit_s, cpu, memory, secret = row[:11]
    stop_at, signal, grace, signalled_at, master_port = row[11:16]
    spec = spec or {}
    env = {str(k): str(v) for k, v in (spec.get("env") or {}).items()}
    sim = spec.get("sim")
    return Work(
        attempt_id=str(pk),
        job_id=job_id,
        number=number,
        epoch=epoch,
        script=shell_command(command, spec.get("setup") or "", spec.get("workdir") or ""),
        env=env | (secrets := unseal(secret) if secret else {}),  # the running job alone sees them
        secret_names=frozenset(secrets),
        shares=tuple(held.share_of(n) for n, held in shares.items()),
        time_limit_s=time_limit_s,
        remote_id=remote_id,
        started_at=started_at.timestamp() if started_at else None,
        simulation=Simulation(sim.get("durationSeconds"), sim.get("exitCode") or 0)
        if isinstance(sim, dict)
        else None,
        run_as=run_as,
        image=str(spec.get("image") or ""),
        cpu_millicores=cpu or 0,
        memory_bytes=memory or 0,
        # Only a preempted attempt has a stop: preempt_jobs stamps it with the job's move to
        # PREEMPTED, and no other move keeps an attempt active.
        stop=Stop(
            signal or "TERM",
            grace or 0,
            stop_at.timestamp(),
            signalled_at.timestamp() if signalled_at else None,
        )
        if stop_at
        else None,
        master_port=master_port,
    )


def shell_command(command: str, setup: str, workdir: str) -> str:
    """The script an attempt runs: into the work dir, the setup, then the command (none: a
    container image's own command)."""
    parts = [f"cd {shlex.quote(workdir)}"] if workdir else []
    return " && ".join([*parts, *([setup] if setup else []), *([command] if command else [])])
