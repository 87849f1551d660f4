"""A WSGI fast path for job submission, ``POST /api/v1/jobs`` and ``POST /api/v1/jobs/batch``.

Django's request cycle (sixteen middleware, URL resolution, DRF's request, negotiation and
renderer) cost a one-job submission more than the submission itself. This wrapper answers the
plain case straight from the WSGI environ — a bearer token, a JSON body, no query — with the
functions the views use (``one_job_requests``, ``batch_requests``, ``submit_jobs``, the same
serializers, throttle, tenant slots and error handler), and hands everything else to Django.

It answers only what it can answer exactly as the views would. Until it has changed anything (a
throttle count, a tenant slot, a row), any doubt — no or a bad token, a token without the
``submit`` scope, a body the parser or the spec refuses, a busy tenant, a spent throttle, a
malformed idempotency key, a host Django would refuse, plain HTTP where Django redirects to
HTTPS — sends the request to Django with its body rewound, which answers it whole. After that,
the refusals submission itself can make (a cap on waiting jobs, a reused idempotency key, the
database away) are rendered here by the API's own error handler. Under ASGI the views serve
every request, with the same answers (``tests/portal/api`` runs against both).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterable
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.signals import request_finished, request_started
from django.db import InterfaceError, OperationalError, ProgrammingError, connection
from django.http.request import split_domain_port, validate_host
from django.utils import timezone
from rest_framework.renderers import JSONRenderer

from foundation import audit, facts
from foundation.sql import columns_of, from_row, is_postgresql
from portal.api.errors import handle_exception
from portal.api.fairness import get_slots
from portal.api.parsers import StrictJsonParser
from portal.api.throttles import SubmitThrottle
from portal.api.views import (
    batch_requests,
    idempotency_key,
    one_job_requests,
    submitted_batch,
    submitted_job,
)
from portal.choices import Scope
from portal.lockout import client_address
from portal.middleware import DEFAULT_CSP, database_unavailable, render_csp
from portal.models import ApiToken
from portal.services.tokens import _LAST_USED_RESOLUTION_S, TOKEN_PREFIX, authenticate_token, digest
from scheduling.services.jobs import submit_jobs

log = logging.getLogger(__name__)
WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
Answer = tuple[int, list[tuple[str, str]], bytes]
PATHS = {"/api/v1/jobs": "one", "/api/v1/jobs/batch": "batch"}
ALLOW = {"one": "GET, POST, HEAD, OPTIONS", "batch": "POST, OPTIONS"}
_UTF8 = {"utf-8", "utf8", "utf_8", "us-ascii", "ascii"}


class SubmissionFastPath:
    def __init__(self, app: WsgiApp) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        answer = self.answer(environ)
        if answer is None:
            return self.app(environ, start_response)
        status, headers, payload = answer
        start_response(f"{status} {HTTPStatus(status).phrase}", headers)
        return [payload]

    def answer(self, environ: dict[str, Any]) -> Answer | None:
        """The answer to a submission this path takes, or None for Django to answer (the body,
        if read, is put back in ``wsgi.input``)."""
        kind, charset = claim(environ)
        if kind is None:
            return None
        length = int(environ["CONTENT_LENGTH"])
        body = environ["wsgi.input"].read(length)
        environ["wsgi.input"] = io.BytesIO(body)  # whoever answers reads it from the start
        if len(body) != length:
            return None
        # The request signals are those Django's own handler sends: they keep database
        # connections healthy (close_old_connections) exactly as for any other request.
        request_started.send(sender=self.__class__, environ=environ)
        try:
            with audit.source((client_address(SimpleNamespace(META=environ)) or "unknown")[:64]):
                return submit(kind, body, charset, environ)
        finally:
            request_finished.send(sender=self.__class__)


def claim(environ: dict[str, Any]) -> tuple[str | None, str]:
    """Which submission the request is (``one``, ``batch``) and its body's charset, if this path
    may take it; ``(None, "")`` otherwise."""
    kind = PATHS.get(environ.get("PATH_INFO", ""))
    if kind is None or environ.get("REQUEST_METHOD") != "POST" or environ.get("QUERY_STRING"):
        return None, ""
    if not environ.get("HTTP_AUTHORIZATION", "").lower().startswith("bearer "):
        return None, ""
    media, _, params = environ.get("CONTENT_TYPE", "").partition(";")
    charset = "utf-8"
    for param in params.split(";"):
        name, _, value = param.strip().partition("=")
        if name.lower() == "charset":
            charset = value.strip().strip('"').lower()
        elif name:
            return None, ""
    if media.strip().lower() != "application/json" or charset not in _UTF8:
        return None, ""
    length = environ.get("CONTENT_LENGTH") or ""
    if not (length.isascii() and length.isdigit()):
        return None, ""
    if not 0 < int(length) <= settings.DATA_UPLOAD_MAX_MEMORY_SIZE or settings.USE_X_FORWARDED_HOST:
        return None, ""
    if settings.SECURE_SSL_REDIRECT and not secure(environ):
        return None, ""  # Django redirects it to HTTPS
    host = environ.get("HTTP_HOST") or environ.get("SERVER_NAME", "")
    domain, _ = split_domain_port(host)
    allowed = settings.ALLOWED_HOSTS or ([".localhost", "127.0.0.1", "[::1]"] if settings.DEBUG else [])
    if not domain or not validate_host(domain, allowed):
        return None, ""
    return kind, charset


def secure(environ: dict[str, Any]) -> bool:
    """Whether the request came over HTTPS, as Django decides it (``HttpRequest.scheme``)."""
    if settings.SECURE_PROXY_SSL_HEADER:
        header, value = settings.SECURE_PROXY_SSL_HEADER
        forwarded = environ.get(header)
        if forwarded is not None:
            return forwarded.split(",", 1)[0].strip() == value
    return environ.get("wsgi.url_scheme") == "https"


def submit(kind: str, body: bytes, charset: str, environ: dict[str, Any]) -> Answer | None:
    try:
        found, generation = bearer(environ["HTTP_AUTHORIZATION"])
    except (OperationalError, InterfaceError):
        return None  # the database is away: Django answers 503
    except ProgrammingError as exc:  # the facts' row not migrated yet (code rolled out first)
        log.warning("submission fast path off for this request, Django answers: %s", exc)
        return None
    if found is None or not found.has_scope(Scope.SUBMIT):
        return None  # Django answers 401 or 403
    with facts.at_generation(generation):
        return _submit(kind, body, charset, environ, found)


def _submit(kind: str, body: bytes, charset: str, environ: dict[str, Any], found: ApiToken) -> Answer | None:
    user = found.user
    audit.set_credential(f"token:{found.prefix}")
    try:
        key = idempotency_key(environ.get("HTTP_IDEMPOTENCY_KEY"))
        data = StrictJsonParser().parse(io.BytesIO(body), "application/json", {"encoding": charset})
        # The parser has refused any text that can be neither stored nor shown back: the spec
        # reader need not look again.
        requests = (one_job_requests if kind == "one" else batch_requests)(user, data, text_checked=True)
    except Exception:  # a refusal: Django answers it, throttle and tenant slot included
        return None
    limit = settings.ORRERY_API_TENANT_CONCURRENCY
    slots = get_slots() if limit > 0 else None
    slot = slots.acquire(f"user:{user.pk}", limit, settings.ORRERY_API_TENANT_LEASE_S) if slots else None
    if slots is not None and slot is None:
        return None  # the tenant is busy: Django says so (429)
    try:
        if not SubmitThrottle().allow_request(SimpleNamespace(user=user), None):
            return None  # Django answers 429 with Retry-After; a refusal counts nothing
        try:
            jobs, created = submit_jobs(requests, actor=user, idempotency_key=key, batch=kind == "batch")
            if kind == "one":
                data = submitted_job(jobs[0], created, requests[0])
            else:
                data = submitted_batch(jobs, created, requests)
        except (OperationalError, InterfaceError):
            away = database_unavailable(SimpleNamespace(method="POST", path=environ["PATH_INFO"]))
            return _django(away, secure(environ))
        except Exception as exc:
            response = handle_exception(exc, {})
            if response is None:
                raise
            return _answer(
                response.status_code, response.data, kind, secure(environ), response.headers.items()
            )
        return _answer(201 if created else 200, data, kind, secure(environ))
    finally:
        if slot is not None:
            slots.release(slot)


def bearer(header: str) -> tuple[ApiToken | None, int | None]:
    """The live token of an ``Authorization: Bearer …`` header, with its user, in one query
    written out (``authenticate_token``'s conditions; ``last_used_at`` at most once a minute),
    and the fleet facts' generation read by that query (``foundation.facts``; None on SQLite)."""
    parts = header.split()
    if len(parts) != 2 or not parts[1].isascii() or not parts[1].startswith(TOKEN_PREFIX):
        return None, None
    if not is_postgresql():  # the written-out row is PostgreSQL's (SQLite's times come back naive)
        return authenticate_token(parts[1]), None
    now = timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(_token_sql(), [digest(parts[1]), now])
        row = cursor.fetchone()
    if row is None:
        return None, None
    split = len(ApiToken._meta.concrete_fields)
    token = from_row(ApiToken, row[:split])
    user = from_row(get_user_model(), row[split:-1])
    generation = row[-1]
    ApiToken.user.field.set_cached_value(token, user)
    if token.last_used_at is None or (now - token.last_used_at).total_seconds() > _LAST_USED_RESOLUTION_S:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
    return token, generation


_SQL: dict[str, str] = {}


def _token_sql() -> str:
    if "token" not in _SQL:
        user_model = get_user_model()
        t, u = ApiToken._meta.db_table, user_model._meta.db_table
        columns = f"{columns_of(ApiToken, 't')}, {columns_of(user_model, 'u')}, ({facts.GENERATION_SQL})"
        user_fk = ApiToken._meta.get_field("user").column
        user_pk = user_model._meta.pk.column
        _SQL["token"] = (
            f'SELECT {columns} FROM "{t}" t JOIN "{u}" u ON u."{user_pk}" = t."{user_fk}" '
            f'WHERE t."digest" = %s AND t."revoked_at" IS NULL AND t."expires_at" > %s AND u."is_active" '
            "LIMIT 1"
        )
    return _SQL["token"]


def _answer(
    status: int, data: Any, kind: str, over_https: bool, extra: Iterable[tuple[str, str]] = ()
) -> Answer:
    """The body rendered as DRF's ``JSONRenderer`` would, with the headers the view and the
    middleware would add."""
    payload = JSONRenderer().render(data)
    headers = [(name, value) for name, value in extra if name.lower() not in {"content-type"}]
    headers += [
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(payload))),
        ("Allow", ALLOW[kind]),
        *_security_headers(over_https),
    ]
    return status, headers, payload


def _django(response: Any, over_https: bool) -> Answer:
    """A Django response (the database's 503) with the headers the middleware would add."""
    length = ("Content-Length", str(len(response.content)))
    headers = [*response.items(), length, *_security_headers(over_https)]
    return response.status_code, headers, response.content


def _security_headers(over_https: bool) -> list[tuple[str, str]]:
    """What ``SecurityMiddleware``, ``XFrameOptionsMiddleware`` and ``ContentSecurityPolicy``
    add to an API answer."""
    headers = [("X-Frame-Options", settings.X_FRAME_OPTIONS)]
    if over_https and settings.SECURE_HSTS_SECONDS:
        hsts = f"max-age={settings.SECURE_HSTS_SECONDS}"
        hsts += "; includeSubDomains" if settings.SECURE_HSTS_INCLUDE_SUBDOMAINS else ""
        hsts += "; preload" if settings.SECURE_HSTS_PRELOAD else ""
        headers.append(("Strict-Transport-Security", hsts))
    if settings.SECURE_CONTENT_TYPE_NOSNIFF:
        headers.append(("X-Content-Type-Options", "nosniff"))
    if settings.SECURE_REFERRER_POLICY:
        headers.append(("Referrer-Policy", settings.SECURE_REFERRER_POLICY))
    if settings.SECURE_CROSS_ORIGIN_OPENER_POLICY:
        headers.append(("Cross-Origin-Opener-Policy", settings.SECURE_CROSS_ORIGIN_OPENER_POLICY))
    policy = getattr(settings, "SECURE_CSP", None) or DEFAULT_CSP
    headers.append(("Content-Security-Policy", render_csp(policy)))
    report_only = getattr(settings, "SECURE_CSP_REPORT_ONLY", None)
    if report_only:
        headers.append(("Content-Security-Policy-Report-Only", render_csp(report_only)))
    return headers
