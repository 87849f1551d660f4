"""Onboarding clusters whose nodes Orrery reads from the cluster's own API (Slurm today): the
connection is tested first, and nothing is created when it fails."""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

from django.db import transaction

from clusters.adapters.base import Inventory
from clusters.adapters.slurm.accounts import check_output_dir
from clusters.adapters.slurm.api import SlurmClient, SlurmError
from clusters.adapters.slurm.inventory import collect
from clusters.adapters.slurm.tags import new_tag
from clusters.choices import ClusterKind, ClusterState, Identity
from clusters.models import Cluster, ClusterSecret
from foundation import audit
from foundation.choices import AuditAction

log = logging.getLogger(__name__)


@transaction.atomic
def onboard_slurm(
    name: str,
    url: str,
    token: str,
    *,
    user: str = "root",
    slurm_conf: str = "",
    identity: str | None = None,
    output_dir: str = "",
    actor: Any = None,
) -> tuple[Cluster, Inventory]:
    """Test the connection, then add (or update) the cluster and read its nodes. Raises
    ``SlurmError`` saying what is wrong (``field`` names the setting at fault); nothing is
    created then. The token is stored apart from the cluster's settings and never shown back.

    ``identity`` (``Identity``) says whose POSIX account users' work runs under: a new cluster
    gets ``accounts`` when none is given. ``output_dir`` is a template for where users' output
    goes (``{home}``, ``{user}``; default ``{home}/.orrery/slurm``). Onboarding an existing
    cluster again (a new token) keeps its identity, its output directory and its job tag unless
    told otherwise: jobs already submitted stay its own. ``actor`` is who asked, for the audit
    log (the token is never recorded)."""
    other = Cluster.objects.filter(name=name).exclude(kind=ClusterKind.SLURM).values_list("kind", flat=True)
    if other:
        raise SlurmError(f"a {other[0]} cluster is already named {name!r}", "name")
    if identity is not None and identity not in Identity.values:
        raise SlurmError(
            f"identity must be one of {', '.join(Identity.values)}, not {identity!r}", "identity"
        )
    if output_dir:
        check_output_dir(output_dir)
    client = SlurmClient(url, token, user)
    try:
        version = client.connect()
    except SlurmError as exc:
        if exc.slurmrestd:
            raise  # a slurmrestd answered: what it said helps, and reveals nothing else
        # The same answer whatever else failed (refused, timed out, another service's page): the
        # onboarding form must not be a way to scan the control plane's network. The detail
        # goes to the server's log, where operators debug.
        log.warning("onboarding %s: connection test to %s failed: %s", name, url, exc)
        raise SlurmError(
            "no slurmrestd accepted this token at this URL (the server's log says why)", "url"
        ) from None
    before = (
        Cluster.objects.select_for_update().filter(name=name).values_list("config", flat=True).first() or {}
    )
    output_dir = output_dir or before.get("output_dir") or ""
    config = {
        "url": url,
        "user": user,
        "api": version,
        "tag": before.get("tag") or new_tag(),
        **({"slurm_conf": slurm_conf} if slurm_conf else {}),
        **({"output_dir": output_dir} if output_dir else {}),
    }
    defaults = {"kind": ClusterKind.SLURM, "config": config} | ({"identity": identity} if identity else {})
    cluster, created = Cluster.objects.update_or_create(name=name, defaults=defaults)
    ClusterSecret.objects.update_or_create(cluster=cluster, defaults={"data": {"token": token}})
    seen = collect(cluster, client)
    if cluster.state == ClusterState.ONBOARDING:
        Cluster.objects.filter(pk=cluster.pk).update(
            state=ClusterState.READY, state_reason=f"slurmrestd {version}"
        )
    details = {"kind": ClusterKind.SLURM, "url": _shown(url), "user": user, "created": created}
    audit.record(AuditAction.CLUSTER_ONBOARD, actor=actor, target=f"cluster:{name}", details=details)
    return cluster, seen


def _shown(url: str) -> str:
    """The URL as the audit log keeps it: no user or password, no query."""
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2], query="", fragment="").geturl()
