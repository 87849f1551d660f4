"""The process' hub (``portal.hub``): one membership per group per process, however many sockets
of the process listen, kept in step with the sockets — on the Redis channel layer, where a group's
members are rows of a sorted set that can be counted and lost."""

from __future__ import annotations

import asyncio

import pytest
from channels.layers import get_channel_layer
from django.conf import settings

from portal.hub import hub
from tests.factories import make_project, make_user
from tests.portal.test_live import _connect

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def redis_layer():
    if not settings.REDIS_URL:
        pytest.skip("group memberships are counted in Redis")


@pytest.fixture(autouse=True)
async def close_consumer_connections():
    yield
    from channels.db import database_sync_to_async
    from django.db import connections

    await database_sync_to_async(connections.close_all)()


@pytest.fixture
def alice(db):
    user = make_user("alice")
    make_project("vision", members=(user,))
    return user


async def _members(group: str) -> set[str]:
    layer = get_channel_layer()
    found = await layer.connection(layer.consistent_hash(group)).zrange(layer._group_key(group), 0, -1)
    return {m.decode() for m in found}


def _node_event(node_id: int) -> dict:
    data = {"node_id": node_id, "cluster_id": 1, "from_state": "ready", "to_state": "down"}
    return {"type": "live.event", "event": "NodeStateChanged", "data": data}


async def _opened(user, count: int) -> list:
    sockets = []
    for _ in range(count):
        socket, connected, _ = await _connect("/ws/fleet/", user)
        assert connected and (await socket.receive_json_from())["type"] == "hello"
        sockets.append(socket)
    return sockets


async def test_many_sockets_of_a_process_are_one_member_and_all_hear(alice):
    before = await _members("fleet")
    sockets = await _opened(alice, 3)
    joined = await _members("fleet") - before
    assert len(joined) == 1  # the process, not each socket
    await get_channel_layer().group_send("fleet", _node_event(7))
    for socket in sockets:
        assert (await socket.receive_json_from(timeout=3))["nodes"] == {"7": "down"}
    await sockets[0].disconnect()
    assert await _members("fleet") - before == joined  # the others still listen
    for socket in sockets[1:]:
        await socket.disconnect()
    assert await _members("fleet") - before == set()  # the last one out takes the process out


async def test_a_socket_that_joins_puts_a_lost_membership_back(alice, monkeypatch):
    """Redis lost the group (a flush) while sockets of this process were open: a page that
    (re)connects joins again, and the process is a member once more — it does not wait for every
    older socket of the group to have closed. The older sockets missed what was sent meanwhile:
    their next recheck tells them to reconnect and resynchronise (4503), though the process is a
    member again."""
    from portal.consumers import LiveConsumer

    monkeypatch.setattr(LiveConsumer, "recheck_s", 0.3)
    before = await _members("fleet")
    older = await _opened(alice, 2)
    joined = await _members("fleet") - before
    layer = get_channel_layer()
    for channel in joined:
        await layer.group_discard("fleet", channel)
    assert await _members("fleet") - before == set()
    (newer,) = await _opened(alice, 1)
    assert await _members("fleet") - before == joined
    for socket in older:
        closed = await socket.receive_output(timeout=3)
        assert closed == {"type": "websocket.close", "code": 4503}
    await layer.group_send("fleet", _node_event(8))
    assert (await newer.receive_json_from(timeout=3))["nodes"] == {"8": "down"}
    await asyncio.sleep(1.0)  # three more rechecks: the newer socket stays
    assert await newer.receive_nothing(timeout=0.1)
    await newer.disconnect()
    assert await _members("fleet") - before == set()


class Listener:
    def __init__(self) -> None:
        self.heard: list[dict] = []

    def hear(self, message: dict) -> None:
        self.heard.append(message)


async def test_joins_and_leaves_that_interleave_keep_one_membership():
    """Sockets of one group open and close at once (a deploy's reconnect storm): the process is
    one member while any listens, every listener hears, and none is left behind in Redis when
    the last one goes."""
    live = hub()
    group = "test.hub.storm"
    for round_ in range(5):
        listeners = [Listener() for _ in range(4)]
        await asyncio.gather(*(live.join(group, listener) for listener in listeners))
        assert await _members(group) == {live.channels[group]}
        await get_channel_layer().group_send(group, _node_event(round_))
        for _ in range(100):
            if all(listener.heard for listener in listeners):
                break
            await asyncio.sleep(0.02)
        assert all(len(listener.heard) == 1 for listener in listeners)
        late = Listener()
        await asyncio.gather(*(live.leave(group, listener) for listener in listeners), live.join(group, late))
        assert await _members(group) == {live.channels[group]}
        await live.leave(group, late)
        assert await _members(group) == set()


async def test_a_listener_that_raises_does_not_silence_the_others():
    live = hub()
    group = "test.hub.faulty"

    class Faulty:
        def hear(self, message: dict) -> None:
            raise RuntimeError("a broken socket")

    faulty, good = Faulty(), Listener()
    await live.join(group, faulty)
    await live.join(group, good)
    await get_channel_layer().group_send(group, _node_event(2))
    for _ in range(100):
        if good.heard:
            break
        await asyncio.sleep(0.02)
    assert good.heard
    await live.leave(group, faulty)
    await live.leave(group, good)


async def test_the_sockets_of_a_group_share_one_membership_check(alice, monkeypatch):
    """Every socket asks at each recheck whether Redis still has its group; Redis is asked at most
    once a ``member_fresh_s`` per group, however many sockets ask."""
    from portal.consumers import LiveConsumer

    monkeypatch.setattr(LiveConsumer, "recheck_s", 0.1)
    layer = get_channel_layer()
    asked: list[str] = []
    is_member = type(layer).is_member

    async def counting(self, group, channel):
        asked.append(group)
        return await is_member(self, group, channel)

    monkeypatch.setattr(type(layer), "is_member", counting)
    rechecks: list[int] = []
    settle = LiveConsumer._settle

    async def counted(self, user, groups):
        rechecks.append(1)
        return await settle(self, user, groups)

    monkeypatch.setattr(LiveConsumer, "_settle", counted)
    sockets = await _opened(alice, 5)
    asked.clear()
    rechecks.clear()
    await asyncio.sleep(2.0)
    assert len(rechecks) >= 40  # five sockets, about ten rechecks a second each
    assert 1 <= len(asked) <= 3  # once a second for the group, not once per recheck
    await get_channel_layer().group_send("fleet", _node_event(9))  # and all still hear
    for socket in sockets:
        assert (await socket.receive_json_from(timeout=3))["nodes"] == {"9": "down"}
        await socket.disconnect()


async def test_no_membership_answer_from_before_a_fault_is_reused():
    """A receive of the layer failed (Redis went away) after the last answer: the next socket
    to ask makes the hub ask Redis again rather than trust it — asked while Redis is away the
    question fails and the socket stays open; it is not told, from a stale answer, to reconnect."""
    live = hub()
    group = "test.hub.fault"
    listener = Listener()
    await live.join(group, listener)
    layer = live.layer
    asked: list[str] = []
    is_member = layer.is_member

    async def counting(group, channel):
        asked.append(group)
        return await is_member(group, channel)

    layer.is_member = counting
    try:
        assert await live.is_member(group) and asked == []  # the join itself was the answer
        layer.faults += 1
        assert await live.is_member(group) and asked == [group]
        assert await live.is_member(group) and asked == [group]  # and that answer is shared
    finally:
        del layer.is_member
        await live.leave(group, listener)
