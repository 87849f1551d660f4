"""Reads of the scheduling app."""

from __future__ import annotations

from collections.abc import Iterable

from scheduling.models import Allocation


def busy_node_ids(node_ids: Iterable[int]) -> set[int]:
    """The nodes among ``node_ids`` that hold at least one active allocation."""
    return set(
        Allocation.objects.filter(node_id__in=list(node_ids), active=True)
        .values_list("node_id", flat=True)
        .distinct()
    )
