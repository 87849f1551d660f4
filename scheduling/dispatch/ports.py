"""The port a gang agrees on (``MASTER_PORT``), chosen once per attempt when its start is
dispatched and kept in ``JobAttempt.master_port``: every node of the gang, and every delivery of
the same attempt (a drain retried after a crash, an agent's desired list read again), gets the
same value.

The rule, per kind (``ClusterAdapter.shares_node_network``):

* attempts on one node share its network (native agents, Slurm): the lowest port of
  ``[ORRERY_MASTER_PORT_BASE, ORRERY_MASTER_PORT_BASE + ORRERY_MASTER_PORTS)`` that no other
  active attempt with an allocation on the head node holds — two gangs whose head is the same
  node never collide (a port of a gang that merely passes through the node is avoided too);
* each attempt has its own network namespace (a Kubernetes pod): ``ORRERY_MASTER_PORT_BASE``;
* a kind that runs no user code (simulated): none.

Two choices for one head node never interleave: they run one at a time under a transaction-level
PostgreSQL advisory lock per head node (SQLite has a single writer), and a port once set is never
changed (compare-and-set on an empty ``master_port``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Min

from clusters.adapters.registry import adapter_for
from scheduling.models import Allocation, JobAttempt

log = logging.getLogger(__name__)
LOCK_CLASS = 0x0D16  # pg advisory lock (class, node id) of the ports of a head node


def assign_master_ports(attempt_ids: Iterable[Any]) -> dict[str, int]:
    """Give each attempt without a port its port (the rule above); returns the port of every
    attempt that has one, by attempt id. Idempotent: an attempt keeps the port it has."""
    ids = list(attempt_ids)
    if not ids:
        return {}
    with transaction.atomic():
        todo = {
            str(pk): kind
            for pk, kind in JobAttempt.objects.filter(pk__in=ids, master_port__isnull=True).values_list(
                "pk", "cluster__kind"
            )
            if adapter_for(kind).runs_user_code
        }
        if todo:
            _choose(todo)
        return {
            str(pk): port
            for pk, port in JobAttempt.objects.filter(pk__in=ids, master_port__isnull=False).values_list(
                "pk", "master_port"
            )
        }


def _choose(todo: dict[str, str]) -> None:
    base, size = settings.ORRERY_MASTER_PORT_BASE, settings.ORRERY_MASTER_PORTS
    heads = dict(
        Allocation.objects.filter(attempt_id__in=list(todo), gpu__isnull=True)
        .values("attempt_id")
        .annotate(head=Min("node_id"))
        .values_list("attempt_id", "head")
    )
    heads = {str(a): h for a, h in heads.items()}
    shared = {a: h for a, h in heads.items() if adapter_for(todo[a]).shares_node_network}
    _lock(sorted(set(shared.values())))
    held: dict[int, set[int]] = defaultdict(set)
    for node, port in Allocation.objects.filter(
        active=True, gpu__isnull=True, node_id__in=set(shared.values()), attempt__master_port__isnull=False
    ).values_list("node_id", "attempt__master_port"):
        held[node].add(port)
    chosen: dict[int, list[str]] = defaultdict(list)
    for attempt in sorted(heads):  # a stable order: the same batch chooses the same ports
        if attempt not in shared:
            chosen[base].append(attempt)
            continue
        taken = held[shared[attempt]]
        port = next((p for p in range(base, base + size) if p not in taken), None)
        if port is None:
            log.warning("no port free on node %s: attempt %s shares %s", shared[attempt], attempt, base)
            port = base
        taken.add(port)
        chosen[port].append(attempt)
    for port, attempts in chosen.items():
        JobAttempt.objects.filter(pk__in=attempts, master_port__isnull=True).update(master_port=port)


def _lock(node_ids: list[int]) -> None:
    """Serialise port choices per head node until the transaction ends (in node order, so two
    choosers never wait on each other in a cycle)."""
    if connection.vendor != "postgresql" or not node_ids:
        return
    with connection.cursor() as cursor:
        for node in node_ids:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [LOCK_CLASS, node % (1 << 31)])
