"""Seeds the fault suite's private database as an operator would, and prints what the clients
need as one JSON object: a user's API token, the project and queues, and per simulated
cluster its collector credential and node names.

    DATABASE_URL=... python -m tests.faults.seed --clusters 2 --nodes 20 --gpus 8

Runs in a process of its own on the private database's URL (the test process's Django is
bound to the suite's shared test database). Nodes are made directly, ready and just seen, with
``--gpus`` A100s each, as ``portal.services.demo`` makes the demo fleet; jobs go through the API.
Queues: ``default`` (no quota) and ``backlog`` (a quota of zero A100s: what waits there stays
pending, whatever the fleet has free).
"""

from __future__ import annotations

import argparse
import json
import os
import uuid

GiB = 2**30


def seed(clusters: int, nodes: int, gpus: int) -> dict:
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from clusters.choices import ClusterKind, ClusterState, NodeState
    from clusters.models import Cluster, GpuDevice, GpuModel, Node
    from clusters.services.credentials import issue_cluster_credential
    from portal.choices import Role
    from portal.models import Membership, Project
    from portal.services.tokens import issue_token
    from scheduling.models import Queue, QueueQuota

    model = GpuModel.objects.get(slug="a100-80g")
    user = get_user_model().objects.create_user("faults", password=uuid.uuid4().hex)
    project = Project.objects.create(name="faults")
    Membership.objects.create(user=user, project=project, role=Role.MANAGER)
    Queue.objects.create(project=project, name="default")
    backlog = Queue.objects.create(project=project, name="backlog")
    QueueQuota.objects.create(queue=backlog, gpu_model=model, gpus=0, borrowing_limit=0)
    fleet = {}
    now = timezone.now()
    for c in range(clusters):
        cluster = Cluster.objects.create(
            name=f"sim-{c}", kind=ClusterKind.SIMULATED, state=ClusterState.READY, display_name=f"sim {c}"
        )
        made = Node.objects.bulk_create(
            Node(
                cluster=cluster,
                name=f"sim-{c}-n{i:05d}",
                state=NodeState.READY,
                cpu_millicores_capacity=128_000,
                cpu_millicores_allocatable=128_000,
                memory_bytes_capacity=1024 * GiB,
                memory_bytes_allocatable=1024 * GiB,
                gpu_capacity=gpus,
                last_heartbeat_at=now,
                agent_version="faults",
            )
            for i in range(nodes)
        )
        GpuDevice.objects.bulk_create(
            GpuDevice(
                node=n,
                index=g,
                model=model,
                memory_mb=model.memory_mb,
                uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{n.name}.{g}')}",
            )
            for n in made
            for g in range(gpus)
        )
        _, credential = issue_cluster_credential(cluster, name="faults")
        fleet[cluster.name] = {"credential": credential, "nodes": [n.name for n in made], "gpus": gpus}
    _, token = issue_token(user, name="faults")
    return {"token": token, "project": project.name, "clusters": fleet}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clusters", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=20, help="per cluster")
    parser.add_argument("--gpus", type=int, default=8, help="per node")
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    print(json.dumps(seed(args.clusters, args.nodes, args.gpus)))


if __name__ == "__main__":
    main()
