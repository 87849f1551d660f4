"""The fake's etcd and watch cache: objects, the global resourceVersion, history and watchers.

- One global revision counter, like etcd's: every stored change takes the next number.
- Every stored object is immutable; a write stores a new dict. Each version keeps its JSON
  (orjson, computed once) so a LIST of 5,000 nodes or a fan-out to many watchers re-encodes nothing.
- ``log`` keeps every change since the last :meth:`Store.compact` (etcd's history: ``Exact`` reads
  and continue tokens). ``watch_floor`` is the watch cache's horizon: a watch from an older RV gets
  the 410 ERROR event. The two are separate because etcd compaction alone does not expire a watch
  the cache can still serve (recording 036).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import orjson

from tests.kubefake.resources import Resource


class Entry:
    """One stored version of an object (without kind/apiVersion, as a list item) and its JSON."""

    __slots__ = ("_item", "obj", "resource")

    def __init__(self, resource: Resource, obj: dict[str, Any]):
        self.resource = resource
        self.obj = obj
        self._item: bytes | None = None

    @property
    def rv(self) -> int:
        return int(self.obj["metadata"]["resourceVersion"])

    def item_bytes(self) -> bytes:
        if self._item is None:
            self._item = orjson.dumps(self.obj)
        return self._item

    def full_bytes(self) -> bytes:
        """The object as GET and watch events show it: kind and apiVersion first."""
        item = self.item_bytes()
        head = b'{"kind":"%s","apiVersion":"%s"' % (
            self.resource.kind.encode(),
            self.resource.api_version.encode(),
        )
        return head + (b"," + item[1:] if len(item) > 2 else b"}")

    def full(self) -> dict[str, Any]:
        return {"kind": self.resource.kind, "apiVersion": self.resource.api_version, **self.obj}


@dataclass
class Event:
    """A stored change. ``entry`` is the new state (for DELETED: the last state, at the deletion RV)."""

    rv: int
    type: str
    key: str
    namespace: str
    entry: Entry
    old: Entry | None = None
    _line: bytes | None = field(default=None, repr=False)

    def line(self) -> bytes:
        if self._line is None:
            self._line = b'{"type":"%s","object":%s}\n' % (self.type.encode(), self.entry.full_bytes())
        return self._line


class Subscription:
    """A watcher's queue of raw events; the stream applies its own selector."""

    def __init__(self, resource: str, namespace: str):
        self.resource = resource
        self.namespace = namespace
        self.queue: queue.SimpleQueue[Event | None] = queue.SimpleQueue()


class WatchExpired(Exception):
    """A watch asked for an RV older than the watch cache holds."""

    def __init__(self, requested: int, oldest: int):
        super().__init__(f"too old resource version: {requested} ({oldest})")
        self.requested = requested
        self.oldest = oldest


class Store:
    """All objects of the fake, keyed by plural then ``namespace/name`` (or ``name``)."""

    def __init__(self, start_rv: int = 100, watch_cache_size: int = 10_000):
        self.lock = threading.RLock()
        self.rv = start_rv
        self.objects: dict[str, dict[str, Entry]] = {}
        self.log: dict[str, list[Event]] = {}
        self.compacted = 0
        self.watch_cache_size = watch_cache_size
        self.watch_window: dict[str, deque[Event]] = {}
        self.watch_floor: dict[str, int] = {}
        self.subscriptions: list[Subscription] = []

    # -- reads --------------------------------------------------------------------------------
    def get(self, plural: str, key: str) -> Entry | None:
        return self.objects.get(plural, {}).get(key)

    def items(self, plural: str, namespace: str = "") -> list[tuple[str, Entry]]:
        """Current entries sorted by key (etcd order); ``namespace`` narrows a namespaced list."""
        with self.lock:
            objects = self.objects.get(plural, {})
            if namespace:
                prefix = namespace + "/"
                chosen = [(k, e) for k, e in objects.items() if k.startswith(prefix)]
            else:
                chosen = list(objects.items())
        chosen.sort(key=lambda pair: pair[0])
        return chosen

    def items_at(self, plural: str, rv: int, namespace: str = "") -> list[tuple[str, Entry]]:
        """The entries as they were at revision ``rv`` (undoing the logged changes after it)."""
        with self.lock:
            state = dict(self.objects.get(plural, {}))
            for event in reversed(self.log.get(plural, [])):
                if event.rv <= rv:
                    break
                if event.type == "ADDED":
                    state.pop(event.key, None)
                elif event.type == "MODIFIED" and event.old is not None:
                    state[event.key] = event.old
                elif event.type == "DELETED":
                    state[event.key] = event.old or event.entry
        prefix = namespace + "/" if namespace else ""
        chosen = [(k, e) for k, e in state.items() if k.startswith(prefix)]
        chosen.sort(key=lambda pair: pair[0])
        return chosen

    # -- writes -------------------------------------------------------------------------------
    def next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def skip_to(self, rv: int) -> None:
        """Move the revision forward, as other writers (leases, events) move etcd's."""
        with self.lock:
            self.rv = max(self.rv, rv)

    def put(self, resource: Resource, key: str, obj: dict[str, Any], event_type: str) -> Entry:
        """Store ``obj`` (ADDED or MODIFIED) at the next revision; the caller holds the lock."""
        rv = self.next_rv()
        obj["metadata"]["resourceVersion"] = str(rv)
        entry = Entry(resource, obj)
        objects = self.objects.setdefault(resource.plural, {})
        old = objects.get(key)
        objects[key] = entry
        self._record(resource, Event(rv, event_type, key, obj["metadata"].get("namespace", ""), entry, old))
        return entry

    def remove(self, resource: Resource, key: str, last: dict[str, Any]) -> Entry:
        """Remove the object; the DELETED event carries ``last`` stamped with the deletion RV."""
        rv = self.next_rv()
        last["metadata"]["resourceVersion"] = str(rv)
        old = self.objects.get(resource.plural, {}).pop(key, None)
        entry = Entry(resource, last)
        self._record(resource, Event(rv, "DELETED", key, last["metadata"].get("namespace", ""), entry, old))
        return entry

    def _record(self, resource: Resource, event: Event) -> None:
        self.log.setdefault(resource.plural, []).append(event)
        window = self.watch_window.setdefault(resource.plural, deque())
        window.append(event)
        while len(window) > self.watch_cache_size:
            self.watch_floor[resource.plural] = window.popleft().rv
        for subscription in self.subscriptions:
            if subscription.resource == resource.plural and (
                not subscription.namespace or subscription.namespace == event.namespace
            ):
                subscription.queue.put(event)

    # -- history control (tests) ---------------------------------------------------------------
    def compact(self, rv: int | None = None) -> int:
        """etcd compaction: forget every change at or before ``rv`` (default: now)."""
        with self.lock:
            rv = self.rv if rv is None else rv
            self.compacted = max(self.compacted, rv)
            for plural, events in self.log.items():
                self.log[plural] = [e for e in events if e.rv > rv]
            return rv

    def expire_watch_cache(self, plural: str | None = None, rv: int | None = None) -> None:
        """Move the watch cache's horizon to ``rv`` (default: now), as its 75 s window would."""
        with self.lock:
            rv = self.rv if rv is None else rv
            for name in [plural] if plural else list(set(self.objects) | set(self.watch_window)):
                self.watch_floor[name] = max(self.watch_floor.get(name, 0), rv)
                window = self.watch_window.get(name)
                while window and window[0].rv <= rv:
                    window.popleft()

    # -- watch --------------------------------------------------------------------------------
    def subscribe(self, plural: str, namespace: str, since: int | None) -> tuple[list[Event], Subscription]:
        """Register a watcher. ``since`` None: no replay (the caller sends synthetic ADDEDs);
        otherwise the cached events after ``since``, or :class:`WatchExpired`."""
        with self.lock:
            backlog: list[Event] = []
            if since is not None:
                floor = self.watch_floor.get(plural, 0)
                if since < floor:
                    raise WatchExpired(since, floor + 1)
                backlog = [
                    e
                    for e in self.watch_window.get(plural, ())
                    if e.rv > since and (not namespace or e.namespace == namespace)
                ]
            subscription = Subscription(plural, namespace)
            self.subscriptions.append(subscription)
            return backlog, subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        with self.lock:
            if subscription in self.subscriptions:
                self.subscriptions.remove(subscription)

    def close_all(self) -> None:
        with self.lock:
            for subscription in self.subscriptions:
                subscription.queue.put(None)
            self.subscriptions.clear()
