"""MIG and power end to end on a real ``orrery-agent`` process (fake A100s, GPU 0 in MIG mode)
talking to a live server: its registration becomes MIG instance rows, its heartbeats carry each
GPU's power and the node's, a layout an operator wants is applied by the agent and reported
back, and a GPU that a job holds keeps its layout until the job has ended. The job is placed by
hand (its allocation names the instance), as the scheduler would place it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import transaction

from clusters.choices import ClusterKind, Identity, NodeState
from clusters.ingest.buffer import get_buffer
from clusters.models import GpuDevice, MigInstance, Node, NodeEvent
from clusters.services.credentials import create_join_token, forget_cached_identities
from clusters.services.mig import want_mig_layout
from scheduling.choices import JobState
from scheduling.dispatch.desired import forget_desired
from scheduling.models import Allocation, Job
from scheduling.services.allocations import NodePlacement, bind_job
from tests.factories import ensure_catalog, make_cluster, make_job, make_project, make_queue, make_user
from tests.processes import spawn_agent, wait

pytestmark = pytest.mark.django_db(transaction=True)
LAYOUT = "0:1g.10gb,1g.10gb,3g.40gb"


@pytest.fixture
def n1(live_server, settings, tmp_path) -> Iterator[dict]:
    """Node n1: a real agent with two fake A100s, GPU 0 in MIG mode, drawing 50 W idle and 350 W
    busy, registered and ready."""
    settings.ORRERY_HEARTBEAT_INTERVAL = 1
    ensure_catalog()
    cluster = make_cluster("lab", kind=ClusterKind.NATIVE, identity=Identity.SHARED)
    _, join = create_join_token(cluster)
    work = tmp_path / "agent"
    agent = spawn_agent(
        live_server.url, join, work, "n1", "a100:2", "--fake-mig", LAYOUT, "--fake-power", "50:350"
    )
    try:
        node = wait(lambda: Node.objects.filter(name="n1", gpus__isnull=False).first(), "n1 to register")
        Node.objects.filter(pk=node.pk).update(state=NodeState.READY)
        yield {"node": node, "work": work, "cluster": cluster}
    finally:
        agent.kill()
        agent.wait()
        for meta in work.glob("attempts/*/meta.json"):
            with contextlib.suppress(ProcessLookupError, KeyError, ValueError):
                os.killpg(json.loads(meta.read_text())["pgid"], signal.SIGKILL)


def layout(node: Node, index: int) -> list[str]:
    return list(
        MigInstance.objects.filter(gpu__node=node, gpu__index=index)
        .order_by("slot")
        .values_list("profile", flat=True)
    )


def want(node: Node, wishes: dict[int, list[str]]) -> None:
    for index, profiles in wishes.items():
        want_mig_layout(GpuDevice.objects.get(node=node, index=index), profiles)
    forget_cached_identities()  # the live server runs in this process: as after CACHE_TTL_S


def test_registration_makes_instances_and_heartbeats_carry_power(n1):
    node = n1["node"]
    assert layout(node, 0) == ["1g.10gb", "1g.10gb", "3g.40gb"] and layout(node, 1) == []
    assert list(
        GpuDevice.objects.filter(node=node).order_by("index").values_list("mig_enabled", flat=True)
    ) == [
        True,
        False,
    ]
    assert set(MigInstance.objects.filter(gpu__node=node).values_list("memory_mb", flat=True)) == {
        9984,
        40704,
    }
    assert all(u.startswith("MIG-fake-") for u in MigInstance.objects.values_list("uuid", flat=True))
    record = wait(lambda: get_buffer().latest([node.pk]).get(node.pk), "a heartbeat in the buffer")
    assert record["pw"] == 100.0  # the GPUs' sum: two idle A100s at 50 W
    assert [g[6] for g in record["g"]] == [50.0, 50.0]


def test_a_wanted_layout_is_applied_by_the_agent_and_reported_back(n1):
    node = n1["node"]
    want(node, {0: ["7g.80gb"], 1: ["3g.40gb", "3g.40gb"]})
    wait(
        lambda: layout(node, 0) == ["7g.80gb"] and layout(node, 1) == ["3g.40gb", "3g.40gb"],
        "the new layouts",
    )
    assert GpuDevice.objects.filter(node=node, mig_enabled=True).count() == 2
    assert NodeEvent.objects.filter(node=node, reason="GPU 0 MIG 7g.80gb; GPU 1 MIG 3g.40gb,3g.40gb").exists()
    want(node, {0: []})
    wait(lambda: not GpuDevice.objects.get(node=node, index=0).mig_enabled, "MIG off on GPU 0")
    assert layout(node, 0) == [] and layout(node, 1) == ["3g.40gb", "3g.40gb"]


def test_a_job_on_a_mig_instance_sees_only_it_and_keeps_its_gpu_layout_until_it_ends(n1):
    node, work = n1["node"], n1["work"]
    alice = make_user("alice")
    queue = make_queue(make_project("vision", members=(alice,)))
    job = make_job(alice, queue, gpus=1, model="a100", gpu_slice="3g.40gb", command="")
    job.command = 'echo "$CUDA_VISIBLE_DEVICES $ORRERY_MIG_PROFILE $ORRERY_GPUS_PER_NODE" > marker; sleep 4'
    job.save(update_fields=["command"])
    instance = MigInstance.objects.get(gpu__node=node, gpu__index=0, slot=2)
    with transaction.atomic():  # what the agent is told names the instance from the start
        attempt = bind_job(job, [NodePlacement(node, [0])])
        Allocation.objects.filter(attempt=attempt, gpu__isnull=False).update(mig_instance=instance)
    forget_desired([node.pk])
    marker = Path(work / "jobs" / str(attempt.pk) / "marker")
    wait(lambda: marker.exists() and marker.read_text().strip(), "the job to run")
    assert marker.read_text().split() == [instance.uuid, "3g.40gb", "1"]

    want(node, {0: ["7g.80gb"]})
    wait(lambda: Job.objects.get(pk=job.pk).state == JobState.SUCCEEDED, "the job to end", timeout=30)
    # While it ran, its GPU kept the layout; once it ended, the GPU took the new one.
    wait(lambda: layout(node, 0) == ["7g.80gb"], "GPU 0's new layout")
    changed = (
        NodeEvent.objects.filter(node=node, reason="GPU 0 MIG 7g.80gb").values_list("at", flat=True).get()
    )
    assert changed >= Job.objects.get(pk=job.pk).finished_at
    assert Allocation.objects.get(attempt=attempt, gpu__isnull=False).mig_instance_id is None  # history
