"""Token scopes, enforced once for every view of the REST API.

A view needs ``read`` for safe methods (``GET``, ``HEAD``, ``OPTIONS``) and its ``write_scope``
for the others. ``write_scope`` defaults to ``operate``, the narrowest, so a write view that
forgets to say what it needs is closed to ordinary tokens rather than open to them
(``tests/portal/api/test_scopes.py`` checks that every write view says it). Requests with a
browser session are not limited by scopes: a scope narrows what a token may do, never what its
user may do, and rights (membership, operator) are checked by each view as before.
"""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request

from portal.choices import Scope
from portal.models import ApiToken


def required_scope(view: Any, method: str) -> str:
    """The scope a token needs to call ``method`` on ``view``."""
    if method in SAFE_METHODS:
        return Scope.READ
    return getattr(view, "write_scope", Scope.OPERATE)


class TokenScope(BasePermission):
    """403 for a token without the scope the view needs for the request's method."""

    message = "This token lacks the scope this request needs."

    def has_permission(self, request: Request, view: Any) -> bool:
        token = request.auth
        if not isinstance(token, ApiToken):  # a session (or no credentials: IsAuthenticated answers)
            return True
        scope = required_scope(view, request.method or "GET")
        if token.has_scope(scope):
            return True
        self.message = (
            f"This token lacks the '{scope}' scope, which {request.method} {request.path} needs; "
            f"issue a token with it (its scopes: {', '.join(token.scopes) or 'none'})."
        )
        return False
