"""GPU-hour budgets (to be written)."""

from __future__ import annotations

from typing import Any


def settle(job_ids: list[int]) -> None:
    """Replace the reservations of the jobs that just ended with what they used."""


def reserve(jobs: list[Any]) -> dict[str, list[int]]:
    """Reserve the requested GPU-hours of just-submitted jobs on their budgets; raises to refuse
    them all; returns ``{message: job ids}`` of the jobs to hold instead."""
    return {}
