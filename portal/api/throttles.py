"""Per-user rate limits (DRF throttling on the default cache: Redis when configured, so the
limit holds across every API process). Over the limit: 429 with ``Retry-After``.

On Redis each scope's log of a user's requests is a sorted set, trimmed, counted and added to by
one script: one round trip a request whatever the rate, and two processes cannot both take the
last request of a window. (DRF's own throttle reads the whole log, a pickled list of up to the
rate's number of timestamps, and writes it back: at 1,200 a minute that is about 11 KB each way
per request, and concurrent requests each count from the same copy.) The answers are DRF's: a
request is refused when the last ``duration`` seconds already hold ``num_requests``, and
``Retry-After`` is the same. Without Redis (the embedded default) DRF's throttle on the cache
answers; while Redis cannot be reached nobody is refused, as ``foundation.cache`` does for every
cached count, and the outage is counted and logged with the cache's."""

from __future__ import annotations

import secrets
from typing import Any

from django.core.cache import caches
from django.core.cache.backends.redis import RedisCache
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rest_framework.throttling import AnonRateThrottle, UserRateThrottle

from portal.lockout import client_address

# KEYS[1] the log; ARGV: now, the oldest time still in the window's past (now - duration), the
# limit, this request's member, the log's lifetime in ms. Returns {allowed, count, oldest}.
_LOG = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
local count = redis.call('ZCARD', KEYS[1])
if count >= tonumber(ARGV[3]) then
    local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    return {0, count, oldest[2] or false}
end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return {1, count + 1, false}
"""


class LoggedRateThrottle:
    """DRF's ``SimpleRateThrottle`` kept in a Redis sorted set (see the module)."""

    rate: Any
    num_requests: int
    duration: int
    timer: Any
    _script: Any = None

    def allow_request(self, request: Any, view: Any) -> bool:
        backend = caches["default"]
        if self.rate is None or not isinstance(backend, RedisCache):
            return super().allow_request(request, view)  # type: ignore[misc]
        self.key = self.get_cache_key(request, view)  # type: ignore[attr-defined]
        if self.key is None:
            return True
        key = backend.make_and_validate_key(f"{self.key}:log")
        self.now = now = self.timer()
        args = [repr(now), repr(now - self.duration), self.num_requests, secrets.token_hex(6)]
        args.append(int(self.duration * 1000))
        try:
            client = backend._cache.get_client(key, write=True)
            if LoggedRateThrottle._script is None:
                LoggedRateThrottle._script = client.register_script(_LOG)
            allowed, self._count, oldest = LoggedRateThrottle._script(keys=[key], args=args, client=client)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            away = getattr(backend, "_away", None)  # counted and warned as the cache's own calls
            return away("throttle", exc, True) if away else True  # a cache away refuses no one
        except RedisError:
            return super().allow_request(request, view)  # type: ignore[misc]
        self._oldest = float(oldest) if oldest else None
        return bool(allowed) or self.throttle_failure()  # type: ignore[attr-defined]

    def get_ident(self, request: Any) -> str:
        """Who an unauthenticated request is: its peer, or the entry a trusted proxy appended
        (``portal.lockout.client_address``) — never what the client wrote in
        ``X-Forwarded-For``, which DRF's own ``get_ident`` takes whole when ``NUM_PROXIES`` is
        unset, so that each new header would have its own budget."""
        return client_address(request) or ""

    def wait(self) -> float | None:
        if not hasattr(self, "_count"):
            return super().wait()  # type: ignore[misc]
        remaining = self.duration - (self.now - self._oldest) if self._oldest is not None else self.duration
        available = self.num_requests - self._count + 1
        return remaining / float(available) if available > 0 else None


class SubmitThrottle(LoggedRateThrottle, UserRateThrottle):
    scope = "submit"


class ReadThrottle(LoggedRateThrottle, UserRateThrottle):
    scope = "read"


class AnonymousThrottle(LoggedRateThrottle, AnonRateThrottle):
    scope = "anon"
