"""Power saving: which idle nodes could be switched off, what that saves, and switching them.

**Recommendations** (``power_plan``, read-only). A node is recommended for powering down when

* it is ready, powered on, in a cluster that takes work (ready or degraded);
* it holds no work (the ``node_workload`` port) and has held none for ``ORRERY_POWER_IDLE_S``:
  idle since its last allocation was released (the ``node_last_release`` port) or, if later,
  since it last changed state (became ready);
* powering it down leaves at least ``ORRERY_POWER_KEEP_IDLE`` idle ready nodes of its cluster
  and GPU model (the floor, so a job that arrives finds somewhere to start at once). Of the nodes
  past the bound, the longest idle go first;
* no job waits for free GPUs of its model (reason ``Resources``; the ``waiting_demand`` port).

Watts saved: the node's own reading (``Node.power_w``) when its last report is fresher than
``ORRERY_TELEMETRY_STALE_S`` ("measured"); otherwise ``ORRERY_POWER_NODE_BASE_W`` plus 15 % of
each GPU's TDP, what an idle data-centre GPU draws ("estimated").

**Actions** — only on clusters whose adapter ``SupportsPowerSaving`` and whose
``Cluster.power_saving`` switch is on; with the switch off Orrery recommends and does nothing.
``power_down_nodes`` powers down those of the asked nodes that are recommended at that moment,
in two steps:

1. one short transaction, the cluster's row locked (so two callers cannot both take the last
   idle nodes above the floor): the plan is computed again and each node moves ``ready`` →
   ``drained`` (``set_node_state``: a NodeEvent, so the scheduler's cache stops offering it at
   its next cycle; an operator state, so heartbeats never bring it back and the lifecycle does
   not count it as silent), audited as a drain with ``details.power = "down"``;
2. per node, outside any transaction: if a placement committed in the meantime the node is
   given back (``ready``); otherwise the adapter powers it down and ``power_state`` becomes
   ``suspended``. A refusal of the cluster gives the node back too, and says why.

``power_up_nodes`` powers suspended nodes up (switch or no switch: a switch turned off must
not strand them), ``power_state`` back ``on``, and a node power saving drained becomes
``not_ready``: the lifecycle makes it ready after ``NODE_RECOVERY`` of heartbeats.
``apply_power_saving`` is the periodic pass of clusters whose switch is on: first it powers up
enough powered-down nodes of each model that jobs wait for free GPUs of (``power_up_for_demand``),
then it powers down what is recommended.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from clusters import ports
from clusters.adapters.base import AdapterError, SupportsPowerSaving, power_saving_of
from clusters.adapters.registry import adapter_for
from clusters.choices import ClusterState, NodeState, PowerState
from clusters.metrics import POWER_ACTIONS
from clusters.models import Cluster, GpuDevice, GpuModel, Node
from clusters.services.nodes import set_node_state
from foundation import audit
from foundation.choices import AuditAction

log = logging.getLogger(__name__)

# What an idle data-centre GPU draws, as a share of its TDP (H100 SXM: about 70 of 700 W idle,
# more with memory clocks up): the estimate when the node reports no power of its own.
GPU_IDLE_SHARE = 0.15
# Node state reasons power saving writes; a node drained with this prefix is power saving's own.
REASON_PREFIX = "power saving: "
# Clusters whose nodes take work (the others are the operator's or the lifecycle's business).
WORKING_CLUSTERS = (ClusterState.READY, ClusterState.DEGRADED)


class PowerActionRefused(Exception):
    """The cluster cannot power nodes, or its switch is off; nothing was changed."""


@dataclass(frozen=True)
class IdleNode:
    """A ready node holding no work: since when, and what switching it off would save."""

    node_id: int
    name: str
    cluster_id: int
    model: str  # the GPU model's slug ("" for a node without GPUs): the floor is per model
    gpus: int
    idle_since: datetime
    watts: float
    measured: bool  # watts from the node's own fresh reading (else estimated)


@dataclass(frozen=True)
class Recommendation:
    node: IdleNode
    idle_s: float


@dataclass(frozen=True)
class ClusterPlan:
    """One cluster's recommendations, what they save, and its powered-down nodes."""

    cluster: Cluster
    supported: bool  # the cluster's kind can power nodes
    recommendations: tuple[Recommendation, ...]
    idle: int  # idle ready nodes in all, recommended or kept
    powered_down: tuple[Node, ...] = field(default=())

    @property
    def actionable(self) -> bool:
        return self.supported and self.cluster.power_saving

    @property
    def watts(self) -> float:
        return sum(r.node.watts for r in self.recommendations)

    @property
    def kwh_per_day(self) -> float:
        return self.watts * 24 / 1000

    @property
    def cost_per_day(self) -> float | None:
        price = self.cluster.energy_price_per_kwh
        return None if price is None else self.kwh_per_day * float(price)

    @property
    def co2_kg_per_day(self) -> float | None:
        carbon = self.cluster.carbon_g_per_kwh
        return None if carbon is None else self.kwh_per_day * carbon / 1000


@dataclass
class PowerResult:
    """Names of the nodes an action reached, and why each other one was left alone."""

    done: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


def recommend(
    idle: Iterable[IdleNode],
    now: datetime,
    *,
    idle_s: float,
    keep_idle: int,
    wanted: frozenset[str] = frozenset(),
) -> list[Recommendation]:
    """The rule, pure: of each (cluster, model)'s idle nodes, those idle for ``idle_s`` or more,
    longest idle first, as long as ``keep_idle`` idle nodes stay ready; none of a model in
    ``wanted`` (jobs wait for free GPUs of it)."""
    groups: dict[tuple[int, str], list[IdleNode]] = defaultdict(list)
    for node in idle:
        if node.model not in wanted:
            groups[node.cluster_id, node.model].append(node)
    out = []
    for _, nodes in sorted(groups.items()):
        spare = max(len(nodes) - max(keep_idle, 0), 0)
        past = sorted(
            (n for n in nodes if (now - n.idle_since).total_seconds() >= idle_s),
            key=lambda n: (n.idle_since, n.node_id),
        )
        out += [Recommendation(n, (now - n.idle_since).total_seconds()) for n in past[:spare]]
    return out


def node_watts(
    power_w: float | None,
    reported_at: datetime | None,
    gpu_tdps: Iterable[int],
    now: datetime,
    *,
    fresh_s: float,
    base_w: float,
) -> tuple[float, bool]:
    """``(watts, measured)``: the node's own reading when fresh, else the estimate."""
    if power_w is not None and reported_at is not None and (now - reported_at).total_seconds() <= fresh_s:
        return float(power_w), True
    return base_w + GPU_IDLE_SHARE * sum(gpu_tdps), False


def idle_nodes(now: datetime, cluster_ids: Iterable[int] | None = None) -> list[IdleNode]:
    """Every ready, powered-on node of a working cluster that holds no work. A handful of
    queries, whatever the fleet's size."""
    rows = Node.objects.filter(state=NodeState.READY, cluster__state__in=WORKING_CLUSTERS).exclude(
        power_state=PowerState.SUSPENDED
    )
    if cluster_ids is not None:
        rows = rows.filter(cluster_id__in=list(cluster_ids))
    nodes = list(
        rows.order_by().values_list(
            "pk", "name", "cluster_id", "state_changed_at", "power_w", "last_heartbeat_at"
        )
    )
    busy = ports.node_workload()([n[0] for n in nodes])
    nodes = [n for n in nodes if n[0] not in busy]
    ids = [n[0] for n in nodes]
    released = ports.node_last_release()(ids)
    gpus: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for node_id, slug, tdp in (
        GpuDevice.objects.filter(node_id__in=ids)
        .order_by()
        .values_list("node_id", "model__slug", "model__tdp_watts")
    ):
        gpus[node_id].append((slug, tdp))
    out = []
    for pk, name, cluster_id, changed_at, power_w, reported_at in nodes:
        devices = gpus.get(pk, [])
        watts, measured = node_watts(
            power_w,
            reported_at,
            (tdp for _, tdp in devices),
            now,
            fresh_s=settings.ORRERY_TELEMETRY_STALE_S,
            base_w=settings.ORRERY_POWER_NODE_BASE_W,
        )
        last = released.get(pk)
        out.append(
            IdleNode(
                node_id=pk,
                name=name,
                cluster_id=cluster_id,
                model=Counter(slug for slug, _ in devices).most_common(1)[0][0] if devices else "",
                gpus=len(devices),
                idle_since=max(changed_at, last) if last else changed_at,
                watts=watts,
                measured=measured,
            )
        )
    return out


def waiting_models() -> dict[str, int]:
    """``{model slug: GPUs}`` that jobs waiting for free resources ask for (``waiting_demand``)."""
    demand = ports.waiting_demand()()
    slugs = dict(GpuModel.objects.filter(pk__in=list(demand)).values_list("pk", "slug"))
    return {slugs[pk]: gpus for pk, gpus in demand.items() if pk in slugs}


def recommendations(now: datetime, cluster_ids: Iterable[int] | None = None) -> list[Recommendation]:
    """The recommendations of the clusters (all, or ``cluster_ids``) under the settings."""
    return recommend(
        idle_nodes(now, cluster_ids),
        now,
        idle_s=settings.ORRERY_POWER_IDLE_S,
        keep_idle=settings.ORRERY_POWER_KEEP_IDLE,
        wanted=frozenset(waiting_models()),
    )


def power_plan(now: datetime | None = None) -> list[ClusterPlan]:
    """Every working cluster's recommendations, and every cluster's powered-down nodes (a
    cluster that stopped taking work may still have some to power up), for the console."""
    now = now or timezone.now()
    suspended = Node.objects.filter(power_state=PowerState.SUSPENDED).values("cluster_id")
    clusters = list(Cluster.objects.filter(Q(state__in=WORKING_CLUSTERS) | Q(pk__in=suspended)))
    idle = idle_nodes(now, [c.pk for c in clusters])
    chosen = recommend(
        idle,
        now,
        idle_s=settings.ORRERY_POWER_IDLE_S,
        keep_idle=settings.ORRERY_POWER_KEEP_IDLE,
        wanted=frozenset(waiting_models()),
    )
    by_cluster: dict[int, list[Recommendation]] = defaultdict(list)
    for r in chosen:
        by_cluster[r.node.cluster_id].append(r)
    idle_count = Counter(n.cluster_id for n in idle)
    down: dict[int, list[Node]] = defaultdict(list)
    for node in Node.objects.filter(cluster__in=clusters, power_state=PowerState.SUSPENDED).order_by("name"):
        down[node.cluster_id].append(node)
    return [
        ClusterPlan(
            cluster=c,
            supported=_saving(c) is not None,
            recommendations=tuple(sorted(by_cluster[c.pk], key=lambda r: -r.idle_s)),
            idle=idle_count[c.pk],
            powered_down=tuple(down[c.pk]),
        )
        for c in clusters
    ]


def _saving(cluster: Cluster) -> SupportsPowerSaving | None:
    try:
        return power_saving_of(adapter_for(cluster.kind))
    except LookupError:
        return None


def power_down_nodes(
    cluster: Cluster, node_ids: Iterable[int], *, actor: AbstractBaseUser | None, now: datetime | None = None
) -> PowerResult:
    """Power down those of ``node_ids`` that are recommended now (see the module's docstring).
    ``PowerActionRefused`` when the cluster cannot, or its switch is off."""
    saving = _saving(cluster)
    if saving is None:
        raise PowerActionRefused(f"{cluster.name}: clusters of kind {cluster.kind} cannot power nodes down.")
    result = PowerResult()
    taken = _drain_recommended(cluster, set(node_ids), actor, now or timezone.now(), result)
    busy = ports.node_workload()([n.pk for n, _ in taken])
    for node, recommendation in taken:
        if node.pk in busy:
            _give_back(node, actor, "a job was placed on it meanwhile")
            result.refused.append(f"{node.name}: a job was placed on it meanwhile; left on.")
            continue
        try:
            saving.power_down(cluster, node.name)
        except AdapterError as exc:
            _give_back(node, actor, f"the cluster refused: {exc}")
            result.refused.append(f"{node.name}: {exc}")
            continue
        except Exception:  # a bug: never leave the node drained for nothing
            _give_back(node, actor, "powering down failed")
            raise
        Node.objects.filter(pk=node.pk).update(power_state=PowerState.SUSPENDED)
        result.done.append(node.name)
        log.info("powered down %s/%s (idle %.0f s)", cluster.name, node.name, recommendation.idle_s)
    _count("down", result)
    return result


def _count(action: str, result: PowerResult) -> None:
    POWER_ACTIONS.labels(action, "done").inc(len(result.done))
    POWER_ACTIONS.labels(action, "refused").inc(len(result.refused))


@transaction.atomic
def _drain_recommended(
    cluster: Cluster, asked: set[int], actor: AbstractBaseUser | None, now: datetime, result: PowerResult
) -> list[tuple[Node, Recommendation]]:
    """Step 1: under the cluster's row lock, drain the asked nodes that are recommended now."""
    cluster = Cluster.objects.select_for_update().get(pk=cluster.pk)
    if not cluster.power_saving:
        raise PowerActionRefused(f"{cluster.name}: power saving is switched off for this cluster.")
    chosen = {r.node.node_id: r for r in recommendations(now, [cluster.pk])}
    nodes = Node.objects.select_for_update().filter(cluster=cluster, pk__in=asked).order_by("pk")
    taken = []
    for node in nodes:
        recommendation = chosen.get(node.pk)
        if recommendation is None:
            result.refused.append(
                f"{node.name}: not recommended now (busy, not idle long enough, or kept ready)."
            )
            continue
        minutes = recommendation.idle_s / 60
        reason = f"{REASON_PREFIX}powered down after {minutes:.0f} min idle"
        if set_node_state(node, NodeState.DRAINED, {NodeState.READY}, actor=actor, reason=reason):
            _audit(AuditAction.NODE_DRAIN, node, actor, power="down", idle_s=round(recommendation.idle_s))
            taken.append((node, recommendation))
    missing = asked - {n.pk for n in nodes}
    result.refused += [f"node {pk}: no such node in {cluster.name}." for pk in sorted(missing)]
    return taken


@transaction.atomic
def _give_back(node: Node, actor: AbstractBaseUser | None, why: str) -> None:
    """Undo step 1 for a node that stays on: drained by power saving → ready again."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    if node.state_reason.startswith(REASON_PREFIX) and set_node_state(
        node, NodeState.READY, {NodeState.DRAINED}, actor=actor, reason=f"{REASON_PREFIX}left on: {why}"[:255]
    ):
        _audit(AuditAction.NODE_RESUME, node, actor, power="down refused", why=why[:255])


def power_up_nodes(
    cluster: Cluster, node_ids: Iterable[int], *, actor: AbstractBaseUser | None
) -> PowerResult:
    """Power up the suspended ones of ``node_ids`` (whatever the switch says). A node power
    saving drained becomes ``not_ready``; one an operator has moved since keeps its state."""
    saving = _saving(cluster)
    if saving is None:
        raise PowerActionRefused(f"{cluster.name}: clusters of kind {cluster.kind} cannot power nodes up.")
    result = PowerResult()
    asked = set(node_ids)
    nodes = list(Node.objects.filter(cluster=cluster, pk__in=asked, power_state=PowerState.SUSPENDED))
    for node in nodes:
        try:
            saving.power_up(cluster, node.name)
        except AdapterError as exc:
            result.refused.append(f"{node.name}: {exc}")
            continue
        _mark_powered_up(node, actor)
        result.done.append(node.name)
    result.refused += [
        f"node {pk}: not powered down in {cluster.name}." for pk in sorted(asked - {n.pk for n in nodes})
    ]
    _count("up", result)
    return result


@transaction.atomic
def _mark_powered_up(node: Node, actor: AbstractBaseUser | None) -> None:
    node = Node.objects.select_for_update().get(pk=node.pk)
    Node.objects.filter(pk=node.pk).update(power_state=PowerState.ON)
    if node.state == NodeState.DRAINED and node.state_reason.startswith(REASON_PREFIX):
        set_node_state(
            node, NodeState.NOT_READY, {NodeState.DRAINED}, actor=actor, reason=f"{REASON_PREFIX}powered up"
        )
    _audit(AuditAction.NODE_RESUME, node, actor, power="up")


def _audit(action: str, node: Node, actor: AbstractBaseUser | None, **details: object) -> None:
    """Power actions are recorded as the drain and resume they are, with what power did."""
    audit.record(
        action,
        actor=actor,
        target=f"node:{node.cluster.name}/{node.name}",
        details={"node_id": node.pk, "state": node.state, "reason": node.state_reason, **details},
    )


def power_up_for_demand() -> int:
    """Power up, in clusters whose switch is on, enough powered-down nodes of each model that
    jobs wait for free GPUs of (``waiting_models``): nodes already powered up and not yet ready
    count, so successive passes do not wake more than the jobs ask for. Returns how many."""
    demand = waiting_models()
    if not demand:
        return 0
    on = [c for c in Cluster.objects.filter(power_saving=True, state__in=WORKING_CLUSTERS) if _saving(c)]
    coming, asleep = (
        _gpus_by_model(
            Node.objects.filter(
                cluster__in=on,
                power_state=PowerState.ON,
                state=NodeState.NOT_READY,
                state_reason=f"{REASON_PREFIX}powered up",
            )
        ),
        _nodes_by_model(Node.objects.filter(cluster__in=on, power_state=PowerState.SUSPENDED)),
    )
    clusters = {c.pk: c for c in on}
    done = 0
    for model, gpus in sorted(demand.items()):
        need = gpus - coming.get(model, 0)
        for node_id, cluster_id, node_gpus in asleep.get(model, []):
            if need <= 0:
                break
            result = power_up_nodes(clusters[cluster_id], [node_id], actor=None)
            done += len(result.done)
            need -= node_gpus if result.done else 0
            for why in result.refused:
                log.warning("power saving on %s: %s", clusters[cluster_id].name, why)
    return done


def _nodes_by_model(nodes: QuerySet[Node]) -> dict[str, list[tuple[int, int, int]]]:
    """``{model slug: [(node id, cluster id, GPUs)]}`` by each node's most common GPU model."""
    models: dict[int, Counter[str]] = defaultdict(Counter)
    rows = GpuDevice.objects.filter(node__in=nodes).order_by().values_list("node_id", "model__slug")
    for node_id, slug in rows:
        models[node_id][slug] += 1
    out: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for node_id, cluster_id in nodes.order_by("cluster_id", "name").values_list("pk", "cluster_id"):
        if models[node_id]:
            slug = models[node_id].most_common(1)[0][0]
            out[slug].append((node_id, cluster_id, sum(models[node_id].values())))
    return out


def _gpus_by_model(nodes: QuerySet[Node]) -> dict[str, int]:
    return {slug: sum(n[2] for n in found) for slug, found in _nodes_by_model(nodes).items()}


def apply_power_saving(now: datetime | None = None) -> int:
    """The periodic pass over clusters whose switch is on and whose kind can: power up nodes of
    models jobs wait for (``power_up_for_demand``), then power down every recommended node.
    Returns how many nodes it powered up or down; a cluster that refuses is logged and the
    others go on."""
    now = now or timezone.now()
    done = power_up_for_demand()
    for cluster in Cluster.objects.filter(power_saving=True, state__in=WORKING_CLUSTERS):
        if _saving(cluster) is None:
            continue
        chosen = [r.node.node_id for r in recommendations(now, [cluster.pk])]
        if not chosen:
            continue
        try:
            result = power_down_nodes(cluster, chosen, actor=None, now=now)
        except PowerActionRefused as exc:  # switched off meanwhile
            log.info("%s", exc)
            continue
        done += len(result.done)
        for why in result.refused:
            log.warning("power saving on %s: %s", cluster.name, why)
    return done
