"""Publishing live events to websocket subscribers through the channel layer.

The lowest layer owns this helper so every app can publish without importing the portal.
Publishing is best-effort by design: the database is the record, a lost live message only
delays a dashboard until its next resynchronisation from REST.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

log = logging.getLogger(__name__)


def publish(groups: list[str], event: Any) -> None:
    """Send a frozen-dataclass event to each channel-layer group, now."""
    layer = get_channel_layer()
    if layer is None:
        return
    payload = {"type": "live.event", "event": type(event).__name__, "data": dataclasses.asdict(event)}
    for group in groups:
        try:
            async_to_sync(layer.group_send)(group, payload)
        except Exception:  # a dashboard must never break a write path
            log.warning("live event %s to %s not delivered", payload["event"], group, exc_info=True)


def publish_on_commit(groups: list[str], event: Any, using: str | None = None) -> None:
    """Send the event once the surrounding transaction commits (never for a rolled-back write)."""
    transaction.on_commit(lambda: publish(groups, event), using=using)
