"""The portal's notification settings page: email on or off, a webhook URL, the events to hear
about, a test message; a new webhook secret is shown on the answer that made it, once."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from scheduling.choices import SUBSCRIBABLE_EVENTS
from scheduling.services.notifications import (
    SettingsRefused,
    recent_notifications,
    rotate_secret,
    save_settings,
    send_test,
    settings_of,
)

ACTIONS = ("save", "rotate", "test")


@login_required
@require_http_methods(["GET", "POST"])
def notification_settings(request: HttpRequest) -> HttpResponse:
    """``GET`` the form; ``POST`` with ``action`` = save, rotate (the secret) or test."""
    if request.method == "GET":
        return _page(request)
    action = request.POST.get("action", "save")
    try:
        if action == "rotate":
            secret = rotate_secret(request.user)
            return _page(request, secret=secret)
        if action == "test":
            channels = [row.channel for row in send_test(request.user)]
            if not channels:
                raise SettingsRefused("email", "nothing to test: turn email on or set a webhook URL first")
            messages.info(request, f"Test queued ({', '.join(channels)}); it arrives within seconds.")
            return redirect("notification-settings")
        if action != "save":
            raise SettingsRefused("action", f"unknown action; use {', '.join(ACTIONS)}")
        saved = save_settings(
            request.user,
            email=request.POST.get("email") == "on",
            webhook_url=request.POST.get("webhook_url", "")[:1000],
            events=request.POST.getlist("events")[:10],
        )
    except SettingsRefused as exc:
        return _page(request, error=(exc.field, str(exc)), form=request.POST, status=400)
    if saved.new_secret:
        return _page(request, secret=saved.new_secret)
    messages.info(request, "Notification settings saved.")
    return redirect("notification-settings")


def _page(
    request: HttpRequest,
    *,
    secret: str | None = None,
    error: tuple[str, str] | None = None,
    form: Any = None,
    status: int = 200,
) -> HttpResponse:
    setting = settings_of(request.user)
    if form is not None:  # a refused form shows what was typed, with the error at its field
        chosen = set(form.getlist("events"))
        email, webhook_url = form.get("email") == "on", form.get("webhook_url", "")[:1000]
    else:
        chosen, email, webhook_url = set(setting.events), setting.email, setting.webhook_url
    context = {
        "email": email,
        "webhook_url": webhook_url,
        "events": [(value, label, value in chosen) for value, label in SUBSCRIBABLE_EVENTS],
        "secret_set": bool(setting.webhook_secret),
        "secret": secret,
        "error_field": error[0] if error else "",
        "error": error[1] if error else "",
        "recent": recent_notifications(request.user),
    }
    response = render(request, "portal/notification_settings.html", context, status=status)
    if secret:
        response["Cache-Control"] = "no-store"  # the secret is shown once: never from a cache
    return response
