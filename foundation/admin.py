"""The audit log in the operations console: read-only, searchable, exportable."""

from __future__ import annotations

import json

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBadRequest, StreamingHttpResponse
from django.urls import URLPattern, path
from django.utils import timezone

from foundation.audit import export_lines
from foundation.console import ReadOnlyAdminMixin
from foundation.models import AuditEntry

_CONTENT_TYPES = {"csv": "text/csv; charset=utf-8", "jsonl": "application/x-ndjson"}


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Nobody adds, changes or deletes an entry here (the database refuses the last two anyway).
    *Export* streams the entries the changelist shows (its search, filters and dates) as CSV or
    JSON lines, without holding them in memory."""

    list_display = ["at", "action", "actor_name", "source", "target", "summary"]
    list_filter = ["action"]  # sources are too many to list: search them
    date_hierarchy = "at"
    search_fields = ["actor_name", "target", "source", "action"]
    show_full_result_count = False  # a second COUNT over a long log, for a number nobody reads
    readonly_fields = ["at", "action", "actor_id", "actor_name", "source", "target", "details"]

    def get_urls(self) -> list[URLPattern]:
        export = path(
            "export.<str:fmt>",
            self.admin_site.admin_view(self.export_view),
            name="foundation_auditentry_export",
        )
        return [export, *super().get_urls()]

    @admin.display(description="Details")
    def summary(self, obj: AuditEntry) -> str:
        text = json.dumps(obj.details, sort_keys=True)
        return text if len(text) <= 120 else text[:119] + "…"

    def export_view(self, request: HttpRequest, fmt: str) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        if fmt not in _CONTENT_TYPES:
            raise Http404(f"no export format {fmt!r}; use csv or jsonl")
        try:
            found = self.filtered_entries(request)
        except IncorrectLookupParameters:
            return HttpResponseBadRequest("unknown filter in the query string")
        entries = found.order_by("id").iterator(chunk_size=2000)
        response = StreamingHttpResponse(export_lines(entries, fmt), content_type=_CONTENT_TYPES[fmt])
        stamp = timezone.now().strftime("%Y%m%dT%H%M%SZ")
        response["Content-Disposition"] = f'attachment; filename="orrery-audit-{stamp}.{fmt}"'
        return response

    def filtered_entries(self, request: HttpRequest) -> QuerySet[AuditEntry]:
        """The entries the changelist would show for the same query string."""
        return self.get_changelist_instance(request).get_queryset(request)
