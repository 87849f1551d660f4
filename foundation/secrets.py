"""Bearer secrets (API tokens, join tokens, node and cluster credentials).

A secret is ``<kind prefix><43 url-safe characters>`` (256 bits). Only its SHA-256 digest is
stored: with that much randomness a fast digest is as safe as a password hash and keeps every
authentication a single indexed lookup. The first characters are kept as ``prefix`` so people
can tell their secrets apart.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass


@dataclass(frozen=True)
class NewSecret:
    plaintext: str
    prefix: str
    digest: str


def digest(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def new_secret(kind: str) -> NewSecret:
    plaintext = kind + secrets.token_urlsafe(32)
    return NewSecret(plaintext, plaintext[: len(kind) + 6], digest(plaintext))
