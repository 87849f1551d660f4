"""Orrery's own deploy checks: ``manage.py check --deploy`` fails (exit status 1) unless the
settings are safe for production, whatever ``ORRERY_ENVIRONMENT`` says.

Django reports most of these as warnings, which ``check --deploy`` lets pass; here each is an
error. The rules shared with start-up live in ``portal/deployment.py``.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, register

from portal.deployment import allowed_hosts_problem, secret_key_problem

# Shorter than this, a scrape token is guessable; ``secrets.token_urlsafe(32)`` gives 43 characters.
METRICS_TOKEN_MIN_LENGTH = 32


@register(Tags.security, deploy=True)
def check_production_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """One error per unsafe setting: debug pages, the secret key, the allowed hosts, HTTPS and
    the metrics scrape token."""
    errors = []
    if settings.DEBUG:
        errors.append(
            Error(
                "Debug pages are on: they show settings, source and request data to anyone.",
                hint="Unset ORRERY_DEBUG (or set it to 0).",
                id="orrery.E001",
            )
        )
    if reason := secret_key_problem(settings.SECRET_KEY):
        errors.append(
            Error(
                f"The secret key {reason}.",
                hint="Set ORRERY_SECRET_KEY to a long random value, e.g. "
                "python -c 'import secrets; print(secrets.token_urlsafe(50))'.",
                id="orrery.E002",
            )
        )
    if reason := allowed_hosts_problem(settings.ALLOWED_HOSTS):
        errors.append(
            Error(
                f"ALLOWED_HOSTS {reason}.",
                hint="List the site's host names in ORRERY_ALLOWED_HOSTS.",
                id="orrery.E003",
            )
        )
    if not settings.HTTPS:
        errors.append(
            Error(
                "HTTPS is off: session cookies, CSRF cookies and bearer tokens travel in clear text.",
                hint="Set ORRERY_HTTPS=1 (ORRERY_ENVIRONMENT=production turns it on).",
                id="orrery.E004",
            )
        )
    token = settings.ORRERY_METRICS_TOKEN
    if token and len(token) < METRICS_TOKEN_MIN_LENGTH:
        errors.append(
            Error(
                f"ORRERY_METRICS_TOKEN is shorter than {METRICS_TOKEN_MIN_LENGTH} characters, "
                "so /metrics is open to whoever guesses it.",
                hint="python -c 'import secrets; print(secrets.token_urlsafe(32))'.",
                id="orrery.E005",
            )
        )
    return errors
