"""Job arrays (to be written)."""

from __future__ import annotations

from typing import Any


def number(jobs: list[Any], requests: list[Any]) -> None:
    """Give the members of each array among just-created ``jobs`` their array id."""
