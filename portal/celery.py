"""The Celery application. Tasks live in each app's ``tasks.py`` and take ids, not objects.

Queues are per role (``settings.ORRERY_CELERY_ROLES``; ``CELERY_TASK_ROUTES`` maps each task to
one), beat sends only while it holds its lease (``foundation.beat``), and a worker's consumer
reconnects to the broker without limit (``Consumer`` below).
"""

from __future__ import annotations

import logging
import os

from celery import Celery
from celery.worker.consumer import Consumer as CeleryConsumer
from celery.worker.state import maybe_shutdown
from kombu import Connection

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

log = logging.getLogger(__name__)

app = Celery("orrery")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


class Consumer(CeleryConsumer):
    """A worker's consumer that, once the broker is lost, tries again every
    ``ORRERY_CELERY_RECONNECT_MAX_S`` at most and never gives up.

    Celery's own consumer backs off 2, 4, 6 … 30 s between tries (kombu's defaults, which no
    setting reaches) and gives up after ``broker_connection_max_retries`` tries: after a Redis
    restart it resumed up to 30 s after Redis was back (10.8 s measured after a 21 s outage), and
    after a long outage not at all, with nothing to restart it. Reconnecting is cheap (one TCP
    connect), so a short, flat interval costs nothing and bounds the recovery time.
    """

    def ensure_connected(self, conn: Connection) -> Connection:
        from django.conf import settings

        every = settings.ORRERY_CELERY_RECONNECT_MAX_S

        def on_error(exc: Exception, interval: float) -> None:
            log.error("broker %s unreachable (%s); trying again in %.1f s", conn.as_uri(), exc, interval)

        conn = conn.ensure_connection(
            on_error,
            None,  # no limit: a worker outlives any outage of the broker
            interval_start=min(0.2, every),
            interval_step=every / 2,
            interval_max=every,
            callback=maybe_shutdown,
        )
        self.first_connection_attempt = False
        self.broker_connection_retry_attempt = 0
        return conn

    def on_connection_error_after_connected(self, exc: Exception) -> None:
        """Celery closes the lost connection here, and closing a Redis channel restores its
        unacknowledged messages — through a client kombu can no longer make once the connection
        is gone (``AttributeError`` on its ``hostname``, kombu 5.5–5.7), which ended the worker
        ("Unrecoverable error") whenever Redis went away while a message was between delivery
        and acknowledgement. That message is a periodic pass or a doorbell (nothing is
        acknowledged late): beat sends the next one, so it is let go and the worker reconnects."""
        try:
            super().on_connection_error_after_connected(exc)
        except AttributeError as failure:
            log.warning("broker lost with a message not yet acknowledged; let go (%s)", failure)
