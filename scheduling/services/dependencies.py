"""Job dependencies (to be written)."""

from __future__ import annotations

from typing import Any


def resolve(job_ids: list[int], to: str) -> list[int]:
    """The jobs ``job_ids`` ended as ``to``: mark the edges that wait on them; returns the
    dependents that can now never start."""
    return []


def attach(jobs: list[Any], requests: list[Any], actor: Any) -> None:
    """Write the dependency edges of just-submitted jobs (``JobRequest.dependency``)."""
