"""Notifications (to be written)."""

from __future__ import annotations

from datetime import datetime


def enqueue(job_ids: list[int], from_state: str, to: str, now: datetime) -> None:
    """Write the notifications the owners of ``job_ids`` asked for, for this move."""
