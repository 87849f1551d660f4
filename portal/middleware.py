"""Request hygiene applied before any view."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse

from foundation import audit
from portal.lockout import client_address


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
