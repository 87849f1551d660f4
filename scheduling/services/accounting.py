"""Accounting: what finished jobs used (to be written)."""

from __future__ import annotations

from datetime import datetime


def record_ends(job_ids: list[int], now: datetime) -> None:
    """Charge the jobs that just ended: their GPU-seconds and the daily roll-up."""
