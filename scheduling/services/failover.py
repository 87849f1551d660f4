"""Node loss: each job still holding a node that is now ``down`` gets its failover policy, on
every kind of cluster alike."""

from __future__ import annotations

import logging

from clusters.choices import NodeState
from clusters.models import Node
from scheduling.choices import ACTIVE_STATES, FailoverPolicy, JobState, PendingReason
from scheduling.dispatch.desired import forget_desired
from scheduling.models import JobAttempt
from scheduling.services.transitions import InvalidTransition, TransitionConflict, transition_job

log = logging.getLogger(__name__)


def handle_node_lost(node_ids: list[int]) -> int:
    """The failover policy of every job still holding one of ``node_ids``: ``requeue`` (a new
    attempt elsewhere), ``hold`` (wait for an operator) or ``fail``. Idempotent, and run both
    when the lifecycle takes nodes down and as a periodic sweep, so a job whose failover lost a
    race or an error is decided again. Returns how many jobs it moved."""
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
