"""A Kubernetes cluster's inventory: its GPU nodes, read from two informers (nodes, and the
pods that hold resources), fed into the same heartbeat pipeline as every other kind.

The first half maps the API server's JSON to Orrery's terms, as pure functions (tested on
recorded nodes); the second half writes what they say.

What a Kubernetes node becomes in Orrery:

* **Which nodes**: those offering NVIDIA GPUs — ``nvidia.com/gpu``, ``nvidia.com/gpu.shared`` or
  ``nvidia.com/mig-<profile>`` in capacity or allocatable (``gpus.node_gpus``). Other nodes are
  not Orrery's to schedule on.
* **GPU model**: from GPU feature discovery's ``nvidia.com/gpu.product`` (``NVIDIA-H100-80GB-HBM3``),
  matched to the catalog's slugs and aliases with dashes, underscores and spaces counted alike
  and GFD's ``-SHARED`` suffix dropped. A product the catalog lacks is reported in
  ``Inventory.unknown_gpu_types`` and the node joins with no GPUs (as on Slurm). One model a
  node: its GPUs are all of the product's model.
* **MIG**: a node's GPUs in MIG mode are GPUs of the product's model (``NVIDIA-A100-SXM4-80GB``:
  ``a100-80g``) holding MIG instances, as many of each profile as ``nvidia.com/mig-<profile>``
  counts (``nvidia.com/gpu`` under GFD's *single* strategy, whose product label says
  ``…-MIG-1g.10gb``), each of the memory GFD gives it. Which GPU holds which instance is a tally
  (``clusters.adapters.mig``); they come after the node's whole GPUs. The scheduler places a
  ``gpus: a100:1g.10gb`` job there, and its pod asks for ``nvidia.com/mig-1g.10gb``
  (``manifests.gpu_request``). The layout is written into the node's labels
  (``orrery.io/mig-layout: 1g.10gb:7``), so a changed layout is seen as a changed node.
* **Shared GPUs**: a node whose device plugin time-slices or runs MPS (``nvidia.com/gpu.replicas``
  > 1) has its replicas divided back into GPUs. Whether Orrery hands out fractions of them is the
  operator's choice (``GpuDevice.shareable``), as on every kind; the pods ask for the resource
  the node advertises (``nvidia.com/gpu.shared`` where the plugin renamed it). The resource a
  node's whole GPUs are asked by is written into its labels as ``orrery.io/gpu-resource``.
* **GPUs**: one device per GPU of *capacity*. Those the device plugin withdrew (capacity above
  allocatable: it found them unhealthy) and those held by pods Orrery did not place are reported
  unhealthy, with the reason, so the scheduler counts them as taken; Orrery's own pods are
  counted by Orrery's allocations. Which indices: the highest ones Orrery does not hold (on
  Kubernetes the device plugin, not Orrery, picks the physical GPU; Orrery's indices are tallies).
  MIG instances withdrawn or held by foreign pods take whole GPUs in MIG mode out, enough to
  cover them (``gpus.unavailable_mig_gpus``); a foreign pod's replica of a shared GPU takes one
  GPU (it may be on any).
* **Foreign pods**: pods bound to the node, not Succeeded/Failed, that are not Orrery's. A pod is
  Orrery's only if it is in the cluster's Orrery namespace (``config["namespace"]``) *and* carries
  ``orrery.io/attempt-id``: a pod elsewhere claiming the label is foreign all the same. Their CPU
  and memory requests come off the node's allocatable CPU and memory too.
* **State**: Ready≠True → ``not_ready`` at once (then ``down`` through the lifecycle, the node-loss
  path, if it stays silent); ``spec.unschedulable`` or a NoSchedule/NoExecute taint Orrery's pods
  do not tolerate → ``cordoned``; otherwise the node heartbeats and the lifecycle makes it
  ``ready``. Taints that only restate a condition (``node.kubernetes.io/not-ready``,
  ``unreachable``, ``unschedulable``) and ``nvidia.com/gpu`` (tolerated by every pod asking for
  GPUs, through the ExtendedResourceToleration admission plugin) are not counted; more keys are
  tolerated with ``config["tolerated_taints"]``. States set here carry reasons starting with
  ``kubernetes:``; an Orrery operator's drain or cordon is never overridden.
* **A node that disappears** from the API (deleted) becomes ``not_ready`` at once and stops
  heartbeating: the lifecycle takes it ``down`` after ``NODE_FAILOVER_AFTER`` and the jobs there
  follow the failover policy, as for any kind (and a cluster that loses most nodes at once pauses
  failover instead).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from django.db import transaction
from django.db.models import ProtectedError
from kubernetes import client as k8s
from kubernetes.utils import parse_quantity

from clusters import ports
from clusters.adapters.base import AdapterError, Inventory
from clusters.adapters.kubernetes.gpus import (
    GPU,
    MIG_LAYOUT_LABEL,
    MIG_PREFIX,
    RESOURCE_LABEL,
    SHARED_GPU,
    GpuOffer,
    NodeGpus,
    foreign_gpus,
    node_gpus,
    quantity,
    unavailable_gpus,
    unavailable_mig_gpus,
)
from clusters.adapters.kubernetes.informer import Informer, watched
from clusters.choices import OPERATOR_NODE_STATES, GpuHealth, NodeState
from clusters.ingest.buffer import get_buffer
from clusters.ingest.records import collector_record
from clusters.models import Cluster, GpuDevice, GpuModel, GpuModelAlias, MigInstance, Node
from clusters.services.credentials import GpuDescription, NodeDescription, upsert_node
from clusters.services.mig import MigDescription
from clusters.services.nodes import set_node_state

log = logging.getLogger(__name__)

ATTEMPT_LABEL = "orrery.io/attempt-id"
DEFAULT_NAMESPACE = "orrery"
REASON_PREFIX = "kubernetes: "
# Taints that restate a condition Orrery reads itself, or that GPU pods tolerate by admission.
IGNORED_TAINTS = frozenset(
    {
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unreachable",
        "node.kubernetes.io/unschedulable",
        GPU,
    }
)
BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
ACTIVE_PODS = "status.phase!=Succeeded,status.phase!=Failed"


# --- the API server's JSON, in Orrery's terms (pure) -------------------------------------------
def normalise(name: str) -> str:
    """Product names as GFD, nvidia-smi and people write them, made comparable."""
    key = re.sub(r"[-_\s]+", " ", name.strip().lower())
    return key.removesuffix(" shared").strip()


@dataclass(frozen=True)
class NodeView:
    """A Kubernetes node as Orrery sees it: capacities in base units, its GPUs, the state
    Kubernetes puts it in (``ready``, ``not_ready``, ``cordoned``) and why."""

    name: str
    cpu_millicores: int
    memory_bytes: int
    offer: GpuOffer  # whole GPUs
    gpu_memory_mb: int
    labels: dict[str, str]
    state: str
    reason: str
    boot_id: str = ""
    kubelet: str = ""
    gpus: NodeGpus | None = None  # whole GPUs, then those in MIG mode with their instances

    @property
    def gpu_count(self) -> int:
        return self.gpus.count if self.gpus is not None else self.offer.capacity

    @property
    def mig_layout(self) -> tuple[tuple[dict[str, Any], ...], ...]:
        return self.gpus.layout if self.gpus is not None else ()


def node_state(node: dict[str, Any], tolerated: Iterable[str] = ()) -> tuple[str, str]:
    """``(state, reason)``: NotReady before cordon (a silent node must reach the node-loss path,
    which a cordoned one never does), cordon before taints."""
    spec, status = node.get("spec") or {}, node.get("status") or {}
    ready = next((c for c in status.get("conditions") or () if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        if ready is None:
            return "not_ready", f"{REASON_PREFIX}no Ready condition"
        why = ": ".join(x for x in (ready.get("reason"), ready.get("message")) if x)
        return "not_ready", f"{REASON_PREFIX}Ready={ready.get('status')}" + (f" ({why})" if why else "")
    if spec.get("unschedulable"):
        return "cordoned", f"{REASON_PREFIX}cordoned"
    skip = IGNORED_TAINTS | set(tolerated)
    for taint in spec.get("taints") or ():
        if taint.get("effect") in BLOCKING_EFFECTS and taint.get("key") not in skip:
            value = f"={taint['value']}" if taint.get("value") else ""
            return "cordoned", f"{REASON_PREFIX}tainted {taint.get('key')}{value}:{taint.get('effect')}"
    return "ready", ""


def node_view(node: dict[str, Any], tolerated: Iterable[str] = ()) -> NodeView | None:
    """The node in Orrery's terms, or None when it offers no NVIDIA GPU (nor MIG instance)."""
    gpus = node_gpus(node)
    if gpus is None:
        return None
    meta, status = node.get("metadata") or {}, node.get("status") or {}
    labels = dict(meta.get("labels") or {})
    labels[RESOURCE_LABEL] = gpus.whole.resource
    if gpus.layout:
        labels[MIG_LAYOUT_LABEL] = gpus.layout_label
    allocatable = status.get("allocatable") or {}
    state, reason = node_state(node, tolerated)
    info = status.get("nodeInfo") or {}
    return NodeView(
        name=meta.get("name", ""),
        cpu_millicores=quantity(allocatable.get("cpu"), 1000),
        memory_bytes=quantity(allocatable.get("memory")),
        offer=gpus.whole,
        gpu_memory_mb=gpus.memory_mb,
        labels=labels,
        state=state,
        reason=reason[:255],
        boot_id=(info.get("bootID") or "")[:64],
        kubelet=(info.get("kubeletVersion") or "")[:30],
        gpus=gpus,
    )


@dataclass
class Usage:
    """What pods bound to one node request: per resource name, and cpu/memory."""

    resources: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    cpu_millicores: int = 0
    memory_bytes: int = 0
    pods: list[str] = field(default_factory=list)


def pod_requests(pod: dict[str, Any]) -> dict[str, Decimal]:
    """A pod's effective requests, as the scheduler counts them: the sum over its containers, or
    the largest init container's when that is more. A limit stands in for a missing request (the
    server defaults requests from limits; extended resources only have both equal)."""

    def of(container: dict[str, Any]) -> dict[str, Decimal]:
        res = container.get("resources") or {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        out = {}
        for name, value in merged.items():
            try:
                out[name] = parse_quantity(value)
            except (ValueError, ArithmeticError, TypeError):
                continue
        return out

    spec = pod.get("spec") or {}
    total: dict[str, Decimal] = defaultdict(Decimal)
    for container in spec.get("containers") or ():
        for name, value in of(container).items():
            total[name] += value
    for container in spec.get("initContainers") or ():
        for name, value in of(container).items():
            total[name] = max(total[name], value)
    return dict(total)


def is_orrery_pod(pod: dict[str, Any], namespace: str) -> bool:
    """Orrery's pods live in Orrery's namespace and carry the attempt label; both are needed,
    so a pod elsewhere cannot hide its GPUs from Orrery by copying the label."""
    meta = pod.get("metadata") or {}
    return meta.get("namespace") == namespace and bool((meta.get("labels") or {}).get(ATTEMPT_LABEL))


def foreign_usage(pods: Iterable[dict[str, Any]], namespace: str) -> dict[str, Usage]:
    """``{node name: what pods Orrery did not place request there}``, over pods bound to a node
    and not finished."""
    usage: dict[str, Usage] = defaultdict(Usage)
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if not node or phase in ("Succeeded", "Failed") or is_orrery_pod(pod, namespace):
            continue
        entry = usage[node]
        for name, value in pod_requests(pod).items():
            if name == "cpu":
                entry.cpu_millicores += int(value * 1000)
            elif name == "memory":
                entry.memory_bytes += int(value)
            elif name in (GPU, SHARED_GPU) or name.startswith(MIG_PREFIX):
                entry.resources[name] += int(value)
        meta = pod.get("metadata") or {}
        entry.pods.append(f"{meta.get('namespace', '')}/{meta.get('name', '')}")
    return dict(usage)


class GpuCatalog:
    """The catalog's slugs and aliases by normalised name, read once per pass."""

    def __init__(self, names: dict[str, Any]) -> None:
        self.names = names

    @classmethod
    def load(cls) -> GpuCatalog:
        names: dict[str, Any] = {}
        models = {m.pk: m for m in GpuModel.objects.all()}
        for model in models.values():
            names[normalise(model.slug)] = model
        for name, model_id in GpuModelAlias.objects.values_list("name", "gpu_model_id"):
            names.setdefault(normalise(name), models[model_id])
        return cls(names)

    def resolve(self, offer: GpuOffer) -> Any | None:
        """The model of the offer's product (of the parent GPU, for MIG instances)."""
        return self.names.get(normalise(offer.type_name))


# --- the informers --------------------------------------------------------------------------
def credentials_of(api_client: k8s.ApiClient) -> str:
    """A fingerprint of where and as whom ``api_client`` connects: new credentials, new
    informers (``informer.watched``'s ``generation``)."""
    c = api_client.configuration
    parts = [
        c.host,
        repr(sorted((c.api_key or {}).items())),
        c.ssl_ca_cert,
        getattr(c, "ca_cert_data", None),  # how a stored CA bundle travels (not as a file)
        getattr(c, "tls_server_name", None),
        c.cert_file,
        c.key_file,
    ]
    return hashlib.sha256("\0".join(str(p) for p in parts).encode()).hexdigest()[:16]


def informers_for(cluster: Cluster, api_client: k8s.ApiClient) -> tuple[Informer, Informer]:
    """The cluster's node informer and its informer of active pods (all namespaces)."""
    core = k8s.CoreV1Api(api_client)
    generation = credentials_of(api_client)
    nodes = watched(cluster.pk, "nodes", core.list_node, generation=generation)
    pods = watched(
        cluster.pk,
        "pods",
        core.list_pod_for_all_namespaces,
        generation=generation,
        field_selector=ACTIVE_PODS,
    )
    return nodes, pods


def take_inventory(cluster: Cluster, api_client: k8s.ApiClient, *, sync_timeout_s: float = 5.0) -> Inventory:
    """One inventory pass from the informers' stores (they list once, then watch: a pass reads
    memory, not the API server). Raises ``AdapterError`` until the nodes have been listed.

    Reading every namespace's pods needs ``list``/``watch`` on pods at the cluster scope. Where
    that is refused, the pass goes on without subtracting foreign pods, and says so in the log."""
    nodes, pods = informers_for(cluster, api_client)
    # A short wait: the informer goes on listing in the background, and a cluster that does not
    # answer must not hold up the other clusters' passes (their heartbeats) behind it.
    if not nodes.wait_synced(sync_timeout_s):
        raise AdapterError(f"cannot list nodes: {nodes.last_error or 'no answer yet'}")
    if nodes.failing_for() > STALE_AFTER_S:
        # No heartbeats from a store that stopped updating: the nodes fall silent and the
        # lifecycle judges them (not ready, then failover), as for any cluster out of reach.
        raise AdapterError(f"the node watch has failed for {nodes.failing_for():.0f} s: {nodes.last_error}")
    deadline = time.monotonic() + sync_timeout_s
    while not pods.wait_synced(0.05) and not pods.stats["errors"] and time.monotonic() < deadline:
        pass
    if not pods.has_synced():
        log.warning(
            "kubernetes cluster %s: pods not listed (%s); foreign pods are not subtracted",
            cluster,
            pods.last_error or "no answer yet",
        )
    # Passes come every 2 s (adapter.inventory_every_s); one that finds neither store changed
    # since this process's last full pass, which is recent enough to have refreshed the nodes'
    # heartbeats, does nothing. A change therefore reaches the scheduler within about 2 s.
    seen = (nodes, nodes.changes, pods, pods.changes, pods.has_synced())
    last = _last_pass.get(cluster.pk)
    same = last is not None and all(a is b or a == b for a, b in zip(last[0], seen, strict=True))
    if same and time.monotonic() - last[1] < REFRESH_S:
        return last[2]
    inventory = apply_inventory(cluster, nodes.objects().values(), pods.objects().values())
    _last_pass[cluster.pk] = (seen, time.monotonic(), inventory)
    return inventory


# An informer failing this long (seconds) no longer speaks for the cluster.
STALE_AFTER_S = 30.0
# A full pass at least this often (seconds), changes or not: it refreshes the nodes' heartbeats,
# which the lifecycle judges against ORRERY_NODE_GRACE.
REFRESH_S = 10.0
# cluster id → (the stores' change counters, when, what) of this process's last full pass
_last_pass: dict[int, tuple[tuple[Informer, int, Informer, int, bool], float, Inventory]] = {}


# --- into Orrery ------------------------------------------------------------------------------
_BOOT = uuid.uuid4().hex  # for nodes whose kubelet reports no boot id
# Labels that change without the node changing (GFD stamps each of its runs): not copied, or
# every node would be rewritten every minute.
VOLATILE_LABELS = frozenset({"nvidia.com/gfd.timestamp"})
VANISHED = f"{REASON_PREFIX}node deleted, or no longer offers GPUs"
_NodeRow = tuple[int, str, str, int, int, int, int, int, dict[str, str]]


def apply_inventory(
    cluster: Cluster, node_objects: Iterable[dict[str, Any]], pod_objects: Iterable[dict[str, Any]]
) -> Inventory:
    """Bring the cluster's Orrery nodes in line with these Kubernetes objects (module docstring).
    Idempotent: a pass that sees what the last one saw writes no rows, only heartbeats."""
    tolerated = cluster.config.get("tolerated_taints") or ()
    namespace = cluster.config.get("namespace") or DEFAULT_NAMESPACE
    views = {v.name: v for v in (node_view(obj, tolerated) for obj in node_objects) if v and v.name}
    usage = foreign_usage(pod_objects, namespace)
    catalog = GpuCatalog.load()
    models = {name: catalog.resolve(view.offer) for name, view in views.items()}
    unknown = {views[name].offer.type_name for name, model in models.items() if model is None}

    with transaction.atomic():
        rows = _node_rows(cluster)
        _create_nodes(cluster, [v for n, v in views.items() if n not in rows], models)
        rows = _node_rows(cluster) if len(rows) < len(views) else rows
        _refresh_facts(cluster, views, models, rows)
        _subtract_foreign(views, usage, rows)
        for name, view in views.items():
            _follow(rows[name], view.state, view.reason)
        for name in rows.keys() - views.keys():
            _follow(rows[name], "not_ready", VANISHED)
        records = _heartbeats(cluster, views, models, usage, rows)
        if records:  # after commit: the nodes created above must exist for the aggregator
            transaction.on_commit(lambda: get_buffer().put(records))
    gpus = sum(v.gpu_count for n, v in views.items() if models[n] is not None)
    return Inventory(len(views), gpus, tuple(sorted(unknown)))


def _node_rows(cluster: Cluster) -> dict[str, _NodeRow]:
    rows = Node.objects.filter(cluster=cluster).values_list(
        "pk",
        "name",
        "state",
        "state_reason",
        "cpu_millicores_capacity",
        "cpu_millicores_allocatable",
        "memory_bytes_capacity",
        "memory_bytes_allocatable",
        "gpu_capacity",
        "labels",
    )
    return {row[1]: row for row in rows}


def _labels(view: NodeView) -> dict[str, str]:
    return {k: v for k, v in view.labels.items() if k not in VOLATILE_LABELS}


def _description(view: NodeView, model: GpuModel | None) -> NodeDescription:
    gpus: list[GpuDescription] = []
    if model is not None:
        whole = view.offer.capacity
        gpus = [GpuDescription(index=i, model=model, memory_mb=view.gpu_memory_mb) for i in range(whole)]
        gpus += [_mig_gpu(whole + i, model, view, list(mig)) for i, mig in enumerate(view.mig_layout)]
    return NodeDescription(
        name=view.name,
        cpu_millicores=view.cpu_millicores,
        memory_bytes=view.memory_bytes,
        gpus=gpus,
        labels=_labels(view),
        agent_version=_agent(view),
        boot_id=view.boot_id or _BOOT,
    )


def _mig_gpu(index: int, model: GpuModel, view: NodeView, instances: list[dict[str, Any]]) -> GpuDescription:
    """A GPU in MIG mode, its instances in the agent-report shape (``GpuDescription.mig``)."""
    return GpuDescription(
        index=index,
        model=model,
        memory_mb=view.gpu_memory_mb,
        mig=tuple(MigDescription(**i) for i in instances),
    )


def _agent(view: NodeView) -> str:
    return f"kubelet {view.kubelet}".strip()


def _create_nodes(cluster: Cluster, views: list[NodeView], models: dict[str, GpuModel | None]) -> None:
    """New nodes in bulk (a cluster of thousands joins in one pass): as ``upsert_node`` would
    create them, ``not_ready`` until their heartbeats have been on time for NODE_RECOVERY."""
    if not views:
        return
    created = Node.objects.bulk_create(
        [
            Node(
                cluster=cluster,
                name=v.name,
                state=NodeState.NOT_READY,
                state_reason=v.reason if v.state == "not_ready" else "registered; waiting for heartbeats",
                cpu_millicores_capacity=v.cpu_millicores,
                cpu_millicores_allocatable=v.cpu_millicores,
                memory_bytes_capacity=v.memory_bytes,
                memory_bytes_allocatable=v.memory_bytes,
                gpu_capacity=v.gpu_count if models[v.name] is not None else 0,
                labels=_labels(v),
                agent_version=_agent(v),
                boot_id=v.boot_id or _BOOT,
            )
            for v in views
        ],
        batch_size=1000,
    )
    devices, layouts = [], []
    for node, view in zip(created, views, strict=True):
        model = models[view.name]
        if model is not None:
            memory = view.gpu_memory_mb or model.memory_mb
            devices += [
                GpuDevice(
                    node=node,
                    index=i,
                    model=model,
                    memory_mb=memory,
                    health=GpuHealth.HEALTHY,
                    mig_enabled=i >= view.offer.capacity,
                )
                for i in range(view.gpu_count)
            ]
            layouts += [()] * view.offer.capacity + list(view.mig_layout)
    GpuDevice.objects.bulk_create(devices, batch_size=5000)
    MigInstance.objects.bulk_create(
        [
            MigInstance(
                gpu=device,
                slot=mig["slot"],
                profile=mig["profile"],
                uuid=mig["uuid"],
                memory_mb=mig["memory_mb"],
                slices=mig["slices"],
            )
            for device, layout in zip(devices, layouts, strict=True)
            for mig in layout
        ],
        batch_size=5000,
    )


def _refresh_facts(
    cluster: Cluster,
    views: dict[str, NodeView],
    models: dict[str, GpuModel | None],
    rows: dict[str, _NodeRow],
) -> None:
    """Nodes whose capacities, labels or GPU model changed go through ``upsert_node``."""
    first = dict(
        GpuDevice.objects.filter(node__cluster=cluster, index=0).values_list("node__name", "model_id")
    )
    for name, view in views.items():
        _, _, _, _, cpu, _, memory, _, gpus, labels = rows[name]
        model = models[name]
        facts = (view.cpu_millicores, view.memory_bytes, view.gpu_count if model else 0, _labels(view))
        if facts == (cpu, memory, gpus, labels) and first.get(name) == (model.pk if model else None):
            continue
        try:
            with transaction.atomic():  # a savepoint: one node refused does not undo the pass
                upsert_node(cluster, _description(view, model))
        except ProtectedError:
            log.warning("kubernetes node %s/%s: a GPU that went away is still allocated", cluster, name)
    rows.update(_node_rows(cluster) if views else {})


def _subtract_foreign(views: dict[str, NodeView], usage: dict[str, Usage], rows: dict[str, _NodeRow]) -> None:
    """Allocatable CPU and memory are the node's minus what foreign pods request."""
    for name in views:
        pk, _, _, _, cpu_cap, cpu_alloc, mem_cap, mem_alloc, _, _ = rows[name]
        used = usage.get(name)
        cpu = max(min(cpu_cap, cpu_cap - (used.cpu_millicores if used else 0)), 0)
        memory = max(min(mem_cap, mem_cap - (used.memory_bytes if used else 0)), 0)
        if (cpu, memory) != (cpu_alloc, mem_alloc):
            Node.objects.filter(pk=pk).update(cpu_millicores_allocatable=cpu, memory_bytes_allocatable=memory)


def _follow(row: _NodeRow, target: str, reason: str) -> None:
    """Move the node to Kubernetes' verdict where that is Kubernetes' to decide: never out of
    an Orrery operator's drain or cordon (reasons not starting ``kubernetes:``), never out of
    ``down`` but by heartbeats (the lifecycle)."""
    pk, _, state, current_reason, *_ = row
    ours = current_reason.startswith(REASON_PREFIX)
    if target == "not_ready":
        move = state == NodeState.READY or (state in OPERATOR_NODE_STATES and ours)
        to = NodeState.NOT_READY
    elif target == "cordoned":
        move = state in (NodeState.READY, NodeState.NOT_READY, NodeState.DOWN) or (
            state == NodeState.CORDONED and ours and current_reason != reason
        )
        to = NodeState.CORDONED
    else:  # Kubernetes says ready: what Kubernetes had said goes; heartbeats do the rest
        move = ours and state in OPERATOR_NODE_STATES | {NodeState.DOWN}
        to, reason = NodeState.NOT_READY, f"{REASON_PREFIX}back in service"
    if not move:
        return
    node = Node.objects.select_for_update().filter(pk=pk).first()
    if node is not None and node.state == state:
        set_node_state(node, to, {state}, actor=None, reason=reason[:255])


def _heartbeats(
    cluster: Cluster,
    views: dict[str, NodeView],
    models: dict[str, GpuModel | None],
    usage: dict[str, Usage],
    rows: dict[str, _NodeRow],
) -> list[dict[str, Any]]:
    """A heartbeat for every node whose kubelet says Ready (cordoned ones too: the machine is
    alive), with its GPUs as Orrery may use them."""
    alive = [name for name, view in views.items() if view.state != "not_ready"]
    foreign = {n: dict(usage[n].resources) if n in usage else {} for n in alive}
    short = [rows[n][0] for n in alive if models[n] is not None and _short(views[n], foreign[n])]
    held = ports.held_gpus()(short) if short else {}
    now = time.time()
    records = []
    for name in alive:
        view, pk = views[name], rows[name][0]
        gpus = []
        if models[name] is not None:
            unavailable = _unavailable(view, foreign[name], held.get(pk, set()))
            for i in range(view.gpu_count):
                why = unavailable.get(i)
                health = "unhealthy" if why else "healthy"
                gpus.append([i, "", "", None, None, None, None, None, health, None, why or ""])
        records.append(
            collector_record(
                pk, cluster.pk, boot=view.boot_id or _BOOT, agent=_agent(view), gpus=gpus, now=now
            )
        )
    return records


def _short(view: NodeView, foreign: dict[str, int]) -> bool:
    """Whether the node offers fewer GPUs or instances than it has (withdrawn, or foreign)."""
    offers = [view.offer, *(view.gpus.mig if view.gpus is not None else ())]
    return any(foreign.get(o.resource, 0) or o.allocatable < o.capacity for o in offers)


def _unavailable(view: NodeView, foreign: dict[str, int], held: set[int]) -> dict[int, str]:
    """``{GPU index: why Orrery may not use it}``: whole GPUs, then GPUs in MIG mode."""
    out = unavailable_gpus(view.offer, foreign_gpus(view.offer, foreign.get(view.offer.resource, 0)), held)
    if view.gpus is not None and view.gpus.layout:
        out |= unavailable_mig_gpus(view.gpus, foreign, held)
    return out
