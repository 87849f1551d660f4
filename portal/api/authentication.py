"""``Authorization: Bearer <token>`` with a personal ``ApiToken``."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.request import Request

from foundation import audit
from portal.models import ApiToken
from portal.services.tokens import authenticate_token


class BearerTokenAuthentication(BaseAuthentication):
    """Authenticates a request carrying a bearer token; leaves others to session auth."""

    keyword = b"bearer"

    def authenticate(self, request: Request) -> tuple[AbstractBaseUser, ApiToken] | None:
        header = get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword:
            return None
        if len(header) != 2:
            raise AuthenticationFailed("Use 'Authorization: Bearer <token>'.")
        try:
            plaintext = header[1].decode("ascii")
        except UnicodeDecodeError:
            raise AuthenticationFailed("Invalid token.") from None
        token = authenticate_token(plaintext)
        if token is None:
            raise AuthenticationFailed("Invalid, expired or revoked token.")
        audit.set_credential(f"token:{token.prefix}")  # audit entries say which token acted
        return token.user, token

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="orrery"'


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """Describes bearer tokens in the OpenAPI document."""

    target_class = BearerTokenAuthentication
    name = "bearerAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "A personal API token (orr_…)."}
