"""The cache backend of production: Django's Redis cache, made to degrade rather than fail.

Redis is a cache here; PostgreSQL holds the truth. Nothing kept in this cache is needed for
correctness — per-node desired lists (rebuilt from the database on a miss), capacity
histograms, the console's recent cycles, rate-limit counters, wake-up doorbells (the periodic
passes cover a doorbell that does not ring), inventory pacing — so while Redis cannot be
reached a read is a miss, a write is dropped, and ``add`` reports the key as taken (a doorbell
stays silent rather than ringing twice). One warning is logged per outage, and every failed
call is counted in ``orrery_cache_unavailable_total``; the next call after Redis answers again
uses it as before.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from django.core.cache.backends.redis import RedisCache
from prometheus_client import Counter
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)
UNAVAILABLE = Counter("orrery_cache_unavailable_total", "Cache calls answered without Redis (unreachable).")
_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)
_QUIET_S = 60.0  # at most one warning a minute while Redis stays away


class ForgivingRedisCache(RedisCache):
    """``RedisCache`` whose calls never raise because Redis is unreachable (see the module)."""

    _warned_at = 0.0
    _lock = threading.Lock()

    def __init__(self, server: str, params: dict[str, Any]) -> None:
        options = dict(params.get("OPTIONS") or {})
        # A Redis host that vanished costs a second or two, not the OS's minutes-long connect.
        options.setdefault("socket_connect_timeout", 2)
        options.setdefault("socket_timeout", 5)
        super().__init__(server, {**params, "OPTIONS": options})

    def _away(self, what: str, exc: BaseException, answer: Any) -> Any:
        UNAVAILABLE.inc()
        now = time.monotonic()
        with self._lock:
            quiet = now - ForgivingRedisCache._warned_at < _QUIET_S
            if not quiet:
                ForgivingRedisCache._warned_at = now
        if not quiet:
            log.warning("cache (Redis) unreachable, running without it: %s failed: %s", what, exc)
        return answer

    def get(self, key: Any, default: Any = None, version: int | None = None) -> Any:
        try:
            return super().get(key, default, version)
        except _DOWN as exc:
            return self._away("get", exc, default)

    def get_many(self, keys: Any, version: int | None = None) -> dict[Any, Any]:
        try:
            return super().get_many(keys, version)
        except _DOWN as exc:
            return self._away("get_many", exc, {})

    def has_key(self, key: Any, version: int | None = None) -> bool:
        try:
            return super().has_key(key, version)
        except _DOWN as exc:
            return self._away("has_key", exc, False)

    def add(self, key: Any, value: Any, timeout: Any = ..., version: int | None = None) -> bool:
        kwargs = {} if timeout is ... else {"timeout": timeout}
        try:
            return super().add(key, value, version=version, **kwargs)
        except _DOWN as exc:
            return self._away("add", exc, False)

    def set(self, key: Any, value: Any, timeout: Any = ..., version: int | None = None) -> None:
        kwargs = {} if timeout is ... else {"timeout": timeout}
        try:
            super().set(key, value, version=version, **kwargs)
        except _DOWN as exc:
            self._away("set", exc, None)

    def set_many(self, data: dict[Any, Any], timeout: Any = ..., version: int | None = None) -> list[Any]:
        kwargs = {} if timeout is ... else {"timeout": timeout}
        try:
            return super().set_many(data, version=version, **kwargs)
        except _DOWN as exc:
            return self._away("set_many", exc, list(data))

    def touch(self, key: Any, timeout: Any = ..., version: int | None = None) -> bool:
        kwargs = {} if timeout is ... else {"timeout": timeout}
        try:
            return super().touch(key, version=version, **kwargs)
        except _DOWN as exc:
            return self._away("touch", exc, False)

    def delete(self, key: Any, version: int | None = None) -> bool:
        try:
            return super().delete(key, version)
        except _DOWN as exc:
            return self._away("delete", exc, False)

    def delete_many(self, keys: Any, version: int | None = None) -> None:
        try:
            super().delete_many(keys, version)
        except _DOWN as exc:
            self._away("delete_many", exc, None)

    def incr(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        try:
            return super().incr(key, delta, version)
        except _DOWN as exc:
            # As for a missing key: the caller's ValueError path (rate limits start afresh).
            self._away("incr", exc, None)
            raise ValueError(f"Key '{key}' not found (cache unreachable)") from exc

    def set_add(self, key: Any, member: str, timeout: int) -> bool:
        """Add ``member`` to the Redis set at ``key`` (kept ``timeout`` seconds from now); False
        when Redis is away."""
        name = self.make_and_validate_key(key)
        try:
            client = self._cache.get_client(name, write=True)
            client.pipeline().sadd(name, member).expire(name, timeout).execute()
            return True
        except _DOWN as exc:
            return self._away("set_add", exc, False)

    def set_take(self, key: Any) -> set[str] | None:
        """Every member of the set at ``key``, which is emptied in the same step (another taker
        gets none of them); None when Redis is away."""
        name = self.make_and_validate_key(key)
        try:
            client = self._cache.get_client(name, write=True)
            members, _ = client.pipeline(transaction=True).smembers(name).delete(name).execute()
            return {m.decode() if isinstance(m, bytes) else str(m) for m in members}
        except _DOWN as exc:
            return self._away("set_take", exc, None)
