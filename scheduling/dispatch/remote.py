"""The one place a cluster's word on an attempt becomes a job transition, for every kind.

Adapters (and the agents' reports) say what a cluster did in neutral terms (``RemoteState``);
this module decides what that means for the job, through the job state machine:

====================  ==========================  ====================================
phase                 job state it applies to     effect
====================  ==========================  ====================================
queued, held          SCHEDULED, STARTING         the job's reason says why it waits there
starting              SCHEDULED                   → STARTING
running               SCHEDULED, STARTING         → RUNNING
succeeded … cancelled any active state            → the same end state, with the exit code
any end, preempted    PREEMPTED (draining)        → PENDING: requeued, reason Preempted
preempted             any other active state      → PENDING: the cluster preempted it itself
====================  ==========================  ====================================

A report about an attempt that is no longer active changes nothing (fencing: the attempt was
requeued or ended meanwhile), and so does a gang member's success that is not the head's (the
head decides success; any failure decides at once). Many attempts moving alike (a simulated
cluster ending a thousand jobs in one pass) move in one set-based transition.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence

from clusters.adapters.base import Phase, RemoteState
from scheduling.choices import ACTIVE_STATES, JobState, PendingReason
from scheduling.models import Job, JobAttempt
from scheduling.services.transitions import (
    InvalidTransition,
    TransitionConflict,
    transition_job,
    transition_jobs,
)

# The states a phase moves a job from (ended phases: any active state).
_SOURCES: dict[Phase, frozenset[str]] = {
    Phase.STARTING: frozenset({JobState.SCHEDULED}),
    Phase.RUNNING: frozenset({JobState.SCHEDULED, JobState.STARTING}),
}
_WAITING_THERE = frozenset({JobState.SCHEDULED, JobState.STARTING})


def apply_remote_states(states: Sequence[RemoteState]) -> int:
    """Apply what clusters say about attempts; returns how many jobs moved. Several states of
    one attempt (an agent reporting its start and its end at once) apply in the order given."""
    moved = 0
    for batch in _rounds(states):
        moved += _apply(batch)
    return moved


def target_state(phase: Phase, current: str, *, head: bool = True) -> str | None:
    """The job state ``phase`` moves a job in ``current`` to, or None when it moves nothing."""
    if phase.ended:
        if phase is Phase.SUCCEEDED and not head:
            return None
        if current == JobState.PREEMPTED or (phase is Phase.PREEMPTED and current in ACTIVE_STATES):
            return JobState.PENDING  # drained (or preempted by the cluster itself): requeued
        return JobState(phase.value.upper()) if current in ACTIVE_STATES else None
    sources = _SOURCES.get(phase)
    return JobState(phase.value.upper()) if sources and current in sources else None


def past_time_limit(state: RemoteState, time_limit_s: int | None, now: float | None = None) -> bool:
    """Running there past the job's own limit (only clusters that report ``started_at``)."""
    return bool(
        state.phase is Phase.RUNNING
        and time_limit_s
        and state.started_at
        and (now or time.time()) > state.started_at + time_limit_s
    )


def _rounds(states: Sequence[RemoteState]) -> list[list[RemoteState]]:
    rounds: list[list[RemoteState]] = []
    seen: dict[str, int] = defaultdict(int)
    for state in states:
        k = seen[state.attempt_id]
        seen[state.attempt_id] += 1
        if k == len(rounds):
            rounds.append([])
        rounds[k].append(state)
    return rounds


def _apply(states: list[RemoteState]) -> int:
    current = {
        str(pk): (job_id, job_state, said)
        for pk, job_id, job_state, said in JobAttempt.objects.filter(
            pk__in=[s.attempt_id for s in states], active=True
        ).values_list("pk", "job_id", "job__state", "job__reason_message")
    }
    groups: dict[tuple[str, str, int | None, str], list[int]] = defaultdict(list)
    for state in states:
        if state.attempt_id not in current:
            continue  # fenced: not an active attempt any more
        job_id, job_state, said = current[state.attempt_id]
        to = target_state(state.phase, job_state, head=state.head)
        if to == JobState.PENDING:  # requeued after a preemption: keep who preempted it
            why = said if job_state == JobState.PREEMPTED and said else "preempted by its cluster"
            there = f" ({state.message})" if state.message else ""
            groups[(job_state, to, state.exit_code, f"{why}; requeued{there}")].append(job_id)
        elif to is not None:
            groups[(job_state, to, state.exit_code, state.message)].append(job_id)
        elif (
            state.phase in (Phase.QUEUED, Phase.HELD)
            and job_state in _WAITING_THERE
            and state.message != said
        ):
            Job.objects.filter(pk=job_id, state=job_state).update(reason_message=state.message)
    moved = 0
    for (source, to, exit_code, message), job_ids in groups.items():
        requeue = to == JobState.PENDING
        ended = requeue or Phase(to.lower()).ended
        reason = PendingReason.PREEMPTED if requeue else ""
        try:
            if len(job_ids) > 1:
                moved += len(
                    transition_jobs(
                        job_ids, to, only_from=source, exit_code=exit_code, message=message, reason=reason
                    )
                )
            else:
                sources = ACTIVE_STATES if ended else _SOURCES[Phase(to.lower())]
                transition_job(
                    job_ids[0], to, only_from=sources, exit_code=exit_code, message=message, reason=reason
                )
                moved += 1
        except (InvalidTransition, TransitionConflict):
            pass  # already there, overtaken (a cancel), or no edge (a completing job preempted)
    return moved
