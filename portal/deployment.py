"""What a production deployment must not run with.

Two places apply these rules: ``portal/settings.py`` refuses to start with
``ORRERY_ENVIRONMENT=production`` when one is broken, and ``portal/checks.py`` reports each as an
error under ``manage.py check --deploy`` whatever the environment says. The functions are pure
(no Django settings read) so that the settings module can call them while it is being loaded.
"""

from __future__ import annotations

from collections.abc import Iterable

# Django's own rule for a usable key (security.W009), applied as an error rather than a warning.
from django.core.checks.security.base import (
    SECRET_KEY_INSECURE_PREFIX,
    SECRET_KEY_MIN_LENGTH,
    SECRET_KEY_MIN_UNIQUE_CHARACTERS,
)

# Placeholders seen in examples and templates; all but the longest already fail on length, the
# list is here so that padding one of them out ("changeme" * 7) is refused too.
KNOWN_DEFAULT_KEYS = ("changeme", "change-me", "change_me", "secret", "secret-key", "insecure", "orrery")


def secret_key_problem(key: str) -> str | None:
    """Why ``key`` is unfit to sign sessions and tokens, or None when it is fit."""
    if key.startswith(SECRET_KEY_INSECURE_PREFIX):
        return (
            f"starts with {SECRET_KEY_INSECURE_PREFIX!r}, the prefix of Django's generated development keys"
        )
    lowered = key.lower()
    if any(lowered.startswith(default) for default in KNOWN_DEFAULT_KEYS):
        return "starts with a well-known placeholder"
    if len(key) < SECRET_KEY_MIN_LENGTH:
        return f"is shorter than {SECRET_KEY_MIN_LENGTH} characters"
    if len(set(key)) < SECRET_KEY_MIN_UNIQUE_CHARACTERS:
        return f"has fewer than {SECRET_KEY_MIN_UNIQUE_CHARACTERS} distinct characters"
    return None


def allowed_hosts_problem(hosts: Iterable[str]) -> str | None:
    """Why ``hosts`` would let any Host header through, or None."""
    if "*" in hosts:
        return "contains '*', which accepts any Host header (host-header poisoning of links and redirects)"
    return None


def production_problems(*, debug: bool, secret_key: str, allowed_hosts: Iterable[str]) -> list[str]:
    """Every reason a production process must refuse to start, as sentences naming the variable."""
    problems = []
    if debug:
        problems.append("ORRERY_DEBUG is on: debug pages show settings, source and request data to anyone")
    if reason := secret_key_problem(secret_key):
        problems.append(f"ORRERY_SECRET_KEY {reason}")
    if reason := allowed_hosts_problem(allowed_hosts):
        problems.append(f"ORRERY_ALLOWED_HOSTS {reason}")
    return problems
