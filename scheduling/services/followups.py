"""What follows a job's move, in the transaction that moved it: the ledgers that must never
miss one (the energy meter's last reading, accounting, budgets, dependencies, notifications).

``transitions`` calls ``after_moves`` for every move it makes; it returns the jobs whose
dependencies can now never be met, which ``transitions`` cancels in turn (a cascade, each step
in the same transaction). The modules called here only read and write their own rows: none of
them moves a job itself, so none imports ``transitions``.
"""

from __future__ import annotations

from datetime import datetime

from scheduling.choices import ACTIVE_STATES, TERMINAL_STATES
from scheduling.services import accounting, budgets, dependencies, energy, notifications


def after_moves(job_ids: list[int], from_state: str, to: str, now: datetime) -> list[int]:
    """Record the moves of ``job_ids`` from ``from_state`` to ``to``; returns the ids of jobs
    that must now be cancelled because a dependency of theirs can never be met."""
    doomed: list[int] = []
    if from_state in ACTIVE_STATES and to not in ACTIVE_STATES:
        # The attempts just ended: their last reading, up to now, before accounting reads it.
        energy.meter_ends(job_ids, now)
    if to in TERMINAL_STATES:
        accounting.record_ends(job_ids, now)
        budgets.settle(job_ids)
        doomed = dependencies.resolve(job_ids, to)
    notifications.enqueue(job_ids, from_state, to, now)
    return doomed
