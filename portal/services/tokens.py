"""Personal API tokens: issue (shown once), authenticate, revoke.

The rules of issue, the same for the API, the console and ``manage.py issue_token``:

* every token expires: by default ``ORRERY_TOKEN_MAX_DAYS`` after issue, and never later;
* a token made with a token (``issuer``) never outlives it: asking for longer is refused, and
  without an explicit lifetime the new token expires with its issuer;
* a token made with a token holds no scope its issuer lacks; without explicit scopes it gets
  ``DEFAULT_SCOPES`` narrowed to the issuer's.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from foundation import audit
from foundation.choices import AuditAction
from foundation.secrets import digest, new_secret
from portal.choices import Scope
from portal.models import ApiToken

TOKEN_PREFIX = "orr_"
DEFAULT_SCOPES = (Scope.READ, Scope.SUBMIT)
# last_used_at is a hint for people, not an audit trail: write it at most this often per token.
_LAST_USED_RESOLUTION_S = 60


class TokenRefused(ValueError):
    """A token the rules above do not allow. ``field`` is the request's name for the input at
    fault: ``scopes`` or ``expiresInDays``."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


def check_scopes(scopes: Iterable[str] | None, issuer: ApiToken | None) -> list[str]:
    """The scopes a new token gets, in canonical order; ``TokenRefused`` at ``scopes`` for an
    unknown or empty list, or one wider than ``issuer``'s."""
    if scopes is None:
        wanted = {s for s in DEFAULT_SCOPES if issuer is None or issuer.has_scope(s)}
    else:
        wanted = set(scopes)
        if unknown := sorted(wanted - set(Scope.values)):
            raise TokenRefused("scopes", f"unknown scope '{unknown[0][:40]}'; use {', '.join(Scope.values)}")
        if issuer is not None and (
            wider := [s for s in Scope.values if s in wanted and not issuer.has_scope(s)]
        ):
            raise TokenRefused(
                "scopes", f"this token lacks the '{wider[0]}' scope, so it cannot give it to a new token"
            )
    if not wanted:
        raise TokenRefused("scopes", "give at least one scope")
    return [s for s in Scope.values if s in wanted]


def check_expiry(expires_in_days: int | None, issuer: ApiToken | None, *, now: datetime) -> datetime:
    """When a new token expires; ``TokenRefused`` at ``expiresInDays`` past the site's maximum
    or past ``issuer``'s own expiry."""
    max_days = settings.ORRERY_TOKEN_MAX_DAYS
    if expires_in_days is None:
        expires_at = now + timedelta(days=max_days)
        return min(expires_at, issuer.expires_at) if issuer is not None else expires_at
    if not 1 <= expires_in_days <= max_days:
        raise TokenRefused("expiresInDays", f"must be between 1 and {max_days} (this site's maximum)")
    expires_at = now + timedelta(days=expires_in_days)
    if issuer is not None and expires_at > issuer.expires_at:
        raise TokenRefused(
            "expiresInDays",
            f"a token cannot outlive the token that makes it, which expires at "
            f"{issuer.expires_at:%Y-%m-%d %H:%M %Z}; ask for fewer days or leave expiresInDays out",
        )
    return expires_at


@transaction.atomic
def issue_token(
    user: AbstractBaseUser,
    *,
    name: str = "default",
    scopes: Iterable[str] | None = None,
    expires_in_days: int | None = None,
    issuer: ApiToken | None = None,
    actor: AbstractBaseUser | None = None,
) -> tuple[ApiToken, str]:
    """Create a token for ``user``; returns the row and the plaintext, which is not kept.

    ``issuer`` is the token the request came with (None for a session, the console or the
    server's command line). Raises ``TokenRefused`` and creates nothing when the module's
    rules refuse the request. ``actor`` is who asked (the user, an operator, or None from the
    command line), for the audit log."""
    now = timezone.now()
    granted = check_scopes(scopes, issuer)
    expires_at = check_expiry(expires_in_days, issuer, now=now)
    secret = new_secret(TOKEN_PREFIX)
    token = ApiToken.objects.create(
        user=user,
        name=name,
        prefix=secret.prefix,
        digest=secret.digest,
        scopes=granted,
        expires_at=expires_at,
    )
    details = {"user": user.get_username(), "name": name, "scopes": granted}
    audit.record(AuditAction.TOKEN_CREATE, actor=actor, target=f"token:{token.prefix}", details=details)
    return token, secret.plaintext


@transaction.atomic
def revoke_token(token: ApiToken, *, actor: AbstractBaseUser | None = None) -> None:
    """Revoke at once. Idempotent: revoking a revoked token keeps its first revocation time
    (and its one audit entry)."""
    if ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=timezone.now()):
        audit.record(AuditAction.TOKEN_REVOKE, actor=actor, target=f"token:{token.prefix}")


def authenticate_token(plaintext: str) -> ApiToken | None:
    """The live token for ``plaintext`` with its user, or None: one indexed read by digest
    (no password hash per request). ``last_used_at`` is written at most once a minute."""
    if not plaintext.startswith(TOKEN_PREFIX):
        return None
    now = timezone.now()
    token = (
        ApiToken.objects.select_related("user")
        .filter(digest=digest(plaintext), revoked_at__isnull=True, expires_at__gt=now, user__is_active=True)
        .first()
    )
    if token is None:
        return None
    if token.last_used_at is None or (now - token.last_used_at).total_seconds() > _LAST_USED_RESOLUTION_S:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
    return token
