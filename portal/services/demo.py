"""Seeding of the demo fleet for ``make demo``. Demo data only: refuses a production setup.

Idempotent: users, projects, clusters, nodes and queues are matched by name, and demo jobs by
idempotency key, so a second run changes nothing.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from decimal import Decimal

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractUser
from django.db import transaction
from django.utils import timezone

from clusters.choices import ClusterKind, ClusterState, NodeState
from clusters.models import Cluster, GpuDevice, GpuModel, MigInstance, Node
from portal.choices import Role
from portal.models import Membership, Project
from scheduling.choices import JobState, PendingReason
from scheduling.models import Queue, QueueQuota
from scheduling.services.allocations import NodePlacement, bind_job
from scheduling.services.jobs import JobRequest, cancel_job, explain_pending, hold_job, submit_job
from scheduling.services.transitions import transition_job

GiB = 2**30
DEMO_USERS = [("admin", True), ("alice", False), ("bob", False)]  # password = username


class DemoRefused(Exception):
    """Seeding was asked for on a production configuration."""


@dataclass(frozen=True)
class DemoCluster:
    name: str
    gpu_model: str
    nodes: int
    gpus_per_node: int
    region: str
    energy_price_per_kwh: Decimal  # made up, of the order of a data centre's
    carbon_g_per_kwh: int  # of the order of the region's grid


DEMO_CLUSTERS = [
    DemoCluster("sim-a", "h100-80g", 8, 8, "eu-west", Decimal("0.21"), 250),
    DemoCluster("sim-b", "a100-80g", 8, 8, "us-east", Decimal("0.12"), 390),
    DemoCluster("sim-c", "l40s-48g", 6, 4, "eu-central", Decimal("0.28"), 380),
]


def seed_demo() -> dict[str, int]:
    """Create the demo fleet, tenants and jobs; returns counts of what exists afterwards."""
    if settings.PRODUCTION:
        raise DemoRefused("Refusing to seed demo users and passwords into a production configuration.")
    with transaction.atomic():
        users = _users()
        projects = _projects(users)
        for spec in DEMO_CLUSTERS:
            _cluster(spec)
        _fine_grained()
        queues = _queues(projects)
    _jobs(users, queues)
    return {
        "clusters": Cluster.objects.count(),
        "nodes": Node.objects.count(),
        "gpus": GpuDevice.objects.count(),
        "projects": Project.objects.count(),
        "queues": Queue.objects.count(),
    }


def _users() -> dict[str, AbstractUser]:
    User = get_user_model()
    users = {}
    for name, operator in DEMO_USERS:
        user, created = User.objects.get_or_create(
            username=name,
            defaults={"is_staff": operator, "is_superuser": operator, "email": f"{name}@example.org"},
        )
        if created:
            user.set_password(name)
            user.save(update_fields=["password"])
        users[name] = user
    return users


def _projects(users: dict[str, AbstractUser]) -> dict[str, Project]:
    projects = {}
    for name, display, owner in (("vision", "Computer vision", "alice"), ("nlp", "Language models", "bob")):
        project, _ = Project.objects.get_or_create(name=name, defaults={"display_name": display})
        Membership.objects.get_or_create(user=users[owner], project=project, defaults={"role": Role.MANAGER})
        projects[name] = project
    return projects


def _cluster(spec: DemoCluster) -> Cluster:
    model = GpuModel.objects.get(slug=spec.gpu_model)
    cluster, _ = Cluster.objects.get_or_create(
        name=spec.name,
        defaults={
            "kind": ClusterKind.SIMULATED,
            "state": ClusterState.READY,
            "labels": {"region": spec.region},
            "display_name": f"Simulated {model.name} cluster",
            "energy_price_per_kwh": spec.energy_price_per_kwh,
            "carbon_g_per_kwh": spec.carbon_g_per_kwh,
        },
    )
    now = timezone.now()
    for i in range(spec.nodes):
        node, created = Node.objects.get_or_create(
            cluster=cluster,
            name=f"{spec.name}-n{i:03d}",
            defaults={
                "state": NodeState.READY,
                "cpu_millicores_capacity": 128_000,
                "cpu_millicores_allocatable": 124_000,
                "memory_bytes_capacity": 1024 * GiB,
                "memory_bytes_allocatable": 1000 * GiB,
                "gpu_capacity": spec.gpus_per_node,
                "rack": f"r{i // 4}",
                "switch": f"sw{i // 8}",
                "nvlink_domain": f"{spec.name}-n{i:03d}",
                "last_heartbeat_at": now,
                "agent_version": "simulated",
                "labels": {"rack": f"r{i // 4}"},
            },
        )
        if created:
            GpuDevice.objects.bulk_create(
                GpuDevice(
                    node=node,
                    index=g,
                    model=model,
                    memory_mb=model.memory_mb,
                    uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node.name}.{g}')}",
                    topology_group=f"nvl{g // 4}",
                    utilization=0.0,
                    memory_used_mb=0,
                )
                for g in range(spec.gpus_per_node)
            )
    return cluster


DEMO_MIG = {0: ["1g.10gb"] * 7, 1: ["3g.40gb", "2g.20gb", "2g.20gb"]}  # GPU index → layout


def _fine_grained() -> None:
    """On sim-b's last node, two GPUs in MIG mode and two offered in fractions, so MIG and
    shared-GPU jobs have somewhere to go."""
    node = Node.objects.filter(cluster__name="sim-b").order_by("-name").first()
    if node is None or GpuDevice.objects.filter(node=node, mig_enabled=True).exists():
        return
    for index, layout in DEMO_MIG.items():
        gpu = GpuDevice.objects.get(node=node, index=index)
        gpu.mig_enabled = True
        gpu.save(update_fields=["mig_enabled"])
        MigInstance.objects.bulk_create(
            MigInstance(
                gpu=gpu,
                slot=slot,
                profile=profile,
                uuid=f"MIG-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node.name}.{index}.{slot}')}",
                memory_mb=int(profile.split(".")[1].removesuffix("gb")) * 1024 - 256,
                slices=int(profile[0]),
            )
            for slot, profile in enumerate(layout)
        )
    GpuDevice.objects.filter(node=node, index__in=[2, 3]).update(shareable=True)


def _queues(projects: dict[str, Project]) -> dict[str, Queue]:
    plan = {
        "vision/default": (projects["vision"], 10, {"h100-80g": 32, "l40s-48g": 8, "a100-80g": 8}),
        "vision/interactive": (projects["vision"], 50, {"h100-80g": 8}),
        "nlp/default": (projects["nlp"], 10, {"a100-80g": 48, "h100-80g": 16}),
        "nlp/batch": (projects["nlp"], 0, {"l40s-48g": 16}),
    }
    queues = {}
    for key, (project, priority, quota) in plan.items():
        queue, _ = Queue.objects.get_or_create(
            project=project,
            name=key.split("/")[1],
            defaults={"priority": priority, "cohort": "research", "max_pending_jobs": 1000},
        )
        for slug, gpus in quota.items():
            QueueQuota.objects.get_or_create(
                queue=queue, gpu_model=GpuModel.objects.get(slug=slug), defaults={"gpus": gpus}
            )
        queues[key] = queue
    return queues


def _jobs(users: dict[str, AbstractUser], queues: dict[str, Queue]) -> None:
    """A few jobs in different states, so every page has something to show."""
    h100, a100 = GpuModel.objects.get(slug="h100-80g"), GpuModel.objects.get(slug="a100-80g")
    sim_a = list(Node.objects.filter(cluster__name="sim-a").order_by("name"))
    sim_b = list(Node.objects.filter(cluster__name="sim-b").order_by("name"))

    def job(owner: str, queue: str, name: str, model: GpuModel, gpus: int, nodes: int = 1):
        request = JobRequest(
            name=name,
            queue=queues[queue],
            gpu_model=model,
            gpus_per_node=gpus,
            nodes=nodes,
            cpu_millicores_per_node=8_000 * gpus,
            memory_bytes_per_node=64 * GiB * gpus,
            time_limit_s=4 * 3600,
            command=f"python train.py --run {name}",
        )
        return submit_job(request, actor=users[owner], idempotency_key=f"demo-{name}")

    alice = users["alice"]
    j, new = job("alice", "vision/default", "train-resnet50", h100, 8)
    if new:
        bind_job(j, [NodePlacement(sim_a[0], range(8))])
        transition_job(j.pk, JobState.RUNNING, message="simulated start")
    j, new = job("alice", "vision/default", "finetune-vit", h100, 4)
    if new:
        bind_job(j, [NodePlacement(sim_a[1], range(4))])
        transition_job(j.pk, JobState.RUNNING)
        transition_job(j.pk, JobState.SUCCEEDED, exit_code=0)
    j, new = job("alice", "vision/default", "eval-detector", h100, 2)
    if new:
        bind_job(j, [NodePlacement(sim_a[1], [4, 5])])
        transition_job(j.pk, JobState.RUNNING)
        transition_job(j.pk, JobState.FAILED, exit_code=1, message="exit code 1")
    j, new = job("alice", "vision/interactive", "notebook", h100, 1)
    if new:
        hold_job(j, actor=alice)
    j, new = job("alice", "vision/default", "sweep-lr-0", h100, 8)
    if new:
        explain_pending(j.pk, PendingReason.RESOURCES, "0/22 nodes fit: 21 lack 8 free h100-80g, 1 full")
    j, new = job("alice", "vision/default", "old-experiment", h100, 1)
    if new:
        cancel_job(j, actor=alice)
    j, new = job("bob", "nlp/default", "pretrain-7b", a100, 8, nodes=2)
    if new:
        bind_job(j, [NodePlacement(sim_b[0], range(8)), NodePlacement(sim_b[1], range(8))])
        transition_job(j.pk, JobState.RUNNING)
    j, new = job("bob", "nlp/default", "pretrain-70b", a100, 8, nodes=8)
    if new:
        explain_pending(
            j.pk, PendingReason.QUOTA_EXCEEDED, "queue nlp/default at 16/48 a100-80g; this job needs 64"
        )
    j, new = job("bob", "nlp/default", "tokenize-corpus", a100, 1)
    if new:
        bind_job(j, [NodePlacement(sim_b[2], [0])])
        transition_job(j.pk, JobState.RUNNING)
        transition_job(j.pk, JobState.SUCCEEDED, exit_code=0)


DEMO_WORKLOAD = [
    # (user, project, queue, name, gpus (or GPU resources), nodes, seconds)
    ("alice", "vision", "default", "train-detector", "h100:8", 1, 150),
    ("alice", "vision", "default", "finetune", "h100:2", 1, 60),
    ("alice", "vision", "interactive", "notebook", "h100:1", 1, 90),
    ("bob", "nlp", "default", "pretrain-shard", "a100:8", 2, 180),
    ("bob", "nlp", "default", "eval-suite", "a100:1", 1, 45),
    ("bob", "nlp", "default", "notebook-mig", "a100:1g.10gb", 1, 90),
    ("bob", "nlp", "default", "embed-small", {"gpus": "a100", "gpuMemory": "20Gi"}, 1, 60),
    ("bob", "nlp", "batch", "embed-corpus", "l40s:4", 1, 120),
]


def submit_demo_jobs(count: int = 2) -> int:
    """Submit a few jobs of the demo's kind through the same path as the API (spec → checks
    → submission), so ``make demo`` keeps moving. Returns how many were accepted."""
    import random

    from portal.access import submission_queue
    from scheduling.services.jobs import TooManyPending, submit_jobs
    from scheduling.services.submission import build_requests
    from scheduling.spec import SpecError, parse_job_spec

    User = get_user_model()
    accepted = 0
    for _ in range(count):
        user, project, queue, name, gpus, nodes, seconds = random.choice(DEMO_WORKLOAD)
        actor = User.objects.get(username=user)
        document = {
            "apiVersion": "orrery/v1",
            "kind": "Job",
            "metadata": {"name": f"{name}-{random.randint(100, 999)}", "project": project},
            "spec": {
                "queue": queue,
                "resources": (gpus if isinstance(gpus, dict) else {"gpus": gpus})
                | {"nodes": nodes, "cpus": 8, "memory": "64Gi"},
                "run": f"python {name}.py",
                "timeLimit": "1h",
                "sim": {
                    "duration": f"{int(seconds * random.uniform(0.5, 1.5))}s",
                    "exitCode": 1 if random.random() < 0.1 else 0,
                },
            },
        }
        try:
            spec = parse_job_spec(document)
            requests = build_requests(spec, submission_queue(actor, spec.project, spec.queue), owner=actor)
            submit_jobs(requests, actor=actor)
            accepted += 1
        except (SpecError, TooManyPending):
            continue
    return accepted
