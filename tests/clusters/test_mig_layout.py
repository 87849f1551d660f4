"""MIG layouts and shareable GPUs in the console: what an operator may set on a GPU, checked
before it is saved (a layout no GPU can hold is a form error, not an agent's failure later), and
the instances a GPU reports shown on its page."""

from __future__ import annotations

import json

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from clusters.models import GpuDevice
from clusters.services.mig import check_mig_layout
from tests.factories import make_mig

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("value", "stored"),
    [
        (None, None),
        ([], []),
        (["3g.40gb", "3g.40gb"], ["3g.40gb", "3g.40gb"]),
        (["1G.10GB"] * 7, ["1g.10gb"] * 7),
        (["4g.40gb", "2g.20gb", "1g.10gb"], ["4g.40gb", "2g.20gb", "1g.10gb"]),
        (["1g.10gb+me"], ["1g.10gb+me"]),
    ],
    ids=["leave", "off", "halves", "sevenths", "mixed", "media-extension"],
)
def test_layouts_a_gpu_can_hold(value, stored):
    assert check_mig_layout(value) == stored


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("3g.40gb", "a list"),
        ({"0": "1g.10gb"}, "a list"),
        (["1g.10gb"] * 8, "at most 7 instances"),
        (["4g.40gb", "4g.40gb"], "8 slices"),
        (["9g.90gb"], "not a MIG profile"),
        ([7], "not a MIG profile"),
        (["1g.10gb; rm -rf /"], "not a MIG profile"),
        (["x" * 10_000], "not a MIG profile"),
    ],
    ids=["string", "mapping", "eight", "too-many-slices", "profile", "number", "injection", "huge"],
)
def test_layouts_no_gpu_can_hold_are_refused(value, words):
    with pytest.raises(ValidationError) as refused:
        check_mig_layout(value)
    assert words in refused.value.messages[0]


def gpu_form(gpu: GpuDevice, **changes) -> dict:
    data = {"health": gpu.health, "health_reason": gpu.health_reason, "shareable": gpu.shareable}
    data["mig_layout_wanted"] = json.dumps(gpu.mig_layout_wanted)
    data |= {"mig_instances-TOTAL_FORMS": 0, "mig_instances-INITIAL_FORMS": 0} | changes
    return {k: v for k, v in data.items() if v is not False}


def test_an_operator_sets_a_layout_and_marks_a_gpu_shareable(client, operator, node):
    client.force_login(operator)
    make_mig(node, 0, ["3g.40gb", "2g.20gb", "2g.20gb"])
    gpu, other = GpuDevice.objects.get(node=node, index=0), GpuDevice.objects.get(node=node, index=1)
    page = client.get(reverse("admin:clusters_gpudevice_change", args=[gpu.pk])).content.decode()
    assert "3g.40gb, 2g.20gb ×2" in page and "MIG-" in page
    url = reverse("admin:clusters_gpudevice_change", args=[gpu.pk])
    response = client.post(url, gpu_form(gpu, mig_layout_wanted='["1g.10gb", "1g.10gb", "5G.50GB"]'))
    assert response.status_code == 302
    assert GpuDevice.objects.get(pk=gpu.pk).mig_layout_wanted == ["1g.10gb", "1g.10gb", "5g.50gb"]
    url = reverse("admin:clusters_gpudevice_change", args=[other.pk])
    assert client.post(url, gpu_form(other, shareable="on")).status_code == 302
    assert GpuDevice.objects.get(pk=other.pk).shareable


def test_a_layout_no_gpu_can_hold_is_a_form_error(client, operator, node):
    client.force_login(operator)
    gpu = GpuDevice.objects.get(node=node, index=0)
    url = reverse("admin:clusters_gpudevice_change", args=[gpu.pk])
    response = client.post(url, gpu_form(gpu, mig_layout_wanted='["7g.80gb", "1g.10gb"]'))
    assert response.status_code == 200 and "8 slices" in response.content.decode()
    assert GpuDevice.objects.get(pk=gpu.pk).mig_layout_wanted is None
