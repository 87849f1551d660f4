"""Attempts as ``Work`` for adapters: the one place the scheduling ORM is read for them."""

from __future__ import annotations

import shlex
import uuid
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from clusters.adapters.base import Share, Simulation, Work
from scheduling.models import Allocation, JobAttempt


def load_works(attempt_ids: Iterable[Any]) -> list[Work]:
    """The ``Work`` of each attempt (in the order given; unknown ids are left out), in two
    queries whatever their number."""
    ids = [a if isinstance(a, uuid.UUID) else uuid.UUID(str(a)) for a in attempt_ids]
    if not ids:
        return []
    rows = {
        pk: rest
        for pk, *rest in JobAttempt.objects.filter(pk__in=ids).values_list(
            "pk",
            "job_id",
            "number",
            "epoch",
            "remote_id",
            "started_at",
            "job__command",
            "job__spec",
            "job__time_limit_s",
        )
    }
    shares: dict[Any, dict[int, tuple[str, list[int]]]] = defaultdict(dict)
    for attempt, node_id, node, gpu in (
        Allocation.objects.filter(attempt_id__in=list(rows))
        .order_by("node__name", "gpu__index")
        .values_list("attempt_id", "node_id", "node__name", "gpu__index")
    ):
        share = shares[attempt].setdefault(node_id, (node, []))
        if gpu is not None:
            share[1].append(gpu)
    works = []
    for pk in ids:
        if pk not in rows:
            continue
        job_id, number, epoch, remote_id, started_at, command, spec, time_limit_s = rows[pk]
        spec = spec or {}
        sim = spec.get("sim")
        works.append(
            Work(
                attempt_id=str(pk),
                job_id=job_id,
                number=number,
                epoch=epoch,
                script=shell_command(command, spec.get("setup") or "", spec.get("workdir") or ""),
                env={str(k): str(v) for k, v in (spec.get("env") or {}).items()},
                shares=tuple(Share(n, name, tuple(g)) for n, (name, g) in shares[pk].items()),
                time_limit_s=time_limit_s,
                remote_id=remote_id,
                started_at=started_at.timestamp() if started_at else None,
                simulation=Simulation(sim.get("durationSeconds"), sim.get("exitCode") or 0)
                if isinstance(sim, dict)
                else None,
            )
        )
    return works


def shell_command(command: str, setup: str, workdir: str) -> str:
    """The script an attempt runs: into the work dir, the setup, then the command."""
    parts = [f"cd {shlex.quote(workdir)}"] if workdir else []
    return " && ".join([*parts, *([setup] if setup else []), command])
