"""Hooks for django-axes, which throttles the two login pages (``/accounts/login/`` and
``/admin/login/``).

Axes counts failed sign-ins per (user name, client address) pair in the database and, at
``ORRERY_LOGIN_FAILURE_LIMIT`` failures, refuses that pair for ``ORRERY_LOGIN_LOCKOUT_S``
seconds — even with the right password. ``settings.AXES_*`` says how; this module gives it the
client's address and the page a refused sign-in sees.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth.forms import AuthenticationForm
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render


def client_address(request: HttpRequest) -> str | None:
    """The address a sign-in comes from: the peer, or — only when the operator said a proxy is
    in front (``ORRERY_BEHIND_PROXY``) — the last ``X-Forwarded-For`` entry, the one that proxy
    appended. Entries to its left are whatever the client sent, so they are never used."""
    if settings.ORRERY_BEHIND_PROXY:
        forwarded = [part.strip() for part in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")]
        if forwarded[-1]:
            return forwarded[-1]
    return request.META.get("REMOTE_ADDR")


def lockout_response(
    request: HttpRequest, original_response: HttpResponse | None = None, credentials: Any = None
) -> HttpResponse:
    """The sign-in page again, with 429, a ``Retry-After`` and a sentence saying why."""
    seconds = settings.ORRERY_LOGIN_LOCKOUT_S
    context = {
        "form": AuthenticationForm(request),
        "locked_out": True,
        "lockout_minutes": max(1, round(seconds / 60)),
        "next": request.POST.get("next") or request.GET.get("next") or "",
    }
    response = render(request, "registration/login.html", context, status=429)
    response["Retry-After"] = str(seconds)
    return response
