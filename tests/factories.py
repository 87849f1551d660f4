"""Tiny builders for tests: ``make_node(gpus=8, model="h100")``. Each takes ``using`` so the same
rows can be built on either database."""

from __future__ import annotations

import importlib
import itertools
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

from django.apps import apps as django_apps
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractUser
from django.db import connections
from django.utils import timezone

from clusters.choices import ClusterKind, ClusterState, NodeState
from clusters.models import Cluster, GpuDevice, GpuModel, MigInstance, Node
from clusters.selectors import resolve_gpu_model
from portal.choices import Role
from portal.models import Membership, Project
from scheduling.choices import JobState
from scheduling.models import Budget, Job, Queue

_seq = itertools.count(1)
GiB = 2**30


def make_user(name: str | None = None, *, staff: bool = False, using: str = "default") -> AbstractUser:
    name = name or f"user{next(_seq)}"
    return (
        get_user_model()
        .objects.db_manager(using)
        .create_user(username=name, password=name, is_staff=staff, is_superuser=staff)
    )


def make_project(
    name: str | None = None,
    *,
    members: tuple[AbstractUser, ...] = (),
    role: str = Role.MEMBER,
    using: str = "default",
) -> Project:
    project = Project.objects.using(using).create(name=name or f"proj{next(_seq)}")
    for user in members:
        Membership.objects.using(using).create(user=user, project=project, role=role)
    return project


def make_queue(project: Project, name: str = "default", *, using: str = "default", **fields: Any) -> Queue:
    return Queue.objects.using(using).create(project=project, name=name, **fields)


def ensure_catalog(using: str = "default") -> None:
    """Transactional tests flush the tables, data migrations included: put the catalog back."""
    if GpuModel.objects.using(using).exists():
        return
    migration = importlib.import_module("clusters.migrations.0002_gpu_catalog")
    migration.seed(django_apps, SimpleNamespace(connection=connections[using]))


def gpu_model(name: str, using: str = "default") -> GpuModel:
    ensure_catalog(using)
    if using == "default":
        model = resolve_gpu_model(name)
    else:
        model = GpuModel.objects.using(using).filter(aliases__name=name).first() or GpuModel.objects.using(
            using
        ).get(slug=name)
    assert model is not None, name
    return model


def make_cluster(name: str | None = None, *, using: str = "default", **fields: Any) -> Cluster:
    fields.setdefault("kind", ClusterKind.SIMULATED)
    fields.setdefault("state", ClusterState.READY)
    return Cluster.objects.using(using).create(name=name or f"c{next(_seq)}", **fields)


def make_node(
    cluster: Cluster | None = None,
    *,
    gpus: int = 8,
    model: str = "h100",
    name: str | None = None,
    state: str = NodeState.READY,
    using: str = "default",
    **fields: Any,
) -> Node:
    cluster = cluster or make_cluster(using=using)
    fields = {
        "cpu_millicores_capacity": 64_000,
        "cpu_millicores_allocatable": 64_000,
        "memory_bytes_capacity": 512 * GiB,
        "memory_bytes_allocatable": 512 * GiB,
        **fields,
    }
    node = Node.objects.using(using).create(
        cluster=cluster, name=name or f"n{next(_seq)}", state=state, gpu_capacity=gpus, **fields
    )
    catalog = gpu_model(model, using)
    GpuDevice.objects.using(using).bulk_create(
        GpuDevice(node=node, index=i, model=catalog, memory_mb=catalog.memory_mb) for i in range(gpus)
    )
    return node


def make_job(
    owner: AbstractUser,
    queue: Queue,
    *,
    gpus: int = 1,
    model: str = "h100",
    nodes: int = 1,
    state: str = JobState.PENDING,
    using: str = "default",
    **fields: Any,
) -> Job:
    return Job.objects.using(using).create(
        owner=owner,
        project_id=queue.project_id,
        queue=queue,
        name=fields.pop("name", f"job{next(_seq)}"),
        gpu_model=gpu_model(model, using) if gpus else None,
        gpus_per_node=gpus,
        nodes=nodes,
        state=state,
        **fields,
    )


def make_budget(
    project: Project,
    gpu_hours: int,
    *,
    queue: Queue | None = None,
    on_overrun: str = "refuse",
    days: tuple[float, float] = (-1, 29),
    **fields: Any,
) -> Budget:
    """A budget whose window runs from ``days[0]`` to ``days[1]`` days from now."""
    now = timezone.now()
    return Budget.objects.create(
        project=project,
        queue=queue,
        gpu_hours=gpu_hours,
        on_overrun=on_overrun,
        starts_at=fields.pop("starts_at", now + timedelta(days=days[0])),
        ends_at=fields.pop("ends_at", now + timedelta(days=days[1])),
        **fields,
    )


def make_mig(node: Node, index: int, profiles: list[str], *, using: str = "default") -> list[MigInstance]:
    """Put GPU ``index`` of the node in MIG mode with one instance per profile (``"1g.10gb"``:
    memory from the name, slices from its first digit)."""
    gpu = GpuDevice.objects.using(using).get(node=node, index=index)
    gpu.mig_enabled = True
    gpu.save(using=using)
    return [
        MigInstance.objects.using(using).create(
            gpu=gpu,
            slot=slot,
            profile=profile,
            uuid=f"MIG-{node.name}-{index}-{slot}",
            memory_mb=int(profile.split(".")[1].removesuffix("gb")) * 1024,
            slices=int(profile[0]),
        )
        for slot, profile in enumerate(profiles)
    ]


def make_shareable(node: Node, *indices: int, using: str = "default") -> None:
    """Offer these GPUs of the node in fractions."""
    GpuDevice.objects.using(using).filter(node=node, index__in=indices).update(shareable=True)
