"""Whether the control plane can hear its nodes: the heartbeat flush's watermark.

A node is judged silent from its ``NodeLastSeen`` row, which only the heartbeat flush writes.
When the flush stops — Redis, beat, the workers or the database away — every row ages at once
and, when the lifecycle runs again before the flush has caught up, every node looks silent.
So each successful flush is recorded (``record_flush``), and the lifecycle asks ``deafness``
before it judges silence:

* the flush is *behind* when it last succeeded more than ``ORRERY_HEARING_GAP_S`` ago;
* after such a gap the control plane has been *hearing since* the first flush that came back,
  and it judges no silence until it has heard for ``NODE_GRACE``: by then every live node has
  reported at least once.

Both times are taken from the database's clock (``now()``), one clock for every host; a
lifecycle pass run with an injected ``now`` (tests) still asks about the present. Before the
first flush ever recorded there is nothing to measure a gap against, and nothing is paused.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Case, F, When
from django.db.models.functions import Now

from clusters.models import HeartbeatWatermark


def record_flush() -> None:
    """Stamp a successful flush; restart ``hearing_since`` when the last one is too long ago.
    Call it inside the flush's transaction, so the stamp commits with what it flushed."""
    gap = timedelta(seconds=settings.ORRERY_HEARING_GAP_S)
    stamp = {
        "hearing_since": Case(
            When(flushed_at__isnull=True, then=F("hearing_since")),
            When(flushed_at__gte=Now() - gap, then=F("hearing_since")),
            default=Now(),
        ),
        "flushed_at": Now(),
    }
    if HeartbeatWatermark.objects.filter(pk=1).update(**stamp):
        return
    try:
        with transaction.atomic():  # a savepoint: a concurrent first flush may have won
            HeartbeatWatermark.objects.create(pk=1)
    except IntegrityError:
        pass
    HeartbeatWatermark.objects.filter(pk=1).update(**stamp)


def deafness() -> str | None:
    """None while the control plane hears; otherwise why it cannot judge silence now."""
    row = (
        HeartbeatWatermark.objects.filter(pk=1)
        .annotate(db_now=Now())
        .values_list("flushed_at", "hearing_since", "db_now")
        .first()
    )
    if row is None or row[0] is None:
        return None
    flushed_at, hearing_since, now = row
    behind = (now - flushed_at).total_seconds()
    if behind > settings.ORRERY_HEARING_GAP_S:
        return f"no heartbeat flush for {behind:.0f}s"
    if hearing_since is not None:
        heard = (now - hearing_since).total_seconds()
        if heard < settings.NODE_GRACE:
            return f"heartbeat flush back for {heard:.0f}s of the {settings.NODE_GRACE}s grace"
    return None


def forget_hearing() -> None:
    """Drop the watermark (tests, and an operator who knows the gap was nothing)."""
    HeartbeatWatermark.objects.filter(pk=1).delete()
