"""Flow control on agent ingest: push back with a Retry-After instead of queuing without bound.

Two refusals, both answered before any work is done, both with a suggested wait:

* ``429`` when this process already serves ``ORRERY_INGEST_MAX_IN_FLIGHT`` agent requests:
  the spare server threads answer at once instead of piling more requests onto a slow
  database or Redis. Set it below the server's threads per process (gunicorn ``--threads``);
  Django's ASGI handler runs sync views one at a time, so there it never bites;
* ``503`` when the heartbeat buffer (Redis) or the database cannot be reached: the control
  plane cannot take the report now, and nothing was stored.

The buffer itself cannot fall behind without bound: it keeps the latest report of each node
(latest wins), so a slow flush costs staleness, never memory. Refusing heartbeats because the
flush is behind would only make the control plane hear less, so it is not a reason to refuse.

The suggested wait is ``ORRERY_INGEST_RETRY_AFTER_S`` plus up to as much again, drawn at
random per answer, so that a fleet refused at once does not come back at once.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from django.conf import settings


def retry_after() -> int:
    """Seconds a refused client should wait: the base plus up to as much again of jitter."""
    base = max(int(settings.ORRERY_INGEST_RETRY_AFTER_S), 1)
    return base + random.randint(0, base)


class InFlight:
    """Counts this process's agent requests being served."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    @contextmanager
    def slot(self) -> Iterator[bool]:
        """Yields whether the request may be served (a slot was free); frees it after."""
        with self._lock:
            taken = self.count < settings.ORRERY_INGEST_MAX_IN_FLIGHT
            if taken:
                self.count += 1
        try:
            yield taken
        finally:
            if taken:
                with self._lock:
                    self.count -= 1


in_flight = InFlight()
