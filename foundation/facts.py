"""Facts kept per process between the changes that make them stale, checked on every request.

Some facts are read by every job submission and change a few times a day: the GPU catalog, the
clusters' kinds and identities, users' POSIX accounts, which projects have GPU-hour budgets. On
PostgreSQL a statement trigger on each table they come from gives the one row of
``clusters_fleet_facts`` a new ``generation`` — a random 62-bit value, so never one seen before,
not after a rollback nor after a restore — in the transaction that changes them: a new
generation becomes visible exactly when the change does (migrations ``clusters.0013`` and
``scheduling.0011``).

A request that has read the generation (the submission fast path reads it in the same query as
its bearer token) runs under ``at_generation``, and ``kept()`` is then this process's memo for
that generation; the memos of the two latest generations seen are kept, so a long request still
on the older one does not empty the newer one's. Whatever a caller keeps there it must read
after the generation was read, so nothing is kept under a generation newer than itself. Outside
``at_generation`` (SQLite, the Django views, workers) ``kept()`` is None and callers read the
database as they always did.

What a request uses is what was true when it read the generation: a change that commits while
a request is being served (a mapping removed, a budget added) applies from the next request on,
as if it had committed a moment later.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

GENERATION_SQL = "SELECT generation FROM clusters_fleet_facts WHERE id = 1"
_KEPT = 2  # generations whose memos a process keeps

_generation: ContextVar[int | None] = ContextVar("orrery_facts_generation", default=None)
_memos: dict[int, dict[str, Any]] = {}
_lock = threading.Lock()


@contextmanager
def at_generation(generation: int | None) -> Iterator[None]:
    """Inside the block, ``kept()`` is the memo of ``generation`` (read just now from
    ``clusters_fleet_facts``); None keeps nothing."""
    token = _generation.set(generation)
    try:
        yield
    finally:
        _generation.reset(token)


def kept() -> dict[str, Any] | None:
    """This process's memo for the generation the current request read, or None outside
    ``at_generation``. Callers key it by what they keep and bound what they put in it."""
    generation = _generation.get()
    if generation is None:
        return None
    memo = _memos.get(generation)
    if memo is None:
        with _lock:
            memo = _memos.get(generation)
            if memo is None:
                while len(_memos) >= _KEPT:
                    del _memos[next(iter(_memos))]  # the one seen first
                memo = _memos[generation] = {}
    return memo
