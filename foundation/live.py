"""Publishing live events to websocket subscribers through the channel layer.

The lowest layer owns this helper so every app can publish without importing the portal.
Publishing is best-effort by design: the database is the record, a lost live message only
delays a dashboard until its next resynchronisation from REST.

``RedisChannelLayer`` is channels-redis' layer made to live through Redis faults: a receive that
fails (Redis restarting, unreachable) waits and tries again instead of failing the websocket,
and counts the fault in ``faults``, so that consumers can tell that they may have missed events
and that their group memberships may be gone; ``is_member`` checks one membership (a flush or a
restart without persistence empties them all).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from channels_redis.core import RedisChannelLayer as BaseRedisChannelLayer
from django.db import transaction
from redis.exceptions import RedisError

log = logging.getLogger(__name__)
RECEIVE_RETRY_S = (0.1, 2.0)  # first and longest wait between receives while Redis is away
LAYER_ERRORS = (RedisError, OSError)  # what the Redis channel layer raises while Redis is away


def publish(groups: list[str], event: Any) -> None:
    """Send a frozen-dataclass event to each channel-layer group, now."""
    layer = get_channel_layer()
    if layer is None:
        return
    payload = {"type": "live.event", "event": type(event).__name__, "data": dataclasses.asdict(event)}
    for group in groups:
        try:
            async_to_sync(layer.group_send)(group, payload)
        except Exception:  # a dashboard must never break a write path
            log.warning("live event %s to %s not delivered", payload["event"], group, exc_info=True)


def publish_on_commit(groups: list[str], event: Any, using: str | None = None) -> None:
    """Send the event once the surrounding transaction commits (never for a rolled-back write)."""
    transaction.on_commit(lambda: publish(groups, event), using=using)


class RedisChannelLayer(BaseRedisChannelLayer):
    """The channel layer of every websocket process (``CHANNEL_LAYERS``).

    ``receive`` never fails for Redis' sake: it retries with a growing wait (0.1 s doubling to
    2 s) until Redis answers, so a socket outlives a Redis restart; nothing queued is lost by a
    retry (channels-redis keeps an in-flight message in a backup set until it is consumed).
    ``faults`` counts the receives that failed on this layer (one per process) since it started."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults = 0

    async def receive(self, channel: str) -> dict[str, Any]:
        wait = RECEIVE_RETRY_S[0]
        while True:
            try:
                return await super().receive(channel)
            except LAYER_ERRORS as exc:
                if wait == RECEIVE_RETRY_S[0]:
                    log.warning("channel layer receive failed (%s); retrying until Redis answers", exc)
                self.faults += 1
                await asyncio.sleep(wait)
                wait = min(wait * 2, RECEIVE_RETRY_S[1])

    async def is_member(self, group: str, channel: str) -> bool:
        """Whether ``channel`` is in ``group`` now (one ZSCORE); raises when Redis is away."""
        connection = self.connection(self.consistent_hash(group))
        return await connection.zscore(self._group_key(group), channel) is not None
