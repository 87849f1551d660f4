"""Secrets kept at rest (cluster credentials: a slurmrestd JWT, later a kube token), sealed with
authenticated encryption (Fernet: AES-128-CBC with HMAC-SHA256).

The keys come from ``settings.ORRERY_SECRETS_KEYS``: the first seals, every one of them opens,
so rotating is adding a new key in front, re-sealing (``manage.py rotate_secrets``), then
dropping the old one. A value sealed with a key no longer configured cannot be opened, and says
so. Plaintext never reaches a log, the API or the console.
"""

from __future__ import annotations

import json
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


class SealBroken(Exception):
    """The sealed value cannot be opened with any configured key (or was altered)."""


def _keys() -> MultiFernet:
    keys = list(settings.ORRERY_SECRETS_KEYS)
    if not keys:
        raise ImproperlyConfigured("ORRERY_SECRETS_KEYS is empty: cluster secrets cannot be sealed.")
    try:
        return MultiFernet([Fernet(key) for key in keys])
    except ValueError as exc:
        raise ImproperlyConfigured(
            f"ORRERY_SECRETS_KEYS holds a key that is not a Fernet key: {exc}"
        ) from None


def new_key() -> str:
    return Fernet.generate_key().decode()


def seal(data: dict[str, Any]) -> str:
    return _keys().encrypt(json.dumps(data, sort_keys=True).encode()).decode()


def unseal(sealed: str) -> dict[str, Any]:
    if not sealed:
        return {}
    try:
        return json.loads(_keys().decrypt(sealed.encode()))
    except InvalidToken:
        raise SealBroken("sealed with a key that is not configured, or altered") from None


def reseal(sealed: str) -> str:
    """The same secret sealed with the first (newest) key."""
    try:
        return _keys().rotate(sealed.encode()).decode()
    except InvalidToken:
        raise SealBroken("sealed with a key that is not configured, or altered") from None
