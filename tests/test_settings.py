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
    return run_argv(["-c", code], tmp_path, **env)


def run_argv(argv: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith(("ORRERY_", "DATABASE_URL", "REDIS_URL"))
    }
    clean |= {"DJANGO_SETTINGS_MODULE": "portal.settings", "ORRERY_DATA_DIR": str(tmp_path)} | env
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=clean, capture_output=True, text=True, timeout=120
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
    assert result.stdout.split() == ["foundation.live.RedisChannelLayer", "redis://127.0.0.1:6379/3"]


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_bad_boolean_is_a_clear_error(tmp_path, value):
    result = run("import django; django.setup()", tmp_path, ORRERY_DEBUG=value)
    assert result.returncode != 0 and "ORRERY_DEBUG" in result.stderr


# --- production refuses unsafe settings -------------------------------------------------------

WEAK_KEYS = {
    "placeholder": "changeme",
    "padded-placeholder": "changeme" * 8,
    "django-generated": "django-insecure-" + "a1b2c3d4e5f6g7h8i9j0" * 3,
    "short": "Zq8-" * 12,  # 48 characters
    "few-distinct": "abab" * 20,
}


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        pytest.param("ORRERY_DEBUG", "1", id="debug"),
        *(pytest.param("ORRERY_SECRET_KEY", key, id=f"key-{name}") for name, key in WEAK_KEYS.items()),
        pytest.param("ORRERY_ALLOWED_HOSTS", "*", id="wildcard-host"),
        pytest.param("ORRERY_ALLOWED_HOSTS", "orrery.example.org,*", id="wildcard-among-hosts"),
    ],
)
def test_production_refuses_to_start_unsafe(tmp_path, variable, value):
    result = run("import django; django.setup()", tmp_path, **(PRODUCTION | {variable: value}))
    assert result.returncode != 0
    assert "Refusing to start in production" in result.stderr and variable in result.stderr


# --- manage.py check --deploy -----------------------------------------------------------------

# Safe settings without ORRERY_ENVIRONMENT=production: the deploy checks judge the settings, not
# the label.
SAFE_ANYWHERE = {
    "ORRERY_HTTPS": "1",
    "ORRERY_SECRET_KEY": PRODUCTION["ORRERY_SECRET_KEY"],
    "ORRERY_ALLOWED_HOSTS": "orrery.example.org",
}


def check_deploy(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return run_argv(["manage.py", "check", "--deploy"], tmp_path, **env)


@pytest.mark.parametrize("env", [PRODUCTION, SAFE_ANYWHERE], ids=["production", "development-label"])
def test_check_deploy_passes_with_safe_settings(tmp_path, env):
    result = check_deploy(tmp_path, **env)
    assert result.returncode == 0, result.stderr
    assert "orrery.E" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("change", "error"),
    [
        pytest.param({"ORRERY_DEBUG": "1"}, "orrery.E001", id="debug"),
        pytest.param({"ORRERY_SECRET_KEY": "changeme"}, "orrery.E002", id="placeholder-key"),
        pytest.param({"ORRERY_SECRET_KEY": WEAK_KEYS["django-generated"]}, "orrery.E002", id="django-key"),
        pytest.param({"ORRERY_ALLOWED_HOSTS": "*"}, "orrery.E003", id="wildcard-host"),
        pytest.param({"ORRERY_HTTPS": "0"}, "orrery.E004", id="https-off"),
        pytest.param({"ORRERY_METRICS_TOKEN": "metrics"}, "orrery.E005", id="guessable-metrics-token"),
    ],
)
def test_check_deploy_fails_on_unsafe_settings(tmp_path, change, error):
    result = check_deploy(tmp_path, **(SAFE_ANYWHERE | change))
    assert result.returncode != 0 and error in result.stderr


def test_check_deploy_fails_on_the_development_defaults(tmp_path):
    result = check_deploy(tmp_path)
    assert result.returncode != 0 and "orrery.E004" in result.stderr


# --- proxy headers ----------------------------------------------------------------------------

SPOOFED_HTTPS = (
    "import django, json; django.setup()\n"
    "from django.conf import settings; from django.http import HttpResponse\n"
    "from django.middleware.security import SecurityMiddleware; from django.test import RequestFactory\n"
    "request = RequestFactory().get('/jobs/', HTTP_X_FORWARDED_PROTO='https')\n"
    "response = SecurityMiddleware(lambda r: HttpResponse('page'))(request)\n"
    "print(json.dumps({'secure': request.is_secure(), 'status': response.status_code,\n"
    "  'behind_proxy': settings.ORRERY_BEHIND_PROXY}))"
)


@pytest.mark.parametrize(
    ("behind_proxy", "secure", "status"),
    [
        pytest.param(None, False, 301, id="no-proxy-said"),
        pytest.param("0", False, 301, id="no-proxy"),
        pytest.param("1", True, 200, id="behind-proxy"),
    ],
)
def test_forwarded_proto_is_believed_only_behind_a_proxy(tmp_path, behind_proxy, secure, status):
    env = SAFE_ANYWHERE | {"ORRERY_ALLOWED_HOSTS": "testserver"}
    if behind_proxy is not None:
        env["ORRERY_BEHIND_PROXY"] = behind_proxy
    result = run(SPOOFED_HTTPS, tmp_path, **env)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen == {"secure": secure, "status": status, "behind_proxy": behind_proxy == "1"}
