"""Which remote jobs belong to which Orrery cluster, for every kind that shares a cluster's
scheduler with others (Slurm, Kubernetes).

Several Orrery clusters may front one remote cluster (two partitions or namespaces, a staging
and a production installation). Each has its own random tag (``Cluster.config["tag"]``, made at
onboarding, or at first use for a cluster onboarded before tags), written on each of its jobs
(a Slurm comment, a Kubernetes label): sync, orphan detection and the "already submitted?" check
look at jobs carrying the cluster's own tag only, so no cluster ever adopts, fails or cancels a
job of another.
"""

from __future__ import annotations

import secrets

from django.db import transaction

from clusters.models import Cluster


def new_tag() -> str:
    return secrets.token_hex(8)


def cluster_tag(cluster: Cluster) -> str:
    """The cluster's tag, made and saved once if it has none (under a row lock, so two workers
    starting at once agree on one tag)."""
    tag = cluster.config.get("tag")
    if tag:
        return str(tag)
    with transaction.atomic():
        locked = Cluster.objects.select_for_update().only("config").get(pk=cluster.pk)
        tag = locked.config.get("tag") or new_tag()
        if locked.config.get("tag") != tag:
            Cluster.objects.filter(pk=cluster.pk).update(config={**locked.config, "tag": tag})
    cluster.config = {**cluster.config, "tag": tag}
    return str(tag)
