"""Test settings: the real configuration plus a second, SQLite database.

Invariants that the database enforces are checked on both engines the product supports: the
``default`` database (PostgreSQL under ``make test``) and ``sqlite`` (the embedded default).
"""

import os

from portal.settings import *  # noqa: F403
from portal.settings import DATA_DIR, DATABASES

DATABASES["sqlite"] = {
    "ENGINE": "django.db.backends.sqlite3",
    "NAME": str(DATA_DIR / "invariants.sqlite3"),
    "TEST": {"NAME": str(DATA_DIR / "test_invariants.sqlite3")},
}
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # noqa: F405  (whitenoise warns on a missing folder)
ORRERY_REDIS_PREFIX = f"orrery-test-{os.getpid()}:"
