"""The Celery application. Tasks live in each app's ``tasks.py`` and take ids, not objects."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

app = Celery("orrery")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
