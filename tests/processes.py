"""What the tests need to start real control-plane processes (servers, Celery workers)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from django.conf import settings


def control_plane_env(data_dir: Path, **overrides: str) -> dict[str, str]:
    """The environment of a server or worker process on the test database and Redis prefix,
    with a Celery queue of its own so that no other worker takes its tasks."""
    db = settings.DATABASES["default"]
    return {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}:{db['PASSWORD']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "REDIS_URL": settings.REDIS_URL,
        "ORRERY_REDIS_PREFIX": settings.ORRERY_REDIS_PREFIX,
        "ORRERY_CELERY_QUEUE": f"test-{uuid.uuid4().hex[:8]}",
        "ORRERY_DATA_DIR": str(data_dir),
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        **overrides,
    }
