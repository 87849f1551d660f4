"""The periodic inventory pass over clusters whose nodes are read from the cluster's own API."""

from __future__ import annotations

import logging

from clusters.adapters.base import AdapterError
from clusters.adapters.registry import ADAPTERS, adapter_for
from clusters.choices import ClusterState
from clusters.models import Cluster
from foundation.pacing import due

log = logging.getLogger(__name__)


def take_inventories(*, paced: bool = True) -> int:
    """Refresh every enabled cluster of a kind that pulls its inventory and whose pace
    (``adapter.inventory_every_s``) has come round — every such cluster with ``paced=False``;
    one that cannot be reached is logged and left to the lifecycle, which marks it unreachable
    when its nodes fall silent. Returns how many clusters answered."""
    kinds = [
        k
        for k in ADAPTERS
        if adapter_for(k).pulls_inventory
        and (not paced or due(f"orrery:inventory:{k}", adapter_for(k).inventory_every_s))
    ]
    done = 0
    enabled = list(Cluster.objects.filter(kind__in=kinds).exclude(state=ClusterState.DISABLED))
    for cluster in enabled:
        try:
            adapter_for(cluster.kind).inventory(cluster)
            done += 1
        except AdapterError as exc:
            log.warning("%s cluster %s: %s", cluster.kind, cluster.name, exc)
    for kind in kinds:  # what a kind keeps per cluster in this process (watches) ends with it
        if forget := getattr(adapter_for(kind), "forget_others", None):
            forget({c.pk for c in enabled if c.kind == kind})
    return done
