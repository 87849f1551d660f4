"""``/metrics`` and ``/metrics/gpus``: Prometheus' expositions, for Prometheus and operators only.

The pages name every cluster, queue, node and internal counter of the site, so they answer a
request that carries the scrape token (``Authorization: Bearer $ORRERY_METRICS_TOKEN``) or comes
from a signed-in staff user; anyone else gets 401 (no credentials) or 403 (wrong ones).

``/metrics`` is django-prometheus' registry (requests, database, scheduler, heartbeat pipeline,
queues under Kueue's names). ``/metrics/gpus`` is every GPU's telemetry under the DCGM
exporter's names (``clusters.dcgm``): a series per GPU and reading, so it has an endpoint of its
own, read from the database at each scrape, and the default page stays small.
"""

from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django_prometheus.exports import ExportToDjangoView
from prometheus_client import generate_latest

from clusters import dcgm
from scheduling import queue_metrics


def _bearer(request: HttpRequest) -> str | None:
    scheme, _, credentials = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else None


def _refusal(request: HttpRequest) -> HttpResponse | None:
    """None when the request may read metrics; otherwise the 401 or 403 to answer."""
    presented = _bearer(request)
    expected = settings.ORRERY_METRICS_TOKEN
    if presented is not None:
        # Constant-time comparison; with no token configured every presented one is wrong.
        if expected and hmac.compare_digest(presented.encode(), expected.encode()):
            return None
        return HttpResponse("Invalid scrape token.\n", status=403, content_type="text/plain")
    if request.user.is_authenticated and request.user.is_active and request.user.is_staff:
        return None
    if request.user.is_authenticated:
        return HttpResponse("Staff only.\n", status=403, content_type="text/plain")
    response = HttpResponse("Authentication required.\n", status=401, content_type="text/plain")
    response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response


def metrics(request: HttpRequest) -> HttpResponse:
    """The metrics page, after checking the scrape token or the staff session: django-prometheus'
    registry, then the queues under Kueue's names (read from the database now, in this request)."""
    refused = _refusal(request)
    if refused is not None:
        return refused
    response = ExportToDjangoView(request)  # always the text format, which concatenates
    response.write(generate_latest(queue_metrics.REGISTRY))
    return response


def gpu_metrics(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    """Every GPU's fresh telemetry under the DCGM exporter's names: one query, then streamed."""
    refused = _refusal(request)
    if refused is not None:
        return refused
    rows = dcgm.fresh_gpu_rows()  # read before the answer starts: no query while streaming
    return StreamingHttpResponse(dcgm.exposition(rows), content_type=dcgm.CONTENT_TYPE)
