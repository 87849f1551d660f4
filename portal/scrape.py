"""``/metrics``: django-prometheus' exposition, for Prometheus and operators only.

The page names every cluster, queue and internal counter of the site, so it answers a request
that carries the scrape token (``Authorization: Bearer $ORRERY_METRICS_TOKEN``) or comes from a
signed-in staff user; anyone else gets 401 (no credentials) or 403 (wrong ones).
"""

from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django_prometheus.exports import ExportToDjangoView


def _bearer(request: HttpRequest) -> str | None:
    scheme, _, credentials = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else None


def metrics(request: HttpRequest) -> HttpResponse:
    """The metrics page, after checking the scrape token or the staff session."""
    presented = _bearer(request)
    expected = settings.ORRERY_METRICS_TOKEN
    if presented is not None:
        # Constant-time comparison; with no token configured every presented one is wrong.
        if expected and hmac.compare_digest(presented.encode(), expected.encode()):
            return ExportToDjangoView(request)
        return HttpResponse("Invalid scrape token.\n", status=403, content_type="text/plain")
    if request.user.is_authenticated and request.user.is_active and request.user.is_staff:
        return ExportToDjangoView(request)
    if request.user.is_authenticated:
        return HttpResponse("Staff only.\n", status=403, content_type="text/plain")
    response = HttpResponse("Authentication required.\n", status=401, content_type="text/plain")
    response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response
