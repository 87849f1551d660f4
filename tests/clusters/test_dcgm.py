"""GPU telemetry under the DCGM exporter's names at /metrics/gpus: names, labels, values, stale
GPUs left out, one query per scrape, and the scrape token's rule."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from clusters.dcgm import exposition, fresh_gpu_rows
from clusters.models import GpuDevice, GpuModel
from tests.factories import make_cluster, make_node, make_user

pytestmark = pytest.mark.django_db

TOKEN = "scrape-0123456789abcdefghijklmnopqrstuvwxyz"
_VALUE = r'"((?:[^"\\\n]|\\.)*)"'  # a label value, escapes included
SAMPLE = re.compile(
    rf"^(\w+)\{{gpu={_VALUE},UUID={_VALUE},Hostname={_VALUE},modelName={_VALUE},cluster={_VALUE}\}} (\S+)$"
)


def samples(text: str) -> dict[tuple[str, str, str, str], tuple[str, str, str]]:
    """``{(metric, cluster, Hostname, gpu): (UUID, modelName, value)}`` of an exposition."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        match = SAMPLE.match(line)
        assert match, line
        name, gpu, uuid, host, model, cluster, value = match.groups()
        out[name, cluster, host, gpu] = (uuid, model, value)
    return out


def telemetry(node, index: int, *, age_s: float = 5, **values) -> None:
    fields = {"utilization": 87.0, "memory_used_mb": 40960, "power_w": 512.5, "temperature_c": 64.0} | values
    GpuDevice.objects.filter(node=node, index=index).update(
        uuid=f"GPU-{node.cluster.name}-{node.name}-{index}",
        telemetry_at=timezone.now() - timedelta(seconds=age_s),
        **fields,
    )


@pytest.fixture
def scraped(settings):
    settings.ORRERY_TELEMETRY_STALE_S = 120
    node = make_node(make_cluster("sim-g"), gpus=2, model="h100", name="g-001")
    telemetry(node, 0)
    telemetry(node, 1, age_s=600)  # stale: its node went quiet ten minutes ago
    other = make_node(make_cluster("sim-h"), gpus=1, model="a100", name="g-001")  # same name, other cluster
    telemetry(other, 0, utilization=None, temperature_c=12.5)
    return "".join(exposition(fresh_gpu_rows()))


def test_names_labels_and_values_follow_the_dcgm_exporter(scraped):
    found = samples(scraped)
    h100 = GpuModel.objects.get(slug="h100-80g").name
    assert found["DCGM_FI_DEV_GPU_UTIL", "sim-g", "g-001", "0"] == ("GPU-sim-g-g-001-0", h100, "87.0")
    assert found["DCGM_FI_DEV_FB_USED", "sim-g", "g-001", "0"][2] == "40960"
    assert found["DCGM_FI_DEV_POWER_USAGE", "sim-g", "g-001", "0"][2] == "512.5"
    assert found["DCGM_FI_DEV_GPU_TEMP", "sim-g", "g-001", "0"][2] == "64.0"
    a100 = GpuModel.objects.get(slug="a100-80g").name
    assert found["DCGM_FI_DEV_GPU_TEMP", "sim-h", "g-001", "0"] == ("GPU-sim-h-g-001-0", a100, "12.5")
    for name in (
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_GPU_TEMP",
    ):
        assert f"# TYPE {name} gauge\n" in scraped


def test_stale_gpus_are_left_out_and_missing_readings_skipped(scraped):
    found = set(samples(scraped))
    assert not [key for key in found if key[1:] == ("sim-g", "g-001", "1")]  # stale: no series at all
    assert ("DCGM_FI_DEV_GPU_UTIL", "sim-h", "g-001", "0") not in found  # it gave no utilisation
    assert ("DCGM_FI_DEV_GPU_TEMP", "sim-h", "g-001", "0") in found
    assert len(found) == 4 + 3


def test_label_values_are_escaped(settings):
    settings.ORRERY_TELEMETRY_STALE_S = 120
    node = make_node(make_cluster("sim-e"), gpus=1, name='evil"} 1\nDCGM_FI_DEV_GPU_UTIL{gpu="9')
    telemetry(node, 0)
    text = "".join(exposition(fresh_gpu_rows()))
    assert len(samples(text)) == 4  # one GPU, four series, no injected line
    assert r'Hostname="evil\"} 1\nDCGM_FI_DEV_GPU_UTIL{gpu=\"9"' in text


def test_one_query_whatever_the_number_of_gpus(settings, django_assert_num_queries):
    settings.ORRERY_TELEMETRY_STALE_S = 120
    for i in range(3):
        node = make_node(make_cluster(f"sim-q{i}"), gpus=8, name=f"q{i}")
        for index in range(8):
            telemetry(node, index)
    with django_assert_num_queries(1):
        rows = fresh_gpu_rows()
    assert len(samples("".join(exposition(rows)))) == 3 * 8 * 4


@pytest.mark.parametrize(
    "who, authorization, status",
    [
        pytest.param(None, None, 401, id="anonymous"),
        pytest.param(None, "Bearer wrong", 403, id="wrong-token"),
        pytest.param("member", None, 403, id="member-session"),
        pytest.param(None, f"Bearer {TOKEN}", 200, id="scrape-token"),
        pytest.param("staff", None, 200, id="staff-session"),
    ],
)
def test_the_page_follows_the_metrics_access_rule(client, settings, scraped, who, authorization, status):
    settings.ORRERY_METRICS_TOKEN = TOKEN
    if who:
        client.force_login(make_user(who, staff=who == "staff"))
    headers = {"HTTP_AUTHORIZATION": authorization} if authorization else {}
    answer = client.get("/metrics/gpus", **headers)
    assert answer.status_code == status
    body = b"".join(answer.streaming_content) if answer.streaming else answer.content
    assert (b"DCGM_FI_DEV_GPU_UTIL" in body) == (status == 200)
    if status == 200:
        assert answer["Content-Type"].startswith("text/plain; version=0.0.4")
        assert body.decode() == scraped


def test_the_default_page_stays_free_of_per_gpu_series(client, settings, scraped):
    settings.ORRERY_METRICS_TOKEN = TOKEN
    answer = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert answer.status_code == 200 and b"DCGM_FI_" not in answer.content
