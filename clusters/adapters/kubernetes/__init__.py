"""Kubernetes clusters: ``client`` builds the API client from the stored credential,
``manifests`` turns attempts into Jobs and ``states`` Jobs and pods into Orrery's states (pure
functions tested on recorded objects), ``informer``/``inventory`` keep nodes current from
watches, ``adapter`` runs attempts."""

from clusters.adapters.kubernetes.adapter import KubernetesAdapter

__all__ = ["KubernetesAdapter"]
