"""Per-tenant fairness on the API: a tenant's burst must not raise another tenant's latency.

The per-minute rates (``portal/api/throttles.py``) bound how much a user asks for over a minute,
not how much of the server they hold at once: a burst within the rate can occupy every web
worker thread, and everyone else waits behind it. Here each tenant may have at most
``ORRERY_API_TENANT_CONCURRENCY`` requests in flight at once, across every web process; one more
is answered at once with 429, a ``Retry-After`` of 1–3 s (drawn at random, so refused clients do
not all come back in the same second) and the API's error body.

**The tenant is the authenticated user.** The project was considered for job submissions and
left out: it is known only once the body is parsed (a batch may name several), and a slot per
project would let one member's burst hold back the other members of the same project — the
harm this module exists to prevent. What a project may queue is bounded elsewhere
(``ORRERY_MAX_WAITING_JOBS_PER_PROJECT``).

**Slots are leases.** With Redis (``REDIS_URL``), a tenant's slots are the members of one sorted
set scored by their expiry on Redis' own clock, taken and counted in one Lua call. A slot is
given back when its request ends; the slots of a web worker killed mid-request expire after
``ORRERY_API_TENANT_LEASE_S`` (longer than any request may run), so a crash never leaks one for
good — a plain counter with a TTL would, as long as the tenant keeps the key alive. Without
Redis the slots are counted in the process. When Redis does not answer, each process counts on
its own (the limit then holds per process, not across them) and tries Redis again after a
second; losing Redis' slots (a restart, a flush) admits a few more requests for a moment,
never fewer.

Two pieces, both in the settings: ``TenantConcurrency`` (a DRF permission, last in
``DEFAULT_PERMISSION_CLASSES``, so a slot is taken only after authentication and the token's
scope have passed) takes the slot; ``ReleaseTenantSlots`` (a middleware) gives it back when the
response is ready, whatever happened in between.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from prometheus_client import Counter
from rest_framework import exceptions
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

log = logging.getLogger(__name__)

REFUSED = Counter(
    "orrery_api_tenant_refused_total", "API requests refused because their tenant had too many in flight."
)
DEGRADED = Counter(
    "orrery_api_tenant_slots_local_total",
    "Tenant slots counted in the process because Redis did not answer (the limit then holds per process).",
)

RETRY_AFTER_S = (1, 3)  # a slot frees when one request ends: milliseconds, usually
REDIS_RETRY_S = 1.0  # after Redis failed, count locally this long before trying it again
_ATTR = "_orrery_tenant_slots"  # where the middleware keeps a request's slots, on the HttpRequest

# KEYS[1]: the tenant's sorted set; ARGV: limit, lease in ms, slot id. Returns 1 when taken.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


class TenantBusy(exceptions.Throttled):
    """429: the tenant already has as many requests in flight as it may."""

    def __init__(self, limit: int) -> None:
        # DRF adds "Expected available in N seconds." and sets Retry-After from ``wait``.
        super().__init__(
            random.randint(*RETRY_AFTER_S),
            f"Too many of your requests are in progress at once (at most {limit}); send fewer in parallel.",
        )


@dataclass(frozen=True)
class Slot:
    """One request's place among its tenant's in-flight requests."""

    key: str
    lease_id: str
    shared: bool  # held in Redis (else counted in this process)


class LocalSlots:
    """In-flight counts per tenant in this process (no Redis, or Redis not answering)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    def acquire(self, key: str, limit: int) -> bool:
        with self._lock:
            if self._held.get(key, 0) >= limit:
                return False
            self._held[key] = self._held.get(key, 0) + 1
            return True

    def release(self, key: str) -> None:
        with self._lock:
            left = self._held.get(key, 0) - 1
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)


class TenantSlots:
    """Takes and gives back slots: in Redis when configured and answering, else in process.

    ``acquire`` returns a ``Slot``, or None when the tenant is at its limit; ``release`` never
    raises (a slot Redis cannot take back now expires with its lease)."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.local = LocalSlots()
        self.prefix = f"{prefix}api-tenant:"
        self._redis: Any = None
        self._acquire_script: Any = None
        self._redis_back_at = 0.0
        if redis_url:
            import redis

            # Short timeouts: a Redis that hangs must cost a request a fraction of a second once,
            # then nothing for REDIS_RETRY_S, not a stall on every request.
            self._redis = redis.Redis.from_url(redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
            self._acquire_script = self._redis.register_script(_ACQUIRE)

    def acquire(self, tenant: str, limit: int, lease_s: float) -> Slot | None:
        key = f"{self.prefix}{tenant}"
        if self._redis is not None and time.monotonic() >= self._redis_back_at:
            import redis

            lease_id = uuid.uuid4().hex
            try:
                taken = self._acquire_script(keys=[key], args=[limit, int(lease_s * 1000), lease_id])
            except redis.RedisError as exc:
                self._redis_failed(exc)
            else:
                return Slot(key, lease_id, shared=True) if taken else None
        if self._redis is not None:
            DEGRADED.inc()
        return Slot(key, "", shared=False) if self.local.acquire(key, limit) else None

    def release(self, slot: Slot) -> None:
        if not slot.shared:
            self.local.release(slot.key)
            return
        import redis

        try:
            self._redis.zrem(slot.key, slot.lease_id)
        except redis.RedisError as exc:
            self._redis_failed(exc)

    def _redis_failed(self, exc: Exception) -> None:
        if time.monotonic() >= self._redis_back_at:  # one line per outage second, not per request
            log.warning("Tenant slots counted per process for %.0f s: Redis failed (%s)", REDIS_RETRY_S, exc)
        self._redis_back_at = time.monotonic() + REDIS_RETRY_S


_slots: TenantSlots | None = None
_slots_lock = threading.Lock()


def get_slots() -> TenantSlots:
    """This process's ``TenantSlots``, made on first use from the settings."""
    global _slots
    with _slots_lock:
        if _slots is None:
            _slots = TenantSlots(settings.REDIS_URL, settings.ORRERY_REDIS_PREFIX)
        return _slots


def reset_slots() -> None:
    """Forget this process's ``TenantSlots`` (tests that change the Redis settings)."""
    global _slots
    with _slots_lock:
        _slots = None


class TenantConcurrency(BasePermission):
    """Takes one of the user's in-flight slots for the request, or refuses it with 429.

    Idempotent per request (a second check holds no second slot). Anonymous requests hold none:
    ``IsAuthenticated`` refuses them before this runs."""

    def has_permission(self, request: Request, view: Any) -> bool:
        limit = settings.ORRERY_API_TENANT_CONCURRENCY
        user = request.user
        if limit <= 0 or user is None or not user.is_authenticated:
            return True
        held: list[Slot] | None = getattr(request._request, _ATTR, None)
        if held is None:
            raise ImproperlyConfigured(
                "TenantConcurrency needs portal.api.fairness.ReleaseTenantSlots in MIDDLEWARE, "
                "or the slots it takes would never be given back."
            )
        if held:
            return True
        slot = get_slots().acquire(f"user:{user.pk}", limit, settings.ORRERY_API_TENANT_LEASE_S)
        if slot is None:
            REFUSED.inc()
            raise TenantBusy(limit)
        held.append(slot)
        return True


class ReleaseTenantSlots:
    """Gives back the slots ``TenantConcurrency`` took for a request once its response is ready,
    also when the view raised."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        held: list[Slot] = []
        setattr(request, _ATTR, held)
        try:
            return self.get_response(request)
        finally:
            for slot in held:
                get_slots().release(slot)
