"""Whose POSIX account a user's work runs under on each cluster.

A cluster's ``identity`` says how an Orrery user becomes a POSIX account there:

* ``accounts`` — an operator maps each user (``PosixAccount``, in the console or the API); a
  user without a mapping cannot run work on that cluster, and is told so at submission.
* ``same_name`` — the Orrery user name is the account name, resolved by the cluster's own user
  database (LDAP, SSSD…); names that are not valid POSIX names are refused.
* ``shared`` — one service account for everyone: a single-tenant cluster, no isolation
  between users (see docs/security.md).

Kinds that do not really run users' code (simulated clusters) need no account.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.contrib.auth import get_user_model
from django.db import transaction

from clusters.adapters.registry import ADAPTERS, adapter_for
from clusters.choices import Identity
from clusters.models import POSIX_NAME, Cluster, PosixAccount
from foundation import audit
from foundation.choices import AuditAction

_POSIX_NAME = re.compile(POSIX_NAME)


@dataclass(frozen=True)
class Eligible:
    """Clusters a user's work may run on, out of those considered: ``names`` (sorted), and for
    each cluster refused, why."""

    names: list[str]
    refused: dict[str, str]


def needs_account(kind: str) -> bool:
    """Whether work on a cluster of this kind runs under a POSIX account (kinds with no adapter
    yet are treated as if they did: they get no one's work without an account)."""
    return kind not in ADAPTERS or adapter_for(kind).runs_user_code


def account_name(kind: str, identity: str, username: str, mapped: str | None) -> str | None:
    """The one rule: the POSIX account a user's work runs as on a cluster of ``kind`` and
    ``identity`` — a name, "" where no account of the user's own is used (a shared identity, or
    a kind that runs no code), None where the user has none (``mapped`` is their mapping there,
    if any)."""
    if not needs_account(kind) or identity == Identity.SHARED:
        return ""
    if identity == Identity.SAME_NAME:
        return username if _POSIX_NAME.fullmatch(username) else None
    return mapped


def eligible_clusters(user: Any, clusters: Iterable[Cluster], mapped: dict[int, str]) -> Eligible:
    """Of ``clusters``, those where ``user``'s work can run under an account, given ``mapped``:
    the user's ``{cluster id: POSIX user name}`` (``clusters.facts.accounts``)."""
    rows = list(clusters)
    names, refused = [], {}
    for cluster in rows:
        if account_name(cluster.kind, cluster.identity, user.get_username(), mapped.get(cluster.pk)) is None:
            refused[cluster.name] = _refusal(user, cluster)
        else:
            names.append(cluster.name)
    return Eligible(sorted(names), refused)


def _refusal(user: Any, cluster: Cluster) -> str:
    """Why ``user`` has no account on ``cluster``, and what to do about it."""
    if cluster.identity == Identity.SAME_NAME:
        return (
            f"cluster '{cluster.name}' runs work under the account of your user name, and "
            f"'{user.get_username()[:64]}' is not a POSIX user name"
        )
    return (
        f"you have no POSIX account on cluster '{cluster.name}': an operator must map your user "
        "to one (console: Clusters → POSIX accounts, or PUT /api/v1/clusters/"
        f"{cluster.name}/accounts/{user.get_username()[:64]})"
    )


def run_as_names(pairs: Iterable[tuple[int, int]]) -> dict[tuple[int, int], str | None]:
    """For ``(cluster id, user id)`` pairs, the POSIX account each runs as (``account_name``):
    a name, "" for the cluster's shared account, None where the user has no account. Three
    queries at most."""
    wanted = set(pairs)
    if not wanted:
        return {}
    cluster_ids = {c for c, _ in wanted}
    user_ids = {u for _, u in wanted}
    clusters = {
        pk: (kind, identity)
        for pk, kind, identity in Cluster.objects.filter(pk__in=cluster_ids).values_list(
            "pk", "kind", "identity"
        )
    }
    accounts = {
        (c, u): name
        for c, u, name in PosixAccount.objects.filter(
            cluster_id__in=cluster_ids, user_id__in=user_ids
        ).values_list("cluster_id", "user_id", "username")
    }
    usernames: dict[int, str] = {}
    if any(identity == Identity.SAME_NAME for _, identity in clusters.values()):
        model = get_user_model()
        usernames = dict(model.objects.filter(pk__in=user_ids).values_list("pk", model.USERNAME_FIELD))
    return {
        (c, u): account_name(*clusters.get(c, ("", "")), usernames.get(u, ""), accounts.get((c, u)))
        for c, u in wanted
    }


@transaction.atomic
def map_account(
    cluster: Cluster, user: Any, username: str, *, actor: Any = None
) -> tuple[PosixAccount, bool]:
    """Map ``user`` to the POSIX account ``username`` on ``cluster`` (replacing a previous
    mapping); returns the mapping and whether it is new. Raises ``ValueError`` for a name that
    is not a POSIX user name, or root. ``actor`` (who asked) goes to the audit log."""
    if not _POSIX_NAME.fullmatch(username):
        raise ValueError(
            "not a POSIX user name: lowercase letters, digits, '_' and '-', starting with a letter or '_'"
        )
    if username == "root":
        raise ValueError("work never runs as root")
    account, created = PosixAccount.objects.update_or_create(
        cluster=cluster, user=user, defaults={"username": username}
    )
    details = {"account": username, "created": created}
    audit.record(AuditAction.ACCOUNT_MAP, actor=actor, target=_account_target(cluster, user), details=details)
    return account, created


@transaction.atomic
def unmap_account(cluster: Cluster, user: Any, *, actor: Any = None) -> bool:
    """Remove ``user``'s account mapping on ``cluster``; True if there was one. Attempts not yet
    started there then fail with a clear reason instead of running under a stale account."""
    deleted, _ = PosixAccount.objects.filter(cluster=cluster, user=user).delete()
    if deleted:
        audit.record(AuditAction.ACCOUNT_UNMAP, actor=actor, target=_account_target(cluster, user))
    return bool(deleted)


def _account_target(cluster: Cluster, user: Any) -> str:
    return f"account:{cluster.name}/{user.get_username()}"
