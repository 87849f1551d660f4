"""Onboarding clusters whose nodes Orrery reads from the cluster's own API (Slurm today): the
connection is tested first, and nothing is created when it fails."""

from __future__ import annotations

from django.db import transaction

from clusters.adapters.base import Inventory
from clusters.adapters.slurm.api import SlurmClient, SlurmError
from clusters.adapters.slurm.inventory import collect
from clusters.adapters.slurm.tags import new_tag
from clusters.choices import ClusterKind, ClusterState
from clusters.models import Cluster, ClusterSecret


@transaction.atomic
def onboard_slurm(
    name: str, url: str, token: str, *, user: str = "root", slurm_conf: str = ""
) -> tuple[Cluster, Inventory]:
    """Test the connection, then add (or update) the cluster and read its nodes. Raises
    ``SlurmError`` saying what is wrong (``field`` names the setting at fault); nothing is
    created then. The token is stored apart from the cluster's settings and never shown back.
    Onboarding an existing cluster again (a new token) keeps its job tag: jobs already submitted
    stay its own."""
    other = Cluster.objects.filter(name=name).exclude(kind=ClusterKind.SLURM).values_list("kind", flat=True)
    if other:
        raise SlurmError(f"a {other[0]} cluster is already named {name!r}", "name")
    client = SlurmClient(url, token, user)
    version = client.connect()
    before = (
        Cluster.objects.select_for_update().filter(name=name).values_list("config", flat=True).first() or {}
    )
    config = {
        "url": url,
        "user": user,
        "api": version,
        "tag": before.get("tag") or new_tag(),
        **({"slurm_conf": slurm_conf} if slurm_conf else {}),
    }
    cluster, _ = Cluster.objects.update_or_create(
        name=name, defaults={"kind": ClusterKind.SLURM, "config": config}
    )
    ClusterSecret.objects.update_or_create(cluster=cluster, defaults={"data": {"token": token}})
    seen = collect(cluster, client)
    if cluster.state == ClusterState.ONBOARDING:
        Cluster.objects.filter(pk=cluster.pk).update(
            state=ClusterState.READY, state_reason=f"slurmrestd {version}"
        )
    return cluster, seen
