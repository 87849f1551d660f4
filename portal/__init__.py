"""The Orrery site: settings, URLs, ASGI/WSGI, the Celery app and tenancy."""

from portal.celery import app as celery_app

__all__ = ["celery_app"]
