"""Settings come from the environment; each case runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith(("ORRERY_", "DATABASE_URL", "REDIS_URL"))
    }
    clean |= {"DJANGO_SETTINGS_MODULE": "portal.settings", "ORRERY_DATA_DIR": str(tmp_path)} | env
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=clean, capture_output=True, text=True, timeout=120
    )


PRODUCTION = {
    "ORRERY_ENVIRONMENT": "production",
    "ORRERY_SECRET_KEY": "k" * 20 + "-production-secret-0123456789-abcdefghijklmnop",
    "ORRERY_ALLOWED_HOSTS": "orrery.example.org",
    "DATABASE_URL": "postgres://orrery:secret@db.example.org:5432/orrery",
    "REDIS_URL": "redis://cache.example.org:6379/0",
    "ORRERY_SECRETS_KEYS": "QkZ0x2aDq9l8yq3n0w9eJ8m6uV1t4r7s2p5o3i0u1y8=",
}


def test_check_deploy_passes_with_production_variables(tmp_path):
    code = (
        "import django; django.setup(); from django.core.management import call_command; "
        "call_command('check', deploy=True, fail_level='WARNING')"
    )
    result = run(code, tmp_path, **PRODUCTION)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("needed", ["ORRERY_SECRET_KEY", "ORRERY_SECRETS_KEYS"])
def test_production_needs_its_keys(tmp_path, needed):
    env = {k: v for k, v in PRODUCTION.items() if k != needed}
    result = run("import django; django.setup()", tmp_path, **env)
    assert result.returncode != 0 and needed in result.stderr


def test_embedded_default_is_sqlite_wal_and_in_memory_layers(tmp_path):
    code = (
        "import django, json; django.setup()\n"
        "from django.conf import settings; from django.db import connection\n"
        "with connection.cursor() as c:\n"
        "    c.execute('PRAGMA journal_mode'); mode = c.fetchone()[0]\n"
        "print(json.dumps({'engine': settings.DATABASES['default']['ENGINE'], 'mode': mode,\n"
        "  'layer': settings.CHANNEL_LAYERS['default']['BACKEND'],\n"
        "  'cache': settings.CACHES['default']['BACKEND'],\n"
        "  'db': str(settings.DATABASES['default']['NAME']), 'debug': settings.DEBUG}))"
    )
    result = run(code, tmp_path)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["engine"].endswith("sqlite3") and seen["mode"] == "wal"
    assert seen["db"].startswith(str(tmp_path))
    assert seen["layer"] == "channels.layers.InMemoryChannelLayer"
    assert seen["cache"].endswith("LocMemCache") and seen["debug"] is False


def test_redis_url_switches_on_redis_layers(tmp_path):
    code = (
        "import django; django.setup(); from django.conf import settings; "
        "print(settings.CHANNEL_LAYERS['default']['BACKEND'], settings.CELERY_BROKER_URL)"
    )
    result = run(code, tmp_path, REDIS_URL="redis://127.0.0.1:6379/3")
    assert result.stdout.split() == ["channels_redis.core.RedisChannelLayer", "redis://127.0.0.1:6379/3"]


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_bad_boolean_is_a_clear_error(tmp_path, value):
    result = run("import django; django.setup()", tmp_path, ORRERY_DEBUG=value)
    assert result.returncode != 0 and "ORRERY_DEBUG" in result.stderr
