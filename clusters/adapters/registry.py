"""Cluster kind → its adapter, resolved lazily on first use (an adapter module may need
libraries that only its kind uses). Adding a kind is one line here."""

from __future__ import annotations

from functools import cache

from django.utils.module_loading import import_string

from clusters.adapters.base import ClusterAdapter
from clusters.choices import ClusterKind

ADAPTERS: dict[str, str] = {
    ClusterKind.NATIVE: "clusters.adapters.native.NativeAdapter",
    ClusterKind.SIMULATED: "clusters.adapters.simulated.SimulatedAdapter",
    ClusterKind.SLURM: "clusters.adapters.slurm.SlurmAdapter",
    ClusterKind.KUBERNETES: "clusters.adapters.kubernetes.KubernetesAdapter",
}


@cache
def adapter_for(kind: str) -> ClusterAdapter:
    """The adapter of a cluster kind; ``LookupError`` names a kind nothing runs."""
    try:
        path = ADAPTERS[kind]
    except KeyError:
        raise LookupError(f"no adapter for clusters of kind '{kind}'") from None
    return import_string(path)()
