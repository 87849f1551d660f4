"""Request hygiene applied before any view."""

from __future__ import annotations

import json
import logging
import random
import sys
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.signals import got_request_exception
from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse

from foundation import audit
from portal.lockout import client_address

log = logging.getLogger(__name__)


class RejectNulBytes:
    """PostgreSQL text cannot hold NUL, so a NUL in the path or a query value could only end in
    a database error. Refuse it up front with the API's error shape."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        errors = (
            [{"path": "path", "message": "must not contain NUL characters"}] if "\x00" in request.path else []
        )
        errors += [
            {"path": f"query.{key}", "message": "must not contain NUL characters"}
            for key, values in request.GET.lists()
            if "\x00" in key or any("\x00" in v for v in values)
        ]
        if errors:
            return JsonResponse({"detail": "Invalid request.", "errors": errors}, status=400)
        return self.get_response(request)


# The policy every response carries. No inline script, style or event handler anywhere: pages
# load their code from static files and read their parameters from data attributes and
# json_script blocks. 'self' in connect-src also covers ws: and wss: to this host (CSP Level 3),
# which the live pages' websockets need.
DEFAULT_CSP: dict[str, list[str]] = {
    "default-src": ["'self'"],
    "script-src": ["'self'"],
    "style-src": ["'self'"],
    "img-src": ["'self'", "data:"],
    "font-src": ["'self'"],
    "connect-src": ["'self'"],
    "object-src": ["'none'"],
    "base-uri": ["'none'"],
    "frame-ancestors": ["'none'"],
    "form-action": ["'self'"],
}


def render_csp(policy: dict[str, list[str]]) -> str:
    """`{"img-src": ["'self'", "data:"]}` → `img-src 'self' data:` (directives joined by `; `)."""
    return "; ".join(" ".join([directive, *sources]) for directive, sources in policy.items())


class ContentSecurityPolicy:
    """Adds a Content-Security-Policy header to every response that does not set its own.

    The policy is `settings.SECURE_CSP` (a dict of directive → sources, the shape and the name
    Django 6.0's own CSP middleware reads, so moving to it is a one-line change), or
    `DEFAULT_CSP` when that is unset; `settings.SECURE_CSP_REPORT_ONLY`, when set, is sent as
    Content-Security-Policy-Report-Only beside it, to try a stricter policy without breaking
    pages. Both are read per response, so `override_settings` and reloads take effect."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        policy = getattr(settings, "SECURE_CSP", None) or DEFAULT_CSP
        report_only = getattr(settings, "SECURE_CSP_REPORT_ONLY", None)
        response.headers.setdefault("Content-Security-Policy", render_csp(policy))
        if report_only:
            response.headers.setdefault("Content-Security-Policy-Report-Only", render_csp(report_only))
        return response


class AuditSource:
    """Audit entries written while answering a request name the client's address, by the same
    rule as the sign-in lockout (``portal.lockout.client_address``): the peer's, or, only when
    the operator says a proxy is in front (``ORRERY_BEHIND_PROXY``), the right-most
    ``X-Forwarded-For`` address, the one that proxy appended."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        with audit.source((client_address(request) or "unknown")[:64]):
            return self.get_response(request)


class AsgiBodyLimit:
    """ASGI: refuse a request body over ``DATA_UPLOAD_MAX_MEMORY_SIZE`` before Django spools it.

    Django's ASGI handler reads the whole body into a temporary file before any view (or the
    API's parsers, which stop at the limit) runs, so without this an upload of any size would be
    written to disk first. A declared ``Content-Length`` over the limit is answered 413 at once;
    a body without one (chunked) is counted while it arrives, and at the limit Django is told the
    client left (it stops reading and answers nothing) and the client gets the 413. WSGI servers
    hand the body over unread, so there the parsers' own bound is enough."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        declared = dict(scope.get("headers") or []).get(b"content-length", b"0")
        if not declared.isdigit() or len(declared) > 18 or int(declared) > limit:
            await _too_large(send)
            return
        received = 0
        over = started = False

        async def counting_receive() -> dict[str, Any]:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def watching_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counting_receive, watching_send)
        if over and not started:
            await _too_large(send)


async def _too_large(send: Callable[..., Any]) -> None:
    body = json.dumps(
        {
            "detail": "The request body is too large (the limit is "
            f"{settings.DATA_UPLOAD_MAX_MEMORY_SIZE // 2**20} MiB); split a batch into smaller ones.",
            "errors": [],
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class DatabaseUnavailable:
    """While the database is away (restarting, failing over), answer 503 with Retry-After
    instead of a 500: JSON in the API's error shape under ``/api/``, a plain page elsewhere.

    A view's ``OperationalError`` or ``InterfaceError`` is answered here (``process_exception``);
    one raised by another middleware (a session saved, a user loaded) has already become a 500
    by the time it reaches this, the outermost layer, so ``got_request_exception`` marks the
    request and the 500 is replaced. Nothing is written while the database is away, so a
    client that retries loses nothing, and the next request after it returns works: with
    ``CONN_MAX_AGE`` and ``conn_health_checks`` Django drops the broken connection at the end
    of the request and checks a kept one before using it again."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        got_request_exception.connect(_mark_database_unavailable, dispatch_uid="orrery-db-unavailable")

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if getattr(request, "_database_unavailable", False) and response.status_code == 500:
            return database_unavailable(request)
        return response

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if isinstance(exception, (OperationalError, InterfaceError)):
            return database_unavailable(request)
        return None


def _mark_database_unavailable(sender: Any, request: HttpRequest | None = None, **kwargs: Any) -> None:
    if request is not None and isinstance(sys.exc_info()[1], (OperationalError, InterfaceError)):
        request._database_unavailable = True  # type: ignore[attr-defined]


def database_unavailable(request: HttpRequest) -> HttpResponse:
    """The 503 the database's absence gets: the client should retry after a few seconds."""
    retry = settings.ORRERY_INGEST_RETRY_AFTER_S
    retry_after = retry + random.randint(0, retry)  # spread the retries of many clients
    log.warning("database unavailable: %s %s answered 503", request.method, request.path)
    if request.path.startswith("/api/"):
        response: HttpResponse = JsonResponse(
            {"detail": "The database is unavailable; retry later.", "errors": [], "retryAfter": retry_after},
            status=503,
        )
    else:
        response = HttpResponse(
            "The service is briefly unavailable (its database is restarting). Try again in a few seconds.\n",
            status=503,
            content_type="text/plain; charset=utf-8",
        )
    response.headers["Retry-After"] = str(retry_after)
    return response
