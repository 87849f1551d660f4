"""Preempting running jobs: the one way a job is asked to give its GPUs back early.

``preempt_jobs`` moves each victim from its active state to ``PREEMPTED`` (a compare-and-set,
as every move), stamps its attempt with the stop it gets — a signal (``TERM`` unless the job's
spec asks for another) and a grace period (the job's own, at most its queue's, default 30 s),
after which the cluster kills it — and tells the cluster: an agent reads the stop with its next
desired state, a polled cluster (Slurm, Kubernetes) is signalled by its next sync. The job keeps
its GPUs while it drains; when its cluster reports the attempt ended, the job is requeued
(``dispatch.remote``): PENDING again under the same id, reason ``Preempted``, a new attempt when
it is placed again.

The scheduling cycle calls this inside its transaction, so a cycle that rolls back preempts
nothing.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone

from clusters.adapters.registry import adapter_for
from scheduling.choices import JobState
from scheduling.dispatch.desired import forget_desired
from scheduling.models import Allocation, Job, JobAttempt
from scheduling.services.transitions import transition_jobs
from scheduling.wakeup import wake_sync

log = logging.getLogger(__name__)

PREEMPTIBLE_STATES = frozenset({JobState.SCHEDULED, JobState.STARTING, JobState.RUNNING})
SIGNALS = ("TERM", "INT", "HUP", "USR1", "USR2", "QUIT")
DEFAULT_SIGNAL = "TERM"


@dataclass(frozen=True)
class Victim:
    job_id: int
    message: str  # who preempted it and why, shown as the job's reason


def stop_terms(spec: dict, queue_grace_s: int) -> tuple[str, int]:
    """The signal and grace period a preempted job gets: what its spec asks for
    (``spec.preemption``), the grace at most its queue's."""
    asked = (spec or {}).get("preemption") or {}
    signal = asked.get("signal") or DEFAULT_SIGNAL
    if signal not in SIGNALS:
        signal = DEFAULT_SIGNAL
    grace = asked.get("graceSeconds")
    grace = queue_grace_s if grace is None else min(int(grace), queue_grace_s)
    return signal, max(grace, 0)


def preempt_jobs(victims: list[Victim]) -> list[int]:
    """Preempt each victim still preemptible; returns the ids that moved to PREEMPTED. A victim
    that moved on meanwhile (ended, cancelled, already preempted) is left alone.

    Set-based: the victims are locked in one statement (in id order, as every set-based move
    locks), then moved with ``transition_jobs`` once per state they leave, each with its own
    preemptor's words — a cycle's preemptions are a few statements, not a few per victim."""
    if not victims:
        return []
    now = timezone.now()
    messages = {v.job_id: v.message for v in victims}
    moved: list[int] = []
    with transaction.atomic():
        rows = (
            Job.objects.select_for_update(of=("self",))
            .filter(pk__in=list(messages), state__in=PREEMPTIBLE_STATES)
            .order_by("pk")
            .values_list("pk", "state", "spec", "queue__preemption_grace_s")
        )
        leaving: dict[str, list[int]] = defaultdict(list)
        stops: dict[tuple[str, int], list[int]] = defaultdict(list)
        for pk, state, spec, grace in rows:
            leaving[state].append(pk)
            stops[stop_terms(spec, grace)].append(pk)
        for state, ids in leaving.items():
            moved += transition_jobs(ids, JobState.PREEMPTED, only_from=state, messages=messages)
        if not moved:
            return []
        done = set(moved)
        for (signal, grace), ids in stops.items():
            JobAttempt.objects.filter(job_id__in=[pk for pk in ids if pk in done], active=True).update(
                stop_requested_at=now, stop_signal=signal, stop_grace_s=grace
            )
        held = Allocation.objects.filter(job_id__in=moved, active=True)
        nodes = sorted(set(held.values_list("node_id", flat=True)))
        # Agents read the stop with their next desired state; a polled cluster is signalled
        # by its next sync, woken now.
        clusters = set(
            JobAttempt.objects.filter(job_id__in=moved, active=True).values_list(
                "cluster_id", "cluster__kind"
            )
        )
        transaction.on_commit(lambda: forget_desired(nodes))
        for cluster_id, kind in clusters:
            if adapter_for(kind).sync_every_s is not None:
                transaction.on_commit(lambda c=cluster_id: wake_sync(c, 0.0))
    return moved
