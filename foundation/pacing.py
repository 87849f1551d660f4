"""Work on its own interval under a faster beat: each periodic pass asks ``due(key, every_s)``,
and only the passes that find the interval over do the work. The last time is kept in the
default cache (Redis when configured), so every worker process shares it."""

from __future__ import annotations

import time

from django.core.cache import cache

# Slack so that a beat of one second does not skip every other turn of a two-second interval.
SLACK_S = 0.5


def due(key: str, every_s: float, now: float | None = None) -> bool:
    """Whether ``every_s`` has passed since the last pass under ``key``; if so, this pass is
    recorded as the last one."""
    now = time.time() if now is None else now
    last = cache.get(key)
    if last is not None and now - last < every_s - SLACK_S:
        return False
    cache.set(key, now, 3600)
    return True
