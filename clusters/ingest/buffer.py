"""The heartbeat buffer: where ingest writes and the aggregator reads. Latest report wins.

One interface, two implementations with one contract (``tests/clusters/test_buffer.py`` runs
the same suite on both):

* ``RedisBuffer`` when ``REDIS_URL`` is set — every API process and the aggregator share it;
  a report costs one Redis round trip (a Lua script that also refuses stale reports);
* ``MemoryBuffer`` in the embedded default — one process serves and aggregates.

Per node the buffer keeps the latest record, its slim summary (``records.summarise``: what the
aggregator reads every pass), its ``(boot_id, seq)``, and a *dirty* mark.
``put`` refuses a report whose ``seq`` is not above the last accepted one of the same boot
(a replay or a late duplicate) and counts it. ``take_dirty`` hands the aggregator the latest
record of every node reported since the last take, atomically with clearing the marks;
``restore`` puts marks back when a pass fails, so a failed pass loses nothing.

Redis is a cache here, PostgreSQL the truth: when Redis cannot be reached ``put`` raises
``BufferUnavailable`` (ingest answers 503 with Retry-After and the agents report again), and
a Redis that comes back empty (restarted, flushed) only loses reports that the next heartbeat
of every node replaces.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any, Protocol

import orjson
from django.conf import settings

from clusters.ingest.records import summarise

Record = dict[str, Any]
MAX_SEQ = 2**53  # Lua numbers are doubles: keep seq exact
log = logging.getLogger(__name__)


class BufferUnavailable(Exception):
    """The buffer's store cannot be reached; nothing of the report was stored."""


class HeartbeatBuffer(Protocol):
    def put(self, records: list[Record]) -> tuple[int, int]:
        """Store records; returns ``(accepted, stale)``."""

    def take_dirty(self) -> list[Record]:
        """The latest summary of each node reported since the last take; clears their marks."""

    def restore(self, node_ids: Iterable[int]) -> None:
        """Mark nodes dirty again (their latest record will be handed out by the next take)."""

    def latest(self, node_ids: Iterable[int] | None = None) -> dict[int, Record]:
        """The latest record of the given nodes (all nodes when None)."""

    def counters(self) -> dict[str, int]:
        """``accepted`` and ``stale`` report counts since the buffer was created."""

    def clear(self) -> None:
        """Forget everything (tests, and operators resetting a fleet)."""


class MemoryBuffer:
    """The in-process buffer of the embedded default."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: dict[int, Record] = {}
        self._slim: dict[int, Record] = {}
        self._seq: dict[int, tuple[str, int]] = {}
        self._dirty: set[int] = set()
        self._counts = {"accepted": 0, "stale": 0}

    def put(self, records: list[Record]) -> tuple[int, int]:
        accepted = stale = 0
        with self._lock:
            for record in records:
                node, boot, seq = record["n"], record["b"], record["q"]
                last = self._seq.get(node)
                if last is not None and last[0] == boot and seq <= last[1]:
                    stale += 1
                    continue
                self._seq[node] = (boot, seq)
                self._latest[node] = record
                self._slim[node] = summarise(record)
                self._dirty.add(node)
                accepted += 1
            self._counts["accepted"] += accepted
            self._counts["stale"] += stale
        return accepted, stale

    def take_dirty(self) -> list[Record]:
        with self._lock:
            taken, self._dirty = self._dirty, set()
            return [self._slim[n] for n in taken if n in self._slim]

    def restore(self, node_ids: Iterable[int]) -> None:
        with self._lock:
            self._dirty.update(n for n in node_ids if n in self._latest)

    def latest(self, node_ids: Iterable[int] | None = None) -> dict[int, Record]:
        with self._lock:
            if node_ids is None:
                return dict(self._latest)
            return {n: self._latest[n] for n in node_ids if n in self._latest}

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def clear(self) -> None:
        with self._lock:
            self._latest.clear()
            self._slim.clear()
            self._seq.clear()
            self._dirty.clear()
            self._counts = {"accepted": 0, "stale": 0}


_PUT = """
local accepted, stale = 0, 0
for i = 1, #ARGV, 5 do
  local id, boot, seq, body = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 3]
  local last = redis.call('HGET', KEYS[1], id)
  local fresh = true
  if last then
    local sep = string.find(last, '|', 1, true)
    if string.sub(last, 1, sep - 1) == boot and seq <= tonumber(string.sub(last, sep + 1)) then
      fresh = false
    end
  end
  if fresh then
    redis.call('HSET', KEYS[1], id, boot .. '|' .. ARGV[i + 2])
    redis.call('HSET', KEYS[2], id, body)
    redis.call('HSET', KEYS[5], id, ARGV[i + 4])
    redis.call('SADD', KEYS[3], id)
    accepted = accepted + 1
  else
    stale = stale + 1
  end
end
if accepted > 0 then redis.call('HINCRBY', KEYS[4], 'accepted', accepted) end
if stale > 0 then redis.call('HINCRBY', KEYS[4], 'stale', stale) end
return {accepted, stale}
"""

_CHUNK = 2000


class RedisBuffer:
    """The shared buffer: hashes ``seq`` and ``latest`` and a set ``dirty`` under one prefix."""

    def __init__(self, url: str, prefix: str = "orrery:hb:") -> None:
        import redis

        # Bounded waits: a Redis host that vanishes must cost a request seconds, not a hang.
        self._redis = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
        self._keys = [f"{prefix}{k}" for k in ("seq", "latest", "dirty", "counters", "slim")]
        self._taking = f"{prefix}taking"
        self._put = self._redis.register_script(_PUT)

    def put(self, records: list[Record]) -> tuple[int, int]:
        args: list[Any] = []
        for record in records:
            args += [
                record["n"],
                record["b"],
                record["q"],
                orjson.dumps(record),
                orjson.dumps(summarise(record)),
            ]
        import redis

        try:
            accepted, stale = self._put(keys=self._keys, args=args)
        except redis.RedisError as exc:
            log.warning("heartbeat buffer unavailable: %s", exc)
            raise BufferUnavailable(str(exc)) from exc
        return int(accepted), int(stale)

    def take_dirty(self) -> list[Record]:
        import redis

        dirty, slim = self._keys[2], self._keys[4]
        # RENAME is atomic: reports arriving from now on mark the fresh set, not the one we read.
        try:
            self._redis.rename(dirty, self._taking)
        except redis.ResponseError:  # no such key: nothing reported since the last take
            return []
        ids = [int(i) for i in self._redis.smembers(self._taking)]
        records = self._hmget(slim, ids)
        self._redis.delete(self._taking)
        return list(records.values())

    def restore(self, node_ids: Iterable[int]) -> None:
        ids = list(node_ids)
        if ids:
            self._redis.sadd(self._keys[2], *ids)

    def latest(self, node_ids: Iterable[int] | None = None) -> dict[int, Record]:
        if node_ids is None:
            return {int(k): orjson.loads(v) for k, v in self._redis.hgetall(self._keys[1]).items()}
        return self._hmget(self._keys[1], list(node_ids))

    def _hmget(self, key: str, ids: list[int]) -> dict[int, Record]:
        out: dict[int, Record] = {}
        pipe = self._redis.pipeline(transaction=False)
        chunks = [ids[i : i + _CHUNK] for i in range(0, len(ids), _CHUNK)]
        for chunk in chunks:
            pipe.hmget(key, chunk)
        for chunk, values in zip(chunks, pipe.execute(), strict=True):
            out.update({n: orjson.loads(v) for n, v in zip(chunk, values, strict=True) if v is not None})
        return out

    def counters(self) -> dict[str, int]:
        raw = self._redis.hgetall(self._keys[3])
        return {"accepted": int(raw.get(b"accepted", 0)), "stale": int(raw.get(b"stale", 0))}

    def clear(self) -> None:
        self._redis.delete(*self._keys, self._taking)


_buffer: HeartbeatBuffer | None = None
_buffer_lock = threading.Lock()


def get_buffer() -> HeartbeatBuffer:
    """The process's buffer: Redis when ``REDIS_URL`` is set, in-process otherwise."""
    global _buffer
    if _buffer is None:
        with _buffer_lock:
            if _buffer is None:
                if settings.REDIS_URL:
                    _buffer = RedisBuffer(settings.REDIS_URL, settings.ORRERY_REDIS_PREFIX + "hb:")
                else:
                    _buffer = MemoryBuffer()
    return _buffer
