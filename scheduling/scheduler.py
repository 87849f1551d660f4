"""The process's scheduler: its cache, built once per process and kept current by each cycle."""

from __future__ import annotations

import threading

from scheduling.cache import SchedulerCache

_cache: SchedulerCache | None = None
_lock = threading.Lock()


def scheduler_cache() -> SchedulerCache:
    global _cache
    with _lock:
        if _cache is None:
            _cache = SchedulerCache()
        return _cache
