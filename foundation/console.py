"""Building blocks of the operations console shared by every app's admin."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest


def service_action(
    service: Callable[..., Any], *, name: str, description: str, refusals: tuple[type[Exception], ...]
) -> Callable[[admin.ModelAdmin, HttpRequest, QuerySet], None]:
    """An admin action that calls ``service(obj, actor=request.user)`` for each selected row.

    Refusals (an illegal transition, a node in the wrong state) become one warning each; the
    other rows still go through. Anything else is a bug and propagates.
    """

    def action(modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet) -> None:
        done, refused = 0, []
        for obj in queryset:
            try:
                service(obj, actor=request.user)
                done += 1
            except refusals as exc:
                refused.append(str(exc))
        if done:
            modeladmin.message_user(request, f"{description}: {done} done.", messages.SUCCESS)
        for why in refused:
            modeladmin.message_user(request, why, messages.WARNING)

    action.__name__ = name
    return admin.action(description=description)(action)


class ReadOnlyAdminMixin:
    """For append-only records (events, history): list and view, never add, edit or delete."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReadOnlyInline(ReadOnlyAdminMixin, admin.TabularInline):
    """An inline of append-only rows shown on their parent's page."""

    extra = 0
    can_delete = False
