"""The simulated fleet the API benchmarks place on: one ready cluster of A100 nodes."""

from __future__ import annotations


def simulated_fleet(
    nodes: int, gpus: int = 8, *, cpu_millicores: int = 64_000, memory_bytes: int = 512 << 30
):
    """A simulated cluster "sim" of ``nodes`` ready nodes ``n1``… with ``gpus`` A100s each."""
    from clusters.choices import ClusterKind, ClusterState, NodeState
    from clusters.models import Cluster, GpuDevice, GpuModel, Node

    model = GpuModel.objects.get(slug="a100-80g")
    cluster = Cluster.objects.create(name="sim", kind=ClusterKind.SIMULATED, state=ClusterState.READY)
    made = Node.objects.bulk_create(
        Node(
            cluster=cluster,
            name=f"n{i + 1}",
            state=NodeState.READY,
            cpu_millicores_capacity=cpu_millicores,
            cpu_millicores_allocatable=cpu_millicores,
            memory_bytes_capacity=memory_bytes,
            memory_bytes_allocatable=memory_bytes,
            gpu_capacity=gpus,
        )
        for i in range(nodes)
    )
    GpuDevice.objects.bulk_create(GpuDevice(node=n, index=g, model=model) for n in made for g in range(gpus))
    return cluster
