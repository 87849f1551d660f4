"""Events the clusters app publishes (past tense, frozen)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeStateChanged:
    node_id: int
    cluster_id: int
    node: str
    from_state: str
    to_state: str
    reason: str
    at: str
