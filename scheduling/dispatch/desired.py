"""The per-node cache of what a node's agent should be running (``dispatch.agent``). Dropped
after every placement, delivery and release on a node, so the next heartbeat reads it afresh."""

from __future__ import annotations

from django.core.cache import cache

TTL_S = 30


def desired_key(node_id: int) -> str:
    return f"orrery:desired:{node_id}"


def forget_desired(node_ids: list[int]) -> None:
    if node_ids:
        cache.delete_many([desired_key(n) for n in node_ids])
