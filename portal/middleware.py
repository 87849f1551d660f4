"""Request hygiene applied before any view."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, JsonResponse


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
