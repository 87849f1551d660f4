"""Publishing live events to websocket subscribers through the channel layer.

The lowest layer owns this helper so every app can publish without importing the portal.
Publishing is best-effort by design: the database is the record, a lost live message only
delays a dashboard until its next resynchronisation from REST. With the Redis layer, a write path
hands its events to one publisher thread per process instead of waiting for Redis itself: a
blocking ``async_to_sync`` round trip per message cost a submission about 4 ms. The thread sends
them in the order they were handed over.

``RedisChannelLayer`` is channels-redis' layer made to live through Redis faults: a receive that
fails (Redis restarting, unreachable) waits and tries again instead of failing the websocket,
and counts the fault in ``faults``, so that consumers can tell that they may have missed events
and that their group memberships may be gone; ``is_member`` checks one membership (a flush or a
restart without persistence empties them all).
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import os
import queue
import threading
import time
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
    """Send a frozen-dataclass event to each channel-layer group: handed to the publisher thread
    with the Redis layer, sent now with any other (the in-memory layer serves one event loop)."""
    layer = get_channel_layer()
    if layer is None:
        return
    payload = {"type": "live.event", "event": type(event).__name__, "data": dataclasses.asdict(event)}
    if isinstance(layer, BaseRedisChannelLayer):
        _publisher().hand_over((layer, groups, payload))
        return
    for group in groups:
        try:
            async_to_sync(layer.group_send)(group, payload)
        except Exception:  # a dashboard must never break a write path
            log.warning("live event %s to %s not delivered", payload["event"], group, exc_info=True)


class Publisher(threading.Thread):
    """Sends handed-over events on an event loop of its own, draining what queued up meanwhile
    in one pass."""

    def __init__(self) -> None:
        super().__init__(name="live-publisher", daemon=True)
        self.outbox: queue.SimpleQueue[tuple[Any, list[str], dict[str, Any]]] = queue.SimpleQueue()
        self.unsent = 0
        self.sent = threading.Condition()

    def hand_over(self, item: tuple[Any, list[str], dict[str, Any]]) -> None:
        with self.sent:
            self.unsent += 1
        self.outbox.put(item)

    def run(self) -> None:
        loop = asyncio.new_event_loop()
        while True:
            items = [self.outbox.get()]
            while not self.outbox.empty():
                items.append(self.outbox.get())
            try:
                loop.run_until_complete(self._send(items))
            except Exception:  # the thread outlives any one pass
                log.warning("live events not delivered", exc_info=True)
            finally:
                with self.sent:
                    self.unsent -= len(items)
                    self.sent.notify_all()

    async def _send(self, items: list[tuple[Any, list[str], dict[str, Any]]]) -> None:
        for layer, groups, payload in items:
            for group in groups:
                try:
                    await layer.group_send(group, payload)
                except Exception:  # a dashboard must never break a write path
                    log.warning("live event %s to %s not delivered", payload["event"], group, exc_info=True)

    def flush(self, timeout: float = 2.0) -> bool:
        """Wait until what was handed over has been sent (at exit, and for tests)."""
        with self.sent:
            return self.sent.wait_for(lambda: self.unsent == 0, timeout)


_state: dict[str, Any] = {"pid": None, "thread": None}
_lock = threading.Lock()


def _publisher() -> Publisher:
    """This process' publisher thread, started on first use (again in a forked child)."""
    if _state["pid"] != os.getpid():
        with _lock:
            if _state["pid"] != os.getpid():
                thread = Publisher()
                thread.start()
                _state.update(pid=os.getpid(), thread=thread)
    return _state["thread"]


def flush(timeout: float = 2.0) -> bool:
    """Wait for this process' handed-over events to be sent; True when none is left."""
    thread = _state["thread"] if _state["pid"] == os.getpid() else None
    return thread.flush(timeout) if thread is not None else True


atexit.register(flush)


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

    async def group_add(self, group: str, channel: str) -> bool:
        """channels-redis' ``group_add`` (the member's time set, the group's expiry renewed),
        telling whether ``channel`` was missing from the group: a fresh join, or a membership
        Redis lost (flushed, evicted) that a renewal puts back."""
        assert self.require_valid_group_name(group), "Group name not valid"
        assert self.require_valid_channel_name(channel), "Channel name not valid"
        key = self._group_key(group)
        connection = self.connection(self.consistent_hash(group))
        added = await connection.zadd(key, {channel: time.time()})
        await connection.expire(key, self.group_expiry)
        return bool(added)

    async def is_member(self, group: str, channel: str) -> bool:
        """Whether ``channel`` is in ``group`` now (one ZSCORE); raises when Redis is away."""
        connection = self.connection(self.consistent_hash(group))
        return await connection.zscore(self._group_key(group), channel) is not None
