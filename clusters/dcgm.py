"""GPU telemetry under the DCGM exporter's names, for dashboards built for NVIDIA's exporter.

Per GPU with fresh telemetry, four gauges (help texts as the exporter words them):

* ``DCGM_FI_DEV_GPU_UTIL`` — utilisation, percent (``GpuDevice.utilization``);
* ``DCGM_FI_DEV_FB_USED`` — frame buffer used, MiB (``memory_used_mb``);
* ``DCGM_FI_DEV_POWER_USAGE`` — power draw, W (``power_w``);
* ``DCGM_FI_DEV_GPU_TEMP`` — temperature, °C (``temperature_c``);

labelled as the exporter labels them — ``gpu`` (the index), ``UUID``, ``Hostname`` (the node's
name), ``modelName`` (the catalog model's name) — plus ``cluster``, Orrery's own (node names are
unique per cluster only). A GPU whose telemetry is older than ``ORRERY_TELEMETRY_STALE_S`` is
left out rather than reported as current, as the exporter of a dead node would be; a reading a
GPU did not give (null) is left out of that gauge alone.

At 80,000 GPUs these are 320,000 series: they are not kept in any process's registry (the
default ``/metrics`` stays small) but read in **one** query per scrape (``values_list``, no
model instances) and written as Prometheus' text format (0.0.4) here — prometheus_client's
generic exposition takes ten times as long for this many samples (benchmarks/gpu_metrics.py).
``portal.scrape.gpu_metrics`` serves it at ``/metrics/gpus`` under ``/metrics``' access rule.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from clusters.models import GpuDevice

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, help, column); the row's value columns follow the label columns in this order.
GPU_METRICS: tuple[tuple[str, str, str], ...] = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "utilization"),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "memory_used_mb"),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_w"),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temperature_c"),
)
_LABEL_COLUMNS = ("index", "uuid", "node__name", "model__name", "node__cluster__name")
LABELS = ("gpu", "UUID", "Hostname", "modelName", "cluster")

GpuRow = tuple[Any, ...]  # (index, uuid, node, model name, cluster, *values in GPU_METRICS order)

_CHUNK = 5000  # lines per piece of a streamed answer


def fresh_gpu_rows(now: datetime | None = None) -> list[GpuRow]:
    """Every GPU whose telemetry is fresh, in one query: label columns, then values."""
    since = (now or timezone.now()) - timedelta(seconds=settings.ORRERY_TELEMETRY_STALE_S)
    columns = (*_LABEL_COLUMNS, *(column for _, _, column in GPU_METRICS))
    # No ordering: Prometheus does not care, and sorting 80,000 rows is the query's main cost.
    return list(GpuDevice.objects.filter(telemetry_at__gte=since).order_by().values_list(*columns))


def _escape(value: object) -> str:
    """A label value as the text format wants it: backslash, double quote and newline escaped
    (a node or model name is whatever an agent or an operator typed)."""
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def exposition(rows: Sequence[GpuRow]) -> Iterator[str]:
    """The text format of ``rows``, one metric family after another, in pieces of a few thousand
    lines (a streamed answer never holds all 320,000 lines at once)."""
    n = len(_LABEL_COLUMNS)
    labels = [
        f'{{gpu="{row[0]}",UUID="{_escape(row[1])}",Hostname="{_escape(row[2])}",'
        f'modelName="{_escape(row[3])}",cluster="{_escape(row[4])}"}} '
        for row in rows
    ]
    for i, (name, help_text, _) in enumerate(GPU_METRICS):
        piece = [f"# HELP {name} {help_text}\n# TYPE {name} gauge\n"]
        for label, row in zip(labels, rows, strict=True):
            value = row[n + i]
            if value is not None:
                piece.append(f"{name}{label}{value!r}\n")
                if len(piece) >= _CHUNK:
                    yield "".join(piece)
                    piece = []
        yield "".join(piece)
