"""The embedded default's stand-in for Celery beat: periodic functions on daemon threads.

Each entry of ``settings.ORRERY_EMBEDDED_TASKS`` is ``(dotted path, interval seconds)``; the
same functions are Celery beat tasks in production. A failing run is logged and retried at the
next tick — one bad pass must not stop the loop.
"""

from __future__ import annotations

import logging
import threading

from django.conf import settings
from django.db import close_old_connections
from django.utils.module_loading import import_string

log = logging.getLogger(__name__)


def start_embedded_timers(stop: threading.Event) -> list[threading.Thread]:
    threads = []
    for path, interval in settings.ORRERY_EMBEDDED_TASKS:
        func = import_string(path)
        thread = threading.Thread(target=_loop, args=(func, path, interval, stop), name=path, daemon=True)
        thread.start()
        threads.append(thread)
    return threads


def _loop(func, path: str, interval: float, stop: threading.Event) -> None:
    while not stop.wait(interval):
        try:
            func()
        except Exception:
            log.exception("periodic task %s failed; retrying in %ss", path, interval)
        finally:
            close_old_connections()
