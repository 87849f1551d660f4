"""Celery beat in two copies: a lease in the database decides which one sends.

Every beat process runs ``LeaseScheduler`` (``CELERY_BEAT_SCHEDULER``), Celery's in-memory
scheduler (every entry is an interval, so there is no schedule file for two beats to share)
behind a lease held in ``foundation.models.BeatLease``:

    holder  ── renews every TTL/3 ──►  keeps sending while its lease, by its own clock, lasts
    standby ── tries every min(1 s, TTL/4) ──►  takes the row once the database says its time is up

The database's clock decides expiry (``now()`` in the compare-and-set), so two hosts' clocks
never have to agree. A holder counts its lease from *before* the renewal it sent, so by its own
clock it stops sending no later than the database lets anyone else start: never two senders at
once. If the holder dies, the standby sends within TTL + one standby tick of the holder's last
renewal (``ORRERY_BEAT_LEASE_S``, 10 s by default), logs a warning naming the holder it replaced
and counts it in ``orrery_beat_takeovers_total``. A holder stopped cleanly gives the lease up at
once. A holder that cannot reach the database stops sending when its lease runs out; the tasks
it would send need the database anyway.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

from celery.beat import Scheduler
from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import Q
from django.db.models.functions import Now
from prometheus_client import Counter, Gauge, start_http_server

log = logging.getLogger(__name__)

TAKEOVERS = Counter("orrery_beat_takeovers_total", "Times this beat took the lease from another holder.")
LEADER = Gauge("orrery_beat_leader", "1 while this beat process holds the lease and sends the schedule.")


@dataclass(frozen=True)
class Claim:
    """A successful take or renewal: the lease's term, and the holder it was taken from (None
    when it was this process's already or nobody's)."""

    term: int
    previous: str | None


class Lease:
    """The lease on one schedule, for one holder. ``claim`` is a compare-and-set on the row's
    (holder, term): it renews the holder's own lease or takes one whose time is up, and never
    takes a lease another holder still has. Idempotent for the holder; safe under any number of
    concurrent claimants."""

    def __init__(self, name: str, holder: str, ttl_s: float) -> None:
        self.name, self.holder, self.ttl = name, holder, timedelta(seconds=ttl_s)

    def claim(self) -> Claim | None:
        from foundation.models import BeatLease

        row = BeatLease.objects.filter(name=self.name).values("holder", "term").first()
        if row is None:
            try:
                with transaction.atomic():
                    until = Now() + self.ttl
                    BeatLease.objects.create(name=self.name, holder=self.holder, term=1, expires_at=until)
            except IntegrityError:  # another beat created it first: try again next tick
                return None
            return Claim(term=1, previous=None)
        mine = row["holder"] == self.holder
        term = row["term"] if mine else row["term"] + 1
        # The compare: the row is still as read, and either ours or expired by the database's clock.
        taken = (
            BeatLease.objects.filter(name=self.name, holder=row["holder"], term=row["term"])
            .filter(Q(holder=self.holder) | Q(expires_at__lte=Now()))
            .update(holder=self.holder, term=term, expires_at=Now() + self.ttl)
        )
        if not taken:
            return None
        return Claim(term=term, previous=None if mine or not row["holder"] else row["holder"])

    def release(self) -> None:
        """Give the lease up now (a clean stop), so a standby takes it at its next tick."""
        from foundation.models import BeatLease

        BeatLease.objects.filter(name=self.name, holder=self.holder).update(expires_at=Now())


class LeaseScheduler(Scheduler):
    """Celery beat's in-memory scheduler, sending only while this process holds the lease named
    after the queue prefix (``ORRERY_CELERY_QUEUE``). A standby ticks every min(1 s, TTL/4)
    without sending; on taking the lease it sends every entry that is due, at once."""

    def __init__(self, *args, **kwargs) -> None:
        import django
        from django.apps import apps
        from django.conf import settings

        if not apps.ready:  # Celery's Django fixup sets it up first; setting up twice redoes logging
            django.setup()
        ttl = settings.ORRERY_BEAT_LEASE_S
        holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.lease = Lease(settings.ORRERY_CELERY_QUEUE, holder, ttl)
        self.renew_every = ttl / 3
        self.standby_every = min(1.0, ttl / 4)
        self.held_until = 0.0  # monotonic; this process may send until then
        self.next_claim = 0.0
        self.term: int | None = None
        if settings.ORRERY_BEAT_METRICS_PORT:
            try:  # local only: the metrics name hosts and queues, like the portal's /metrics
                start_http_server(settings.ORRERY_BEAT_METRICS_PORT, addr="127.0.0.1")
            except OSError as exc:  # a beat without its metrics still sends
                log.warning("beat metrics on port %s: %s", settings.ORRERY_BEAT_METRICS_PORT, exc)
        super().__init__(*args, **kwargs)

    def tick(self, *args, **kwargs) -> float:
        now = time.monotonic()
        if now >= self.next_claim:
            self._claim(now)
        if time.monotonic() >= self.held_until:
            return self.standby_every
        return min(super().tick(*args, **kwargs), max(self.next_claim - time.monotonic(), 0.0))

    def _claim(self, started: float) -> None:
        from django.db import connection

        try:
            claim = self.lease.claim()
        except DatabaseError as exc:
            log.warning("beat %s: cannot reach the database to hold the lease (%s)", self.lease.holder, exc)
            with contextlib.suppress(DatabaseError):
                connection.close()  # the next try opens a fresh connection
            claim = None
        if claim is None:
            self.next_claim = time.monotonic() + self.standby_every
            if self.term is not None and time.monotonic() >= self.held_until:
                log.warning("beat %s: lost the lease (term %s); standing by", self.lease.holder, self.term)
                self.term = None
                LEADER.set(0)
            return
        # Counted from before the claim was sent: by this clock the lease ends no later than by
        # the database's.
        self.held_until = started + self.lease.ttl.total_seconds()
        self.next_claim = time.monotonic() + self.renew_every
        if claim.term != self.term:
            self.term = claim.term
            LEADER.set(1)
            if claim.previous:
                TAKEOVERS.inc()
                log.warning(
                    "beat %s: took the lease from %s (term %s); sending the schedule",
                    self.lease.holder,
                    claim.previous,
                    claim.term,
                )
            else:
                log.info("beat %s: holds the lease (term %s); sending", self.lease.holder, claim.term)

    def close(self) -> None:
        if self.term is not None:
            with contextlib.suppress(DatabaseError):  # else it expires on its own
                self.lease.release()
            self.term = None
            LEADER.set(0)
        super().close()
