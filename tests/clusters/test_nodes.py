"""Operator actions on nodes and the GPU catalog."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from clusters.choices import NodeState
from clusters.models import GpuModel, NodeEvent, NodeLastSeen
from clusters.selectors import resolve_gpu_model
from clusters.services.nodes import NodeActionRefused, cordon_node, drain_node, resume_node

pytestmark = pytest.mark.django_db

REQUIRED = [
    "h200-141g",
    "h100-80g",
    "a100-80g",
    "a100-40g",
    "l40s-48g",
    "a10-24g",
    "rtx4090-24g",
    "mi300x-192g",
]


def test_catalog_holds_the_common_accelerators():
    assert set(REQUIRED) <= set(GpuModel.objects.values_list("slug", flat=True))


@pytest.mark.parametrize(
    "name, slug",
    [
        ("h100", "h100-80g"),
        ("H100", "h100-80g"),
        ("NVIDIA H100 80GB HBM3", "h100-80g"),
        ("a100", "a100-80g"),
        ("NVIDIA A100-SXM4-40GB", "a100-40g"),
        ("mi300x", "mi300x-192g"),
        (" l40s ", "l40s-48g"),
        ("h200-141g", "h200-141g"),
    ],
)
def test_aliases_and_product_strings_resolve(name, slug):
    assert resolve_gpu_model(name).slug == slug


def test_unknown_gpu_model_resolves_to_nothing():
    assert resolve_gpu_model("tpu-v5") is None


def test_drain_an_idle_node_drains_it_at_once(node, operator):
    node = drain_node(node, actor=operator)
    assert node.state == NodeState.DRAINED
    event = NodeEvent.objects.get(node=node)
    assert (event.from_state, event.to_state, event.actor_id) == (
        NodeState.READY,
        NodeState.DRAINED,
        operator.pk,
    )
    drain_node(node, actor=operator)  # idempotent
    assert NodeEvent.objects.filter(node=node).count() == 1


def test_resume_after_drain_depends_on_heartbeats(node, operator):
    drain_node(node, actor=operator)
    assert resume_node(node, actor=operator).state == NodeState.NOT_READY  # never heartbeated
    cordon_node(node, actor=operator)
    seen = timezone.now() - timedelta(seconds=5)
    NodeLastSeen.objects.create(node=node, seen_at=seen, good_since=seen)
    assert resume_node(node, actor=operator).state == NodeState.READY


def test_resume_a_ready_node_is_refused(node, operator):
    with pytest.raises(NodeActionRefused):
        resume_node(node, actor=operator)
    node.refresh_from_db()
    assert node.state == NodeState.READY


def test_cordon_a_drained_node_is_refused(node, operator):
    drain_node(node, actor=operator)
    with pytest.raises(NodeActionRefused):
        cordon_node(node, actor=operator)
