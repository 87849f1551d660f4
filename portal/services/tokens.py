"""Personal API tokens: issue (shown once), authenticate, revoke."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.utils import timezone

from foundation.secrets import digest, new_secret
from portal.models import ApiToken

TOKEN_PREFIX = "orr_"
# last_used_at is a hint for people, not an audit trail: write it at most this often per token.
_LAST_USED_RESOLUTION_S = 60


def issue_token(user: AbstractBaseUser, *, name: str = "default") -> tuple[ApiToken, str]:
    """Create a token for ``user``; returns the row and the plaintext, which is not kept."""
    secret = new_secret(TOKEN_PREFIX)
    token = ApiToken.objects.create(user=user, name=name, prefix=secret.prefix, digest=secret.digest)
    return token, secret.plaintext


def revoke_token(token: ApiToken, *, actor: AbstractBaseUser | None = None) -> None:
    """Revoke at once. Idempotent: revoking a revoked token keeps its first revocation time."""
    ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())


def authenticate_token(plaintext: str) -> ApiToken | None:
    """The live token for ``plaintext`` with its user, or None: one indexed read by digest
    (no password hash per request). ``last_used_at`` is written at most once a minute."""
    if not plaintext.startswith(TOKEN_PREFIX):
        return None
    now = timezone.now()
    token = (
        ApiToken.objects.select_related("user")
        .filter(digest=digest(plaintext), revoked_at__isnull=True, user__is_active=True)
        .first()
    )
    if token is None or (token.expires_at is not None and token.expires_at <= now):
        return None
    if token.last_used_at is None or (now - token.last_used_at).total_seconds() > _LAST_USED_RESOLUTION_S:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
    return token
