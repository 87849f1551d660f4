"""The fleet facts a submission checks for every job — the GPU catalog, the clusters' kinds and
identities, the submitter's POSIX accounts — from the process's memo of the current generation
when the request read one (``foundation.facts``), else from the database as always.

Only names that resolve are kept, so a caller cannot grow the memo with names that do not
exist, and the accounts of at most ``_MAX_USERS`` submitters.
"""

from __future__ import annotations

from typing import Any

from clusters.models import Cluster, GpuModel, PosixAccount
from clusters.selectors import resolve_gpu_model
from foundation.facts import kept

_MAX_USERS = 10_000


def gpu_model(name: str) -> GpuModel | None:
    """``resolve_gpu_model``: the catalog entry for a slug, an alias or a vendor product string."""
    memo = kept()
    if memo is None:
        return resolve_gpu_model(name)
    models = memo.setdefault("gpu-models", {})
    key = name.strip().lower()
    model = models.get(key)
    if model is None:
        model = resolve_gpu_model(name)
        if model is not None:
            models[key] = model
    return model


def clusters(names: list[str] | None = None) -> list[Cluster]:
    """The clusters named (None: every one), in name order, with ``pk``, ``name``, ``kind`` and
    ``identity`` only; unknown names are left out."""
    memo = kept()
    if memo is None:
        rows = _cluster_rows()
        return list(rows.filter(name__in=names) if names is not None else rows)
    if "clusters" not in memo:
        memo["clusters"] = list(_cluster_rows())
    if names is None:
        return list(memo["clusters"])
    wanted = set(names)
    return [cluster for cluster in memo["clusters"] if cluster.name in wanted]


def _cluster_rows() -> Any:
    return Cluster.objects.only("pk", "name", "kind", "identity").order_by("name")


def accounts(user: Any, cluster_ids: list[int]) -> dict[int, str]:
    """``{cluster id: POSIX user name}``: ``user``'s mappings on those clusters."""
    memo = kept()
    if memo is None:
        rows = PosixAccount.objects.filter(user_id=user.pk, cluster_id__in=cluster_ids)
        return dict(rows.values_list("cluster_id", "username"))
    per_user = memo.setdefault("accounts", {})
    mapped = per_user.get(user.pk)
    if mapped is None:
        mapped = dict(PosixAccount.objects.filter(user_id=user.pk).values_list("cluster_id", "username"))
        if len(per_user) >= _MAX_USERS:
            per_user.clear()
        per_user[user.pk] = mapped
    wanted = set(cluster_ids)
    return {pk: name for pk, name in mapped.items() if pk in wanted}
