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


@dataclass(frozen=True)
class NodesStateChanged:
    """Many nodes of a cluster moved to one state at once (a lifecycle pass): the first 5,000
    ids and how many in all."""

    cluster_id: int
    node_ids: list[int]
    count: int
    to_state: str
    reason: str
    at: str
