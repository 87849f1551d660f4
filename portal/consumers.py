"""Live dashboards over websockets.

Each consumer authenticates with the session (``AuthMiddlewareStack``; the ASGI app also checks
the Origin against ``ALLOWED_HOSTS``), decides what the user may see, listens to the
channel-layer groups of that through its process' hub (``portal.hub``: the process joins each
group once and hands each event to its sockets in memory), and then **coalesces**: events that
arrive are folded into one pending delta (job id → its latest state, node id → its latest state,
a count of new jobs) and sent at most once per ``flush_s`` (1 s). A subscriber therefore never
receives raw heartbeats or one message per event, however busy the fleet is, and nothing the
page needs is lost: a later state of the same job or node replaces the earlier one, and every id
folded in is in the next message. Every event is checked against what this subscriber may see
before it is folded in, so a user never hears of another project's job. A client that reconnects
resynchronises from REST (``portal/live.js``).

**When a delta is sent.** The first event after a quiet spell is sent ``settle_s`` (50 ms)
later, so that one burst (a scheduling cycle's events, a lifecycle pass) is one message; events
that arrive within ``flush_s`` of the last message wait for ``flush_s`` after it. A quiet socket
has no timer. On a busy channel (more than one event a second) an event therefore waits between
0 and ``flush_s`` (uniformly, half of it on average) before it leaves; on a quiet one, 50 ms.

**Re-authorisation.** Nothing decided at connect is trusted for long: every ``recheck_s``
(3 s) each socket's session is read again by its key from the session store and its user again
from the database (``_session_users``), and access is decided again with that fresh user. So
within a few seconds

- a logout (the session flushed from the store), an expired session, a password change (the
  session's auth hash no longer matches) or a deactivation closes the socket with **4401**;
- a user who lost access to the one job a socket is about (removed from its project, lost
  operator status, or the job is gone) is closed with **4404**, as if it had never existed;
- a user who lost some projects only (``/ws/jobs/``) leaves those projects' groups and drops
  their events; the socket stays open for the rest.

A recheck that fails (database down), or that cannot finish within an interval (a database or
Redis call hanging), closes with 4500: access is never assumed, and the page reconnects and
authenticates afresh.

Cost: the rechecks of a process are made in batches by its ``Warden``: every socket due (or
due within a third of an interval) is read in one trip to Channels' database thread, with one
query for all their sessions (database sessions; one read per key with other engines), one for
all their users, one for the memberships of all the job-list sockets' users (and one for every
project when an operator is among them), and one per job-page or cluster-page socket. A
thousand open sockets cost a few trips and a few dozen queries every interval — where a trip
and three queries per socket (333 trips a second) took two thirds of a core before
(``benchmarks/websockets.py`` measures both). ``recheck_s`` trades that load against how long
a revoked user keeps listening. With signed-cookie sessions there is no server-side session to
find gone, so a logout is not seen; everything else is.

**Redis faults.** The channel layer (``foundation.live.RedisChannelLayer``) keeps receiving
through a Redis restart instead of failing the socket. A flush or a restart empties the group
memberships, and events published while Redis was away are gone, so each recheck also asks Redis
whether this process is still in the socket's first group (one ZSCORE, which the process'
sockets of that group share: at most one a second per group) and whether another socket's join
found the process' membership gone since this one joined (``Hub.losses``): when either says so,
or when the layer's receive failed since the socket joined, the socket closes with **4503** and
the page reconnects, joins afresh and resynchronises from REST. While Redis is away the probe
fails and the socket simply stays open; the decision is made once Redis answers, within one
interval. Memberships are also renewed every ``rejoin_s`` (an hour), well inside their expiry in
Redis (a day), so a wall display left open for days keeps hearing.

Close codes: 4401 not signed in, signed out, password changed or deactivated; 4404 no such job
or not yours (also when access is lost); 4500 the recheck itself failed, or Redis was away at
connect; 4503 Redis lost the socket's groups (reconnect and resynchronise). ``portal/live.js``
reconnects after every code but 4401 and 4404. (Codes of the application's own are 4000–4999:
Daphne refuses to send the protocol's 1011 or 1012, and a close it refuses never happens.)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import weakref
from importlib import import_module
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib.auth import (
    BACKEND_SESSION_KEY,
    HASH_SESSION_KEY,
    SESSION_KEY,
    get_user_model,
    load_backend,
)
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.models import AbstractBaseUser
from django.contrib.sessions.backends.cached_db import SessionStore as CachedDatabaseSessionStore
from django.contrib.sessions.backends.db import SessionStore as DatabaseSessionStore
from django.core.exceptions import ValidationError
from django.utils import timezone
from django.utils.crypto import constant_time_compare

from clusters.selectors import cluster_by_name
from foundation.live import LAYER_ERRORS
from portal.access import access_job, visible_project_ids
from portal.hub import hub

log = logging.getLogger(__name__)

FLUSH_S = 1.0  # at most one message per socket this often
SETTLE_S = 0.05  # the first event after a quiet spell waits this long for the rest of its burst
RECHECK_S = 3.0
REJOIN_S = 3600.0  # renew group memberships this often (channels-redis expires them after a day)

SIGNED_OUT = 4401  # no session, signed out, password changed, deactivated
NOT_FOUND = 4404  # no such job, or not (any more) this user's to see
RECHECK_FAILED = 4500  # reconnect and authenticate afresh
REDIS_LOST = 4503  # Redis lost the groups (flush, restart): reconnect and resynchronise


class LiveConsumer(AsyncJsonWebsocketConsumer):
    # No channel of its own: the process' hub listens to the groups and hands events over
    # (``portal.hub``), so no socket has a channel-layer receive of its own to wake.
    channel_layer_alias = None
    flush_s = FLUSH_S  # tests may lower these on the class
    settle_s = SETTLE_S
    recheck_s = RECHECK_S  # session, user and access are read again this often: a revoked user
    # stops hearing within this time, without reconnecting (tests may lower it on the class)
    rejoin_s = REJOIN_S

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=SIGNED_OUT)
            return
        self.user = user
        self.session_key = self.scope["session"].session_key
        self.jobs: dict[int, str] = {}
        self.nodes: dict[int, str] = {}
        self.new_jobs = 0
        self.flusher: asyncio.Task | None = None  # the pending delta's send, while one is due
        self.sent_at = -self.flush_s  # loop time of the last delta sent
        self.hearing = True  # False once access is gone: nothing more is folded in or sent
        groups = await self.authorise()
        if groups is None:
            await self.close(code=NOT_FOUND)
            return
        self.live_groups: list[str] = []
        self.losses_seen: dict[str, int] = {}  # group → the hub's count of lost memberships at join
        self.hub = hub()
        self.faults_seen = getattr(self.hub and self.hub.layer, "faults", 0)
        try:
            await self._join(groups)
        except LAYER_ERRORS as exc:  # Redis away: refuse; the page tries again (1 s, doubling)
            log.warning("live socket refused: channel layer unavailable (%s)", exc)
            await self.close(code=RECHECK_FAILED)
            return
        await self.accept()
        await self.send_json({"type": "hello", "groups": len(groups)})
        self.warden = warden()
        self.warden.watch(self)

    async def disconnect(self, code: int) -> None:
        if getattr(self, "warden", None) is not None:
            self.warden.forget(self)
        if getattr(self, "flusher", None) is not None:
            self.flusher.cancel()
        self.hearing = False
        await self._stop_listening()

    async def _stop_listening(self) -> None:
        """Leave every group the hub has this socket in (also one a recheck was joining)."""
        self.live_groups = []
        if getattr(self, "hub", None) is not None:
            await self.hub.leave_all(self)

    async def _join(self, groups: list[str]) -> None:
        """Listen to every group through the process' hub (joining again only renews the
        membership)."""
        for group in groups:
            if self.hub is not None:
                await self.hub.join(group, self)
                if not self.hearing:  # closed while it joined: leave what it has joined
                    await self.hub.leave_all(self)
                    return
            if group not in self.live_groups:
                self.live_groups.append(group)
                self.losses_seen[group] = self.hub.losses.get(group, 0) if self.hub else 0
        self.joined_at = asyncio.get_running_loop().time()

    async def _leave(self, groups: list[str]) -> None:
        for group in list(groups):
            if group in self.live_groups:
                self.live_groups.remove(group)
            if self.hub is not None:
                await self.hub.leave(group, self)

    async def authorise(self) -> list[str] | None:
        """The groups ``self.user`` may hear; ``None`` refuses the connection."""
        return await database_sync_to_async(self.groups_for)(self.user)

    def groups_for(self, user: AbstractBaseUser) -> list[str] | None:
        """The groups ``user`` may hear on this socket, read from the database now (on Channels'
        database thread); ``None`` when it may hear nothing here."""
        raise NotImplementedError

    @classmethod
    def groups_for_many(cls, sockets: list[tuple[LiveConsumer, AbstractBaseUser]]) -> list[list[str] | None]:
        """``groups_for`` of many sockets of this class at once (on the database thread); a
        class whose access query can be made once for all its sockets overrides this."""
        return [socket.groups_for(user) for socket, user in sockets]

    def allowed(self, event: str, data: dict[str, Any]) -> bool:
        return True

    def hear(self, message: dict[str, Any]) -> None:
        """One event of a group this socket listens to, handed over by the hub."""
        if message.get("type") != "live.event" or not self.hearing:
            return
        event, data = message["event"], message["data"]
        if not self.allowed(event, data):
            return
        self._fold(event, data)
        if self.flusher is None and (self.jobs or self.nodes or self.new_jobs):
            loop = asyncio.get_running_loop()
            due = max(loop.time() + self.settle_s, self.sent_at + self.flush_s)
            self.flusher = asyncio.ensure_future(self._flush_at(due))

    def _fold(self, event: str, data: dict[str, Any]) -> None:
        """Fold one event into the pending delta: a later state of an id replaces an earlier one."""
        if event == "JobStateChanged":
            self.jobs[data["job_id"]] = data["to_state"]
        elif event in ("JobsChanged", "JobsScheduled", "JobsSubmitted"):
            state = {"JobsScheduled": "SCHEDULED", "JobsSubmitted": "PENDING"}.get(
                event, data.get("to_state")
            )
            for job_id in data["job_ids"]:
                self.jobs[job_id] = state
            if event == "JobsSubmitted":
                self.new_jobs += data["count"]
        elif event == "NodeStateChanged":
            self.nodes[data["node_id"]] = data["to_state"]
        elif event == "NodesStateChanged":
            for node_id in data["node_ids"]:
                self.nodes[node_id] = data["to_state"]

    async def _settle(self, user: AbstractBaseUser | None, groups: list[str] | None) -> int | None:
        """Act on a recheck's reading (the session's user read afresh, and the groups it may
        hear): join and leave groups to match. Returns the close code when the socket must
        close, None when it may stay."""
        if user is None:
            return SIGNED_OUT
        self.user = user  # access was decided with what the database says now
        if groups is None:
            return NOT_FOUND
        await self._leave([g for g in self.live_groups if g not in groups])
        joining = [g for g in groups if g not in self.live_groups]
        if joining:
            await self._join(joining)
        if await self._groups_lost():
            return REDIS_LOST
        if asyncio.get_running_loop().time() - self.joined_at >= self.rejoin_s:
            await self._join(groups)
        return None

    async def _groups_lost(self) -> bool:
        """Whether Redis has lost this socket's groups (flushed, restarted) or events meant for it
        (a receive failed since it joined). False while Redis cannot be asked: the socket stays
        open and the next recheck asks again."""
        layer = self.hub and self.hub.layer
        if not hasattr(layer, "is_member") or not self.live_groups:  # the in-memory layer loses nothing
            return False
        first = self.live_groups[0]
        if self.hub.losses.get(first, 0) != self.losses_seen.get(first, 0):
            log.info("live socket on %s: another socket's join found the membership lost", first)
            return True
        try:
            member = await self.hub.is_member(first)
        except LAYER_ERRORS:
            return False
        missed = layer.faults - self.faults_seen
        if not member:
            log.info("live socket on %s: Redis no longer has this process in the group", first)
        elif missed:
            log.info("live socket on %s: %d receives failed since it joined", first, missed)
        return not member or missed != 0

    async def _shut(self, code: int) -> None:
        """Close after a recheck: stop hearing first, so nothing pending, and nothing arriving,
        is sent once access is gone."""
        self.warden.forget(self)
        self.hearing = False
        if self.flusher is not None:
            self.flusher.cancel()
        self.jobs, self.nodes, self.new_jobs = {}, {}, 0
        await self.close(code=code)
        await self._stop_listening()  # not only once the client has answered the close

    async def _flush_at(self, due: float) -> None:
        """Send the pending delta at loop time ``due``; events folded in meanwhile go with it."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(due - loop.time(), 0))
        delta = {"type": "delta", "jobs": self.jobs, "nodes": self.nodes, "newJobs": self.new_jobs}
        self.jobs, self.nodes, self.new_jobs = {}, {}, 0
        # Cleared before the send: an event that arrives while it is written waits for the next one.
        self.flusher, self.sent_at = None, loop.time()
        await self.send_json(delta)


class JobsConsumer(LiveConsumer):
    """``/ws/jobs/``: every job of the projects the user belongs to (operators: all)."""

    def groups_for(self, user: AbstractBaseUser) -> list[str] | None:
        return self.groups_for_many([(self, user)])[0]

    @classmethod
    def groups_for_many(cls, sockets: list[tuple[LiveConsumer, AbstractBaseUser]]) -> list[list[str] | None]:
        visible = visible_project_ids([user for _, user in sockets])
        out: list[list[str] | None] = []
        for socket, user in sockets:
            socket.projects = visible[user.pk]
            out.append([f"project.{p}" for p in sorted(socket.projects)])
        return out

    def allowed(self, event: str, data: dict[str, Any]) -> bool:
        return data.get("project_id") in self.projects


class JobConsumer(LiveConsumer):
    """``/ws/jobs/<id>/``: one job, for those who may open its page."""

    def groups_for(self, user: AbstractBaseUser) -> list[str] | None:
        job_id = int(self.scope["url_route"]["kwargs"]["job_id"])
        project = _job_project(user, job_id)
        if project is None:
            return None
        self.job_id, self.project = job_id, project
        return [f"job.{job_id}", f"project.{project}"]

    def allowed(self, event: str, data: dict[str, Any]) -> bool:
        if data.get("project_id") != self.project:
            return False
        return data.get("job_id") == self.job_id or self.job_id in (data.get("job_ids") or ())


class FleetConsumer(LiveConsumer):
    """``/ws/fleet/``: node state changes across the fleet (nodes are not project data)."""

    def groups_for(self, user: AbstractBaseUser) -> list[str] | None:
        return ["fleet"]

    def allowed(self, event: str, data: dict[str, Any]) -> bool:
        return event in ("NodeStateChanged", "NodesStateChanged")


class ClusterConsumer(LiveConsumer):
    """``/ws/clusters/<name>/``: one cluster's node state changes."""

    def groups_for(self, user: AbstractBaseUser) -> list[str] | None:
        name = self.scope["url_route"]["kwargs"]["name"]
        cluster = cluster_by_name(name)
        if cluster is None:
            return None
        self.cluster_id = cluster.pk
        return [f"cluster.{cluster.pk}"]

    def allowed(self, event: str, data: dict[str, Any]) -> bool:
        return data.get("cluster_id") == self.cluster_id


def _job_project(user: Any, job_id: int) -> int | None:
    from django.http import Http404

    try:
        return access_job(user, job_id).project_id
    except Http404:
        return None


def _session_user(session_key: str | None) -> AbstractBaseUser | None:
    """The active user whom the session ``session_key`` still signs in (``_session_users`` of
    one key)."""
    return _session_users([session_key]).get(session_key) if session_key else None


def _session_users(session_keys: list[str]) -> dict[str, AbstractBaseUser | None]:
    """For each session key, the active user whom that session still signs in, read afresh from
    the session store and the database; None when the session is gone (logged out, expired), its
    auth hash no longer matches the user's (password changed), or the user is inactive or gone.

    The same checks as ``django.contrib.auth.get_user``, but read-only: a socket never flushes
    or cycles a session (a hash matching a ``SECRET_KEY_FALLBACKS`` key still counts, and the
    next HTTP request rotates it). With database sessions and the model backend, two queries
    however many keys: the session rows and the user rows."""
    found: dict[str, AbstractBaseUser | None] = dict.fromkeys(session_keys)
    wanted: dict[str, list[tuple[str, Any, str]]] = {}  # backend → (session key, user id, hash)
    for key, session in _sessions(session_keys).items():
        try:
            user_id = get_user_model()._meta.pk.to_python(session[SESSION_KEY])
            backend_path = session[BACKEND_SESSION_KEY]
        except (KeyError, ValidationError):
            continue
        if backend_path in settings.AUTHENTICATION_BACKENDS and session.get(HASH_SESSION_KEY):
            wanted.setdefault(backend_path, []).append((key, user_id, session[HASH_SESSION_KEY]))
    for backend_path, sessions in wanted.items():
        users = _users(load_backend(backend_path), {user_id for _, user_id, _ in sessions})
        for key, user_id, stored in sessions:
            user = users.get(user_id)
            if user is None or not getattr(user, "is_active", True):
                continue
            hashes = [user.get_session_auth_hash(), *user.get_session_auth_fallback_hash()]
            if any(constant_time_compare(stored, h) for h in hashes):
                found[key] = user
    return found


def _sessions(session_keys: list[str]) -> dict[str, dict[str, Any]]:
    """The data of each live session among ``session_keys``: one query for database-backed
    sessions (``cached_db`` too: the database is their record), one read per key otherwise."""
    store = import_module(settings.SESSION_ENGINE).SessionStore
    if store in (DatabaseSessionStore, CachedDatabaseSessionStore):
        rows = store.get_model_class().objects.filter(
            session_key__in=session_keys, expire_date__gt=timezone.now()
        )
        return {key: _decoded(store, data) for key, data in rows.values_list("session_key", "session_data")}
    return {key: store(key).load() for key in session_keys}


@functools.lru_cache(maxsize=20_000)
def _decoded(store: type, data: str) -> dict[str, Any]:
    """A session row's data decoded (its signature checked), kept for as long as the row holds
    the same text: a socket's session rarely changes between rechecks, and decoding is most of
    a batch's work (80 µs a session). Read only: callers never change the dict."""
    return store().decode(data)


def _users(backend: Any, user_ids: set[Any]) -> dict[Any, AbstractBaseUser]:
    """The users of ``user_ids`` the backend would sign in (``get_user``): one query with the
    model backend, one call per user with any other."""
    if type(backend).get_user is ModelBackend.get_user:  # the model backend's own lookup
        rows = get_user_model()._default_manager.filter(pk__in=user_ids)
        return {user.pk: user for user in rows if backend.user_can_authenticate(user)}
    return {user_id: user for user_id in user_ids if (user := backend.get_user(user_id)) is not None}


Reading = tuple[AbstractBaseUser | None, list[str] | None]  # a socket's user read afresh, its groups


def _read_access(sockets: list[LiveConsumer]) -> list[Reading | None]:
    """What a recheck of ``sockets`` reads, on the database thread: each socket's session user
    read afresh (None when it no longer signs in this socket's user) and the groups it may
    hear (None when nothing here); None for a socket whose access could not be read. A few
    queries for all the sockets of a process, not three per socket: the sessions, the users,
    and each kind of socket's access query."""
    users = _session_users(sorted({socket.session_key for socket in sockets if socket.session_key}))
    read: dict[int, Reading | None] = {}
    by_kind: dict[type[LiveConsumer], list[tuple[LiveConsumer, AbstractBaseUser]]] = {}
    for socket in sockets:
        user = users.get(socket.session_key) if socket.session_key else None
        if user is None or user.pk != socket.user.pk:
            read[id(socket)] = (None, None)
        else:
            by_kind.setdefault(type(socket), []).append((socket, user))
    for kind, members in by_kind.items():
        try:
            decided = kind.groups_for_many(members)
        except Exception:  # this kind's access query failed: its sockets close (4500), not the rest
            log.exception("live socket recheck failed for %s", kind.__name__)
            decided = None
        for i, (socket, user) in enumerate(members):
            read[id(socket)] = None if decided is None else (user, decided[i])
    return [read[id(socket)] for socket in sockets]


class Warden:
    """Re-authorises every open socket of a process (of its event loop) every ``recheck_s``, in
    batches: the sockets due — and those due within the next third of an interval, checked a
    little early — are read in one trip to Channels' database thread (``_read_access``), then
    each acts on its reading. A thousand open sockets cost about one trip and a handful of
    queries a second, instead of 333 trips and a thousand queries. The first check of each
    socket is spread at random over one interval; checks early by up to a third of an interval
    draw the sockets into a few batches per interval.

    A batch whose reading fails (the database is down) closes each of its sockets with 4500:
    access is never assumed."""

    def __init__(self) -> None:
        self.due: dict[LiveConsumer, float] = {}  # socket → loop time of its next check
        self.task: asyncio.Task | None = None

    def watch(self, socket: LiveConsumer) -> None:
        loop = asyncio.get_running_loop()
        self.due[socket] = loop.time() + random.uniform(0, socket.recheck_s)
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._run())

    def forget(self, socket: LiveConsumer) -> None:
        self.due.pop(socket, None)

    async def _run(self) -> None:
        while self.due:
            try:
                await self._pass()
            except Exception:  # the warden outlives any one batch: a socket never goes unchecked
                log.exception("live socket rechecks: a batch failed")
                await asyncio.sleep(1.0)

    async def _pass(self) -> None:
        """Wait for the next socket due (there is one), then recheck it and those due soon after
        it."""
        loop = asyncio.get_running_loop()
        tick = min(socket.recheck_s for socket in self.due) / 3
        await asyncio.sleep(max(min(self.due.values()) - tick - loop.time(), 0.01))
        now = loop.time()
        batch = [socket for socket, due in self.due.items() if due <= now + socket.recheck_s / 3]
        if not batch:
            return
        for socket in batch:
            self.due[socket] = now + socket.recheck_s
        # Neither the reading nor a socket's joins and probes may hold the others up for longer
        # than an interval: past that, the socket closes (4500) rather than go unchecked.
        limit = max(min(socket.recheck_s for socket in batch), 1.0)
        try:
            read = database_sync_to_async(_read_access)(batch)
            readings: list[Reading | None] = await asyncio.wait_for(read, limit)
        except Exception:  # fail closed: no socket stays open on an access decision not made
            log.exception("live socket recheck failed; closing %d sockets", len(batch))
            readings = [None] * len(batch)
        await asyncio.gather(
            *(self._settle(socket, reading, limit) for socket, reading in zip(batch, readings, strict=True))
        )

    async def _settle(self, socket: LiveConsumer, reading: Reading | None, limit: float) -> None:
        if socket not in self.due:  # closed while its reading was made
            return
        try:
            code = (
                RECHECK_FAILED if reading is None else await asyncio.wait_for(socket._settle(*reading), limit)
            )
        except Exception:
            log.exception("live socket recheck failed; closing")
            code = RECHECK_FAILED
        if code is not None:
            try:
                await socket._shut(code)
            except Exception:  # the connection is already gone
                log.warning("live socket not closed cleanly", exc_info=True)


_wardens: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Warden] = weakref.WeakKeyDictionary()


def warden() -> Warden:
    """This event loop's warden."""
    loop = asyncio.get_running_loop()
    if loop not in _wardens:
        _wardens[loop] = Warden()
    return _wardens[loop]
