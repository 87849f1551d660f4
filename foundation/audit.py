"""Recording audited actions, and reading them back out.

Every service that changes something on an operator's or a user's request calls ``record``
inside its own transaction: a change that rolls back leaves no entry, and a change never commits
without one. Where the request came from is not passed along through every layer: the web
middleware (``portal.middleware.AuditSource``) sets it for the duration of a request, and
``manage.py`` sets ``cli`` for its commands; anything else (workers, daemons, the scheduler) is
``system``.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from django.db import transaction

from foundation.choices import AuditAction, AuditSource

_source: ContextVar[str] = ContextVar("orrery_audit_source", default=AuditSource.SYSTEM)
# The credential a request was authenticated with, when it is not a session (``token:orr_ab12``).
_credential: ContextVar[str] = ContextVar("orrery_audit_credential", default="")

# The columns of an export, in order; JSON lines use the same keys.
EXPORT_FIELDS = ["id", "at", "action", "actor_id", "actor_name", "source", "target", "details"]


def set_source(source: str) -> None:
    """Name where the actions of this context come from, for good (``manage.py`` uses it)."""
    _source.set(source)


@contextmanager
def source(value: str) -> Iterator[None]:
    """Name where the actions inside the block come from (a client address, ``cli``…); the
    block starts with no credential named (``set_credential``)."""
    token, credential = _source.set(value), _credential.set("")
    try:
        yield
    finally:
        _source.reset(token)
        _credential.reset(credential)


def set_credential(name: str) -> None:
    """Name the credential (an API token's prefix) the current request acts with; entries
    recorded for the rest of the request carry it as ``details.via``."""
    _credential.set(name)


def current_source() -> str:
    return _source.get()


def record(action: str, *, actor: Any, target: str, details: dict[str, Any] | None = None) -> Any:
    """Append one audit entry for ``action`` on ``target`` (``job:123``, ``cluster:west``…),
    asked for by ``actor`` (a user, or None when nobody in particular asked) from the current
    source; returns it. Must run inside the transaction of the change it records, and raises
    ``RuntimeError`` otherwise: an entry committed on its own could outlive a change that then
    failed. ``details`` must be small and hold no secret."""
    # Imported here, not at the top: manage.py sets the source before Django is set up.
    from foundation.models import AuditEntry

    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError(f"audit.record({action!r}) must run inside the change's transaction")
    user_id = getattr(actor, "pk", None)
    return AuditEntry.objects.create(
        action=AuditAction(action),
        actor_id=user_id,
        actor_name=actor.get_username() if user_id is not None else "",
        source=_source.get(),
        target=target[:255],
        details=(details or {}) | ({"via": via} if (via := _credential.get()) else {}),
    )


def capped(ids: list[int], limit: int = 1000) -> dict[str, Any]:
    """A list of ids as details: the count and at most ``limit`` of them, so a 10,000-task
    array is one small entry, not a megabyte."""
    return {"count": len(ids), "ids": ids[:limit]}


# --- export -----------------------------------------------------------------------------------

_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


class _Line:
    """A file-like object whose ``write`` returns what it was given: lets ``csv.writer`` format
    one row at a time for a streaming response."""

    def write(self, value: str) -> str:
        return value


def _values(entry: Any) -> dict[str, Any]:
    return {
        "id": entry.pk,
        "at": entry.at.isoformat(),
        "action": entry.action,
        "actor_id": entry.actor_id,
        "actor_name": entry.actor_name,
        "source": entry.source,
        "target": entry.target,
        "details": entry.details,
    }


def _cell(value: Any) -> str:
    """One CSV cell. A cell that a spreadsheet would run as a formula (user names and reasons
    are chosen by users) is prefixed with a quote, as OWASP recommends."""
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)  # starts with "{"
    text = "" if value is None else str(value)
    return "'" + text if text.startswith(_FORMULA_START) else text


def export_lines(entries: Iterable[Any], fmt: str) -> Iterator[str]:
    """The entries as CSV (with a header) or JSON lines (``jsonl``), one line at a time: feed it
    ``queryset.iterator()`` and a million rows never sit in memory at once."""
    if fmt == "jsonl":
        for entry in entries:
            yield json.dumps(_values(entry), sort_keys=False) + "\n"
        return
    if fmt != "csv":
        raise ValueError(f"unknown export format {fmt!r}; use csv or jsonl")
    writer = csv.writer(_Line())
    yield writer.writerow(EXPORT_FIELDS)
    for entry in entries:
        values = _values(entry)
        yield writer.writerow([_cell(values[name]) for name in EXPORT_FIELDS])
