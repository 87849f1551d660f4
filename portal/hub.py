"""One process' membership of the live groups, shared by all its websockets.

A socket does not join the channel-layer groups itself. The process' hub joins each group once,
with one channel of its own per group, reads that channel, and hands every event to the sockets
of this process that listen to the group, in memory. So a fleet event with 500 fleet pages open
on one Daphne process is one message from Redis and one read, then 500 calls that fold it into
each socket's pending delta — instead of 500 channel messages, each woken in its own consumer
task and each preceded by Channels' hop to a worker thread to close stale database connections
(what a consumer does before every message it handles). The channel layer carries a message per
event per process either way (channels-redis already sends one per process).

Membership follows the sockets: the first socket of a group makes the hub join it and start
reading; every later one renews the membership (``group_add`` is idempotent: it refreshes the
member's time in Redis), so a socket that reconnects after Redis lost the groups puts the
process back in; the last socket to leave makes the hub leave the group and stop reading.
Joins and leaves of one group are serialised, so a leave can never land after a join of a newer
socket and drop the group from under it. A renewal that finds the membership gone (Redis was
flushed, or evicted it) counts a loss for the group (``losses``): the sockets that joined
before it missed events, and their next recheck tells them to reconnect and resynchronise —
the renewal must not hide the loss from them.

There is one hub per event loop (Daphne runs one per process; tests run one per test).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from typing import Any, Protocol

from channels.layers import get_channel_layer

log = logging.getLogger(__name__)


class Listener(Protocol):
    def hear(self, message: dict[str, Any]) -> None: ...


class Hub:
    member_fresh_s = 1.0  # a membership check is shared by the group's sockets this long

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.listeners: dict[str, set[Listener]] = {}
        self.channels: dict[str, str] = {}  # group → this process' channel in it
        self.readers: dict[str, asyncio.Task] = {}
        self.changing: dict[str, asyncio.Lock] = {}  # per group: one join or leave at a time
        # group → how often a renewal found this process' membership gone from Redis (flushed,
        # evicted): sockets that joined before a loss missed events and must resynchronise
        self.losses: dict[str, int] = {}
        # group → (loop time, channel, layer faults, answer) of the last membership check
        self.known: dict[str, tuple[float, str, int, asyncio.Future]] = {}

    @property
    def faults(self) -> int:
        """Receives of the layer that failed since it started (only the Redis layer counts)."""
        return getattr(self.layer, "faults", 0)

    def _known_member(self, group: str) -> None:
        answer = asyncio.get_running_loop().create_future()
        answer.set_result(True)
        self.known[group] = (asyncio.get_running_loop().time(), self.channels[group], self.faults, answer)

    async def join(self, group: str, listener: Listener) -> None:
        """Listen to ``group``; the hub joins it (again: that renews the membership). Raises what
        the layer raises when Redis is away (or the join is cancelled), and then ``listener`` is
        not listening."""
        self.listeners.setdefault(group, set()).add(listener)
        try:
            async with self._lock(group):
                renewal = group in self.channels
                if not renewal:
                    channel = await self.layer.new_channel()
                    self.channels[group] = channel
                    self.readers[group] = asyncio.ensure_future(self._read(group, channel))
                added = await self.layer.group_add(group, self.channels[group])
                if renewal and added is True:  # the Redis layer says it was not a member any more
                    self.losses[group] = self.losses.get(group, 0) + 1
                self._known_member(group)
        except BaseException:
            with contextlib.suppress(Exception):  # Redis away: the membership goes with it, or expires
                await self.leave(group, listener)
            raise

    def _lock(self, group: str) -> asyncio.Lock:
        if group not in self.changing:
            self.changing[group] = asyncio.Lock()
        return self.changing[group]

    async def leave_all(self, listener: Listener) -> None:
        """Stop ``listener`` hearing every group it listens to: it stops hearing all of them at
        once, then the hub leaves those it was the last listener of (a leave Redis refuses does
        not keep the others)."""
        groups = [group for group, listening in self.listeners.items() if listener in listening]
        for group in groups:
            self.listeners[group].discard(listener)
        for group in groups:
            try:
                await self.leave(group, listener)
            except Exception:  # Redis away: the membership expires (channels-redis: a day)
                log.warning("live group %s not left", group, exc_info=True)

    async def leave(self, group: str, listener: Listener) -> None:
        """Stop ``listener`` hearing ``group``; the hub leaves it with its last listener."""
        listening = self.listeners.get(group)
        if listening is not None:
            listening.discard(listener)
        async with self._lock(group):
            if self.listeners.get(group) or group not in self.channels:
                return
            self.listeners.pop(group, None)
            channel = self.channels.pop(group)
            self.readers.pop(group).cancel()
            self.known.pop(group, None)
            await self.layer.group_discard(group, channel)

    async def is_member(self, group: str) -> bool:
        """Whether Redis still has this process in ``group`` (False when the hub is not in it);
        raises when Redis is away. Only layers that can lose members (Redis) have the check.

        Every socket of the group asks this at each of its rechecks; Redis is asked at most once
        per ``member_fresh_s`` per group and the sockets share the answer (a thousand sockets
        would otherwise make 333 round trips a second for a handful of groups). A join that
        succeeded is an answer too, so a socket that has just put a lost membership back is
        not told it is missing. An answer from before a receive failed (``faults``) is never
        reused: while Redis is away the question fails, and the sockets stay open until it
        answers again."""
        channel = self.channels.get(group)
        if channel is None:
            return False
        now = asyncio.get_running_loop().time()
        known = self.known.get(group)
        if known is None or known[1:3] != (channel, self.faults) or now - known[0] >= self.member_fresh_s:
            answer = asyncio.ensure_future(self.layer.is_member(group, channel))
            known = self.known[group] = (now, channel, self.faults, answer)
            answer.add_done_callback(lambda done: self._forget_failure(group, done))
        return await asyncio.shield(known[3])

    def _forget_failure(self, group: str, answer: asyncio.Future) -> None:
        known = self.known.get(group)
        if (answer.cancelled() or answer.exception() is not None) and known and known[3] is answer:
            del self.known[group]  # Redis away: the next recheck asks again

    async def _read(self, group: str, channel: str) -> None:
        while True:
            try:
                message = await self.layer.receive(channel)
            except Exception:  # the reader outlives any one message (the Redis layer itself
                # retries while Redis is away): a group is never left without one
                log.exception("live group %s: receive failed; reading on", group)
                await asyncio.sleep(1.0)
                continue
            for listener in tuple(self.listeners.get(group, ())):
                try:
                    listener.hear(message)
                except Exception:  # one socket's fault never silences the others
                    log.exception("live event not handed to a socket")


_hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Hub] = weakref.WeakKeyDictionary()


def hub() -> Hub | None:
    """This event loop's hub on the default channel layer; None without a layer."""
    layer = get_channel_layer()
    if layer is None:
        return None
    loop = asyncio.get_running_loop()
    found = _hubs.get(loop)
    if found is None or found.layer is not layer:
        found = _hubs[loop] = Hub(layer)
    return found
