"""A Kubernetes cluster's inventory: the pure mapping of node and pod JSON (on nodes recorded
from a real kube-apiserver, ``tests/kubefake/recordings``), then the pass through the fake API
server into Orrery's nodes, the heartbeat pipeline and the scheduler's cache."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from clusters.adapters.kubernetes.gpus import (
    GPU,
    RESOURCE_LABEL,
    GpuOffer,
    gpu_offer,
    quantity,
    unavailable_gpus,
)
from clusters.adapters.kubernetes.inventory import (
    GpuCatalog,
    foreign_usage,
    is_orrery_pod,
    node_state,
    node_view,
    normalise,
    pod_requests,
)
from tests.kubefake import plugin

kube, kube_client = plugin.kube, plugin.kube_client  # the fake API server's fixtures
RECORDINGS = Path(__file__).resolve().parents[1] / "kubefake" / "recordings"


def recorded_node(name: str) -> dict[str, Any]:
    """The node as the server last answered it in the recording ``name`` (010–017)."""
    data = json.loads(next(RECORDINGS.glob(f"{name}-*.json")).read_text())
    exchanges = data.get("exchanges") or [data]
    return copy.deepcopy(exchanges[-1]["response"]["body"])


def ready(node: dict[str, Any]) -> dict[str, Any]:
    """As the node-lifecycle controller of a real cluster leaves a Ready node: without the
    ``not-ready`` taint that the recording's controller-less server kept."""
    node["spec"]["taints"] = [
        t for t in node["spec"].get("taints", []) if t["key"] != "node.kubernetes.io/not-ready"
    ]
    return node


def pod(
    name: str,
    node: str = "dgx-h100-001",
    *,
    namespace: str = "research",
    gpus: int = 0,
    phase: str = "Running",
    labels: dict[str, str] | None = None,
    cpu: str = "1",
    memory: str = "1Gi",
    init_gpus: int = 0,
) -> dict[str, Any]:
    limits = {GPU: str(gpus)} if gpus else {}
    spec: dict[str, Any] = {
        "nodeName": node,
        "containers": [
            {"name": "main", "resources": {"limits": limits, "requests": {"cpu": cpu, "memory": memory}}}
        ],
    }
    if init_gpus:
        spec["initContainers"] = [{"name": "init", "resources": {"limits": {GPU: str(init_gpus)}}}]
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
        "spec": spec,
        "status": {"phase": phase},
    }


# --- quantities and names ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "scale", "expected"),
    [
        ("222", 1000, 222_000),
        ("500m", 1000, 500),
        ("2102984852Ki", 1, 2102984852 * 1024),
        ("1Gi", 1, 2**30),
        (None, 1, 0),
        ("", 1, 0),
        ("nonsense", 1, 0),
        ("-3", 1, 0),
    ],
    ids=["cores", "millicores", "Ki", "Gi", "none", "empty", "nonsense", "negative"],
)
def test_quantities(value, scale, expected):
    assert quantity(value, scale) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("NVIDIA-H100-80GB-HBM3", "nvidia h100 80gb hbm3"),
        ("NVIDIA H100 80GB HBM3", "nvidia h100 80gb hbm3"),
        ("NVIDIA-A100-SXM4-80GB-SHARED", "nvidia a100 sxm4 80gb"),
        ("a100-80g", "a100 80g"),
    ],
    ids=["gfd", "nvidia-smi", "time-sliced", "slug"],
)
def test_product_names_compare_alike(raw, expected):
    assert normalise(raw) == expected


# --- nodes ------------------------------------------------------------------------------------
def test_h100_node_offers_eight_gpus_with_its_labels():
    view = node_view(ready(recorded_node("011")))
    assert view is not None
    assert view.name == "dgx-h100-001"
    assert view.offer == GpuOffer(GPU, "NVIDIA-H100-80GB-HBM3", 8, 8)
    assert view.cpu_millicores == 222_000
    assert view.memory_bytes == 2102984852 * 1024
    assert view.gpu_memory_mb == 81559
    assert (view.state, view.reason) == ("ready", "")
    assert view.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert view.labels[RESOURCE_LABEL] == GPU
    assert view.boot_id == "9b0e8a52-61c4-4f0e-a0a7-4a4e0d6a3c11"


def test_mig_node_offers_a_gpu_in_mig_mode_with_its_instances_not_the_zero_full_gpus():
    view = node_view(ready(recorded_node("012")))
    assert view is not None and view.gpus is not None
    assert view.offer == GpuOffer(GPU, "NVIDIA-A100-SXM4-80GB", 0, 0)
    assert view.gpus.mig == (GpuOffer("nvidia.com/mig-1g.10gb", "NVIDIA-A100-SXM4-80GB", 7, 7, "1g.10gb"),)
    (gpu,) = view.mig_layout  # 7 × 1g.10gb: one A100's worth
    assert gpu == tuple(
        {"slot": i, "profile": "1g.10gb", "uuid": "", "memory_mb": 9728, "slices": 1} for i in range(7)
    )  # each instance's memory as GFD gives it
    assert view.gpu_count == 1
    assert view.labels[RESOURCE_LABEL] == GPU
    assert view.labels["orrery.io/mig-layout"] == "1g.10gb:7"
    assert view.gpu_memory_mb == 81920  # the whole GPU's, as GFD gives it


def test_node_registered_without_status_offers_nothing():
    assert node_view(recorded_node("010")) is None  # 010: created, no capacity yet


def test_node_without_nvidia_resources_is_not_orrerys():
    node = ready(recorded_node("011"))
    for key in ("capacity", "allocatable"):
        del node["status"][key]["nvidia.com/gpu"]
    assert node_view(node) is None


def test_withdrawn_gpus_keep_their_devices_and_are_not_allocatable():
    node = ready(recorded_node("011"))
    node["status"]["allocatable"][GPU] = "6"  # the device plugin found two unhealthy
    assert gpu_offer(node) == GpuOffer(GPU, "NVIDIA-H100-80GB-HBM3", 8, 6)


def test_not_ready_node_says_why():
    state, reason = node_state(recorded_node("013"))
    assert state == "not_ready"
    assert reason.startswith("kubernetes: Ready=False (KubeletNotReady: container runtime network not ready")


def test_node_without_ready_condition_is_not_ready():
    node = ready(recorded_node("011"))
    node["status"]["conditions"] = [c for c in node["status"]["conditions"] if c["type"] != "Ready"]
    assert node_state(node) == ("not_ready", "kubernetes: no Ready condition")


def test_cordoned_node():
    node = recorded_node("016")  # cordoned while NotReady: NotReady wins (the node-loss path)
    assert node_state(node)[0] == "not_ready"
    node["status"]["conditions"][-1]["status"] = "True"
    assert node_state(ready(node)) == ("cordoned", "kubernetes: cordoned")


@pytest.mark.parametrize(
    ("taint", "tolerated", "expected"),
    [
        ({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}, (), "ready"),
        ({"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}, (), "ready"),
        ({"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}, (), "ready"),
        ({"key": "maintenance", "value": "bios", "effect": "NoSchedule"}, (), "cordoned"),
        ({"key": "maintenance", "effect": "NoExecute"}, (), "cordoned"),
        ({"key": "maintenance", "effect": "PreferNoSchedule"}, (), "ready"),
        ({"key": "dedicated", "value": "ml", "effect": "NoSchedule"}, ("dedicated",), "ready"),
    ],
    ids=[
        "gpu-taint-tolerated-by-admission",
        "condition-taint-left-to-condition",
        "unreachable-left-to-condition",
        "noschedule",
        "noexecute",
        "prefer-is-not-a-block",
        "configured-toleration",
    ],
)
def test_taints(taint, tolerated, expected):
    node = ready(recorded_node("017"))  # 017: the MIG node, Ready, with nvidia.com/gpu tainted
    node["spec"]["taints"] = [taint]
    state, reason = node_state(node, tolerated)
    assert state == expected
    if expected == "cordoned":
        assert reason.startswith(f"kubernetes: tainted {taint['key']}")
        assert taint["effect"] in reason


def test_recorded_gpu_taint_leaves_the_mig_node_schedulable():
    assert node_state(ready(recorded_node("017"))) == ("ready", "")


# --- the catalog ------------------------------------------------------------------------------
@pytest.mark.django_db
@pytest.mark.parametrize(
    ("offer", "slug"),
    [
        (GpuOffer(GPU, "NVIDIA-H100-80GB-HBM3", 8, 8), "h100-80g"),
        (GpuOffer(GPU, "NVIDIA-A100-SXM4-80GB", 8, 8), "a100-80g"),
        (GpuOffer(GPU, "NVIDIA-A100-SXM4-80GB-SHARED", 8, 8), "a100-80g"),
        (GpuOffer(GPU, "NVIDIA-B200", 8, 8), None),
        (GpuOffer("nvidia.com/mig-1g.10gb", "NVIDIA-A100-SXM4-80GB", 7, 7, "1g.10gb"), "a100-80g"),
    ],
    ids=["h100", "a100", "time-sliced", "unknown-product", "mig-instances-of-their-gpus-model"],
)
def test_catalog_resolves_gfd_products(offer, slug):
    model = GpuCatalog.load().resolve(offer)
    assert (model.slug if model else None) == slug


# --- pods -------------------------------------------------------------------------------------
def test_pod_requests_add_containers_and_take_the_largest_init_container():
    p = pod("a", gpus=2, init_gpus=4, cpu="500m")
    p["spec"]["containers"].append({"name": "side", "resources": {"requests": {"cpu": "250m"}}})
    requests = pod_requests(p)
    assert requests[GPU] == 4
    assert requests["cpu"] * 1000 == 750


def test_orrery_pods_are_those_in_its_namespace_with_its_label():
    label = {"orrery.io/attempt-id": "7f0c"}
    assert is_orrery_pod(pod("ours", namespace="orrery", labels=label), "orrery")
    assert not is_orrery_pod(pod("no-label", namespace="orrery"), "orrery")
    assert not is_orrery_pod(pod("impostor", namespace="research", labels=label), "orrery")


def test_foreign_usage_counts_bound_unfinished_pods_that_are_not_orrerys():
    label = {"orrery.io/attempt-id": "7f0c"}
    pods = [
        pod("train", gpus=2, cpu="4", memory="8Gi"),
        pod("impostor", gpus=1, labels=label),  # Orrery's label, not Orrery's namespace
        pod("ours", gpus=4, namespace="orrery", labels=label),
        pod("done", gpus=8, phase="Succeeded"),
        pod("failed", gpus=8, phase="Failed"),
        pod("unbound", node="", gpus=8, phase="Pending"),
        pod("elsewhere", node="dgx-h100-002", gpus=1, phase="Pending"),
    ]
    usage = foreign_usage(pods, "orrery")
    h1 = usage["dgx-h100-001"]
    assert h1.resources[GPU] == 3
    assert h1.cpu_millicores == 5000
    assert h1.memory_bytes == 9 * 2**30
    assert sorted(h1.pods) == ["research/impostor", "research/train"]
    assert usage["dgx-h100-002"].resources[GPU] == 1


@pytest.mark.parametrize(
    ("capacity", "allocatable", "foreign", "held", "expected"),
    [
        (8, 8, 0, set(), {}),
        (8, 8, 2, set(), {7: "foreign", 6: "foreign"}),
        (8, 8, 2, {7, 5}, {6: "foreign", 4: "foreign"}),
        (8, 6, 1, set(), {7: "withdrawn", 6: "withdrawn", 5: "foreign"}),
        (2, 2, 5, {0}, {1: "foreign"}),
    ],
    ids=["nothing", "top-indices", "skips-orrerys", "withdrawn-first", "never-more-than-there-are"],
)
def test_unavailable_gpus(capacity, allocatable, foreign, held, expected):
    out = unavailable_gpus(GpuOffer(GPU, "x", capacity, allocatable), foreign, held)
    words = {
        "foreign": "in use by pods Orrery did not place",
        "withdrawn": "not allocatable (withdrawn by the device plugin)",
    }
    assert out == {i: words[w] for i, w in expected.items()}


# --- into Orrery: nodes, the heartbeat pipeline, the scheduler's cache ---------------------------
def h100(name: str = "dgx-h100-001") -> dict[str, Any]:
    node = ready(recorded_node("011"))
    node["metadata"]["name"] = node["metadata"]["labels"]["kubernetes.io/hostname"] = name
    return node


@pytest.fixture
def cluster_a(db):
    from tests.factories import ensure_catalog, make_cluster

    ensure_catalog()
    return make_cluster("kube-a", kind="kubernetes", config={"namespace": "orrery"})


@pytest.fixture
def inventory_pass(django_capture_on_commit_callbacks):
    """One pass as the periodic task runs it, then the aggregation pass that follows it."""
    from clusters.adapters.kubernetes.inventory import apply_inventory
    from clusters.services.aggregation import flush_heartbeats

    def run(cluster, nodes, pods=()):
        with django_capture_on_commit_callbacks(execute=True):
            seen = apply_inventory(cluster, nodes, pods)
        flush_heartbeats()
        return seen

    return run


def heartbeats_on_time() -> None:
    """The lifecycle, NODE_RECOVERY seconds on: nodes heartbeating since are ready."""
    from datetime import timedelta

    from django.conf import settings
    from django.db.models import F
    from django.utils import timezone

    from clusters.models import NodeLastSeen
    from clusters.services.lifecycle import run_node_lifecycle

    # The nodes reported so far have done so for NODE_RECOVERY seconds, up to now.
    NodeLastSeen.objects.update(good_since=F("seen_at") - timedelta(seconds=settings.NODE_RECOVERY + 1))
    run_node_lifecycle(timezone.now())


def orrery_node(cluster, name: str):
    return cluster.nodes.get(name=name)


def test_first_pass_creates_the_gpu_nodes(cluster_a, inventory_pass):
    from clusters.choices import NodeState

    mig = ready(recorded_node("012"))
    seen = inventory_pass(cluster_a, [h100(), mig, recorded_node("013")])
    assert (seen.nodes, seen.gpus) == (3, 17)  # 8 + 8, and the A100 in MIG mode
    assert seen.unknown_gpu_types == ()
    node = orrery_node(cluster_a, "dgx-h100-001")
    assert node.gpu_capacity == 8
    assert {g.model.slug for g in node.gpus.all()} == {"h100-80g"}
    assert node.gpus.first().memory_mb == 81559
    assert node.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert node.labels[RESOURCE_LABEL] == GPU
    assert "nvidia.com/gfd.timestamp" not in node.labels  # changes every GFD run: not copied
    assert node.cpu_millicores_allocatable == 222_000
    assert orrery_node(cluster_a, "dgx-a100-mig-001").gpu_capacity == 1  # one A100, in MIG mode
    not_ready = orrery_node(cluster_a, "dgx-h100-002")
    assert not_ready.state == NodeState.NOT_READY
    assert not_ready.state_reason.startswith("kubernetes: Ready=False (KubeletNotReady")
    heartbeats_on_time()
    assert orrery_node(cluster_a, "dgx-h100-001").state == NodeState.READY
    assert orrery_node(cluster_a, "dgx-a100-mig-001").state == NodeState.READY
    assert (
        orrery_node(cluster_a, "dgx-h100-002").state == NodeState.NOT_READY
    )  # no heartbeat: kubelet not ready


def test_a_pass_that_sees_nothing_new_writes_no_node_rows(
    cluster_a, inventory_pass, django_assert_max_num_queries
):
    from clusters.adapters.kubernetes.inventory import apply_inventory

    nodes = [h100(f"dgx-h100-{i:03}") for i in range(20)]
    inventory_pass(cluster_a, nodes)
    with django_assert_max_num_queries(8):  # reads, no writes, whatever the number of nodes
        apply_inventory(cluster_a, nodes, [])


def test_a_mig_node_joins_with_its_gpu_in_mig_mode_and_its_instances(cluster_a, inventory_pass):
    seen = inventory_pass(cluster_a, [ready(recorded_node("012"))])
    assert (seen.gpus, seen.unknown_gpu_types) == (1, ())
    node = orrery_node(cluster_a, "dgx-a100-mig-001")
    (gpu,) = node.gpus.all()
    assert (gpu.model.slug, gpu.memory_mb, gpu.mig_enabled) == ("a100-80g", 81920, True)
    assert list(gpu.mig_instances.values_list("slot", "profile", "memory_mb", "slices")) == [
        (i, "1g.10gb", 9728, 1) for i in range(7)
    ]
    assert node.labels["orrery.io/mig-layout"] == "1g.10gb:7"


def test_a_changed_mig_layout_describes_the_node_again(cluster_a, inventory_pass):
    node = ready(recorded_node("012"))
    inventory_pass(cluster_a, [node])
    for key in ("capacity", "allocatable"):
        del node["status"][key]["nvidia.com/mig-1g.10gb"]
        node["status"][key]["nvidia.com/mig-3g.40gb"] = "4"
    inventory_pass(cluster_a, [node])
    row = orrery_node(cluster_a, "dgx-a100-mig-001")
    assert row.labels["orrery.io/mig-layout"] == "3g.40gb:4"
    assert [list(g.mig_instances.values_list("profile", flat=True)) for g in row.gpus.order_by("index")] == [
        ["3g.40gb"] * 2
    ] * 2


def test_foreign_pods_holding_mig_instances_take_gpus_in_mig_mode_away(cluster_a, inventory_pass):
    from clusters.choices import GpuHealth

    node = ready(recorded_node("012"))
    for key in ("capacity", "allocatable"):
        node["status"][key]["nvidia.com/mig-1g.10gb"] = "14"
    inventory_pass(cluster_a, [node])
    slices = pod("slices", "dgx-a100-mig-001")
    slices["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/mig-1g.10gb": "2"}
    inventory_pass(cluster_a, [node], [slices])
    gpus = orrery_node(cluster_a, "dgx-a100-mig-001").gpus
    assert list(gpus.filter(health=GpuHealth.UNHEALTHY).values_list("index", "health_reason")) == [
        (1, "MIG instances in use by pods Orrery did not place")
    ]
    inventory_pass(cluster_a, [node], [])
    assert not gpus.filter(health=GpuHealth.UNHEALTHY).exists()


def test_cordon_then_uncordon_follows_kubernetes(cluster_a, inventory_pass):
    from clusters.choices import NodeState

    node = h100()
    inventory_pass(cluster_a, [node])
    heartbeats_on_time()
    node["spec"]["unschedulable"] = True
    inventory_pass(cluster_a, [node])
    row = orrery_node(cluster_a, "dgx-h100-001")
    assert (row.state, row.state_reason) == (NodeState.CORDONED, "kubernetes: cordoned")
    assert row.events.last().to_state == NodeState.CORDONED  # the log the scheduler's cache reads
    del node["spec"]["unschedulable"]
    inventory_pass(cluster_a, [node])
    assert orrery_node(cluster_a, "dgx-h100-001").state == NodeState.NOT_READY  # back, on probation
    heartbeats_on_time()
    assert orrery_node(cluster_a, "dgx-h100-001").state == NodeState.READY


def test_a_taint_cordons_and_its_removal_resumes(cluster_a, inventory_pass):
    from clusters.choices import NodeState

    node = h100()
    inventory_pass(cluster_a, [node])
    heartbeats_on_time()
    node["spec"]["taints"] = [{"key": "maintenance", "value": "bios", "effect": "NoExecute"}]
    inventory_pass(cluster_a, [node])
    row = orrery_node(cluster_a, "dgx-h100-001")
    assert (row.state, row.state_reason) == (
        NodeState.CORDONED,
        "kubernetes: tainted maintenance=bios:NoExecute",
    )
    node["spec"]["taints"] = []
    inventory_pass(cluster_a, [node])
    assert orrery_node(cluster_a, "dgx-h100-001").state == NodeState.NOT_READY


def test_an_operators_cordon_is_never_lifted_by_kubernetes(cluster_a, inventory_pass, operator):
    from clusters.choices import NodeState
    from clusters.services.nodes import cordon_node

    inventory_pass(cluster_a, [h100()])
    heartbeats_on_time()
    cordon_node(orrery_node(cluster_a, "dgx-h100-001"), actor=operator, reason="bad fan")
    inventory_pass(cluster_a, [h100()])
    heartbeats_on_time()
    row = orrery_node(cluster_a, "dgx-h100-001")
    assert (row.state, row.state_reason) == (NodeState.CORDONED, "bad fan")


def test_a_node_going_not_ready_leaves_the_schedulers_snapshot_within_a_sync(cluster_a, inventory_pass):
    from scheduling.engine.cache import SchedulerCache

    node = h100()
    inventory_pass(cluster_a, [node, h100("dgx-h100-003")])
    heartbeats_on_time()
    cache = SchedulerCache()
    snap = cache.ensure()
    row = snap.row_of[orrery_node(cluster_a, "dgx-h100-001").pk]
    assert snap.ready[row]
    node["status"]["conditions"][-1].update(status="Unknown", reason="NodeStatusUnknown")
    inventory_pass(cluster_a, [node, h100("dgx-h100-003")])
    assert not cache.ensure().ready[row]


def test_foreign_pods_take_gpus_cpu_and_memory_away(cluster_a, inventory_pass):
    from clusters.choices import GpuHealth
    from scheduling.engine.cache import SchedulerCache

    inventory_pass(cluster_a, [h100()])
    heartbeats_on_time()
    cache = SchedulerCache()
    row = cache.ensure().row_of[orrery_node(cluster_a, "dgx-h100-001").pk]
    assert cache.snap.gpu_free[row] == 8
    label = {"orrery.io/attempt-id": "7f0c"}
    pods = [
        pod("train", gpus=2, cpu="20", memory="100Gi"),
        pod("impostor", gpus=1, labels=label),
        pod("ours", gpus=4, namespace="orrery", labels=label),
    ]
    inventory_pass(cluster_a, [h100()], pods)
    node = orrery_node(cluster_a, "dgx-h100-001")
    unhealthy = {g.index: g.health_reason for g in node.gpus.filter(health=GpuHealth.UNHEALTHY)}
    assert unhealthy == {i: "in use by pods Orrery did not place" for i in (5, 6, 7)}
    assert node.cpu_millicores_allocatable == 222_000 - 21_000
    assert node.memory_bytes_allocatable == 2102984852 * 1024 - 101 * 2**30
    assert node.cpu_millicores_capacity == 222_000
    assert cache.ensure().gpu_free[row] == 5  # the pod of Orrery's own is counted by its allocation
    inventory_pass(cluster_a, [h100()], [])
    assert cache.ensure().gpu_free[row] == 8
    assert orrery_node(cluster_a, "dgx-h100-001").cpu_millicores_allocatable == 222_000


def test_foreign_pods_never_take_a_gpu_orrery_holds(cluster_a, inventory_pass):
    from clusters.choices import GpuHealth
    from clusters.ports import ports_replaced

    inventory_pass(cluster_a, [h100()])
    node = orrery_node(cluster_a, "dgx-h100-001")
    with ports_replaced(held_gpus=lambda ids: {node.pk: {7, 6}}):
        inventory_pass(cluster_a, [h100()], [pod("train", gpus=2)])
    assert set(node.gpus.filter(health=GpuHealth.UNHEALTHY).values_list("index", flat=True)) == {5, 4}


def test_withdrawn_gpus_are_unhealthy_with_the_reason(cluster_a, inventory_pass):
    from clusters.choices import GpuHealth

    node = h100()
    node["status"]["allocatable"][GPU] = "7"
    inventory_pass(cluster_a, [node])
    gpus = orrery_node(cluster_a, "dgx-h100-001").gpus
    assert gpus.count() == 8
    assert list(gpus.filter(health=GpuHealth.UNHEALTHY).values_list("index", "health_reason")) == [
        (7, "not allocatable (withdrawn by the device plugin)")
    ]


def test_a_deleted_node_takes_the_node_loss_path(
    cluster_a, inventory_pass, django_capture_on_commit_callbacks
):
    from datetime import timedelta

    from django.conf import settings
    from django.utils import timezone

    from clusters.choices import NodeState
    from clusters.ports import ports_replaced
    from clusters.services.lifecycle import run_node_lifecycle

    names = [f"dgx-h100-{i:03}" for i in range(1, 5)]
    inventory_pass(cluster_a, [h100(n) for n in names])
    heartbeats_on_time()
    inventory_pass(cluster_a, [h100(n) for n in names[1:]])  # dgx-h100-001 was deleted
    gone = orrery_node(cluster_a, "dgx-h100-001")
    assert (gone.state, gone.state_reason) == (
        NodeState.NOT_READY,
        "kubernetes: node deleted, or no longer offers GPUs",
    )
    lost: list[int] = []
    later = timezone.now() + timedelta(seconds=settings.NODE_FAILOVER_AFTER + 1)
    inventory_pass(cluster_a, [h100(n) for n in names[1:]])
    with (
        ports_replaced(node_lost=lambda ids: lost.extend(ids) or len(ids)),
        django_capture_on_commit_callbacks(execute=True),
    ):
        # the others heartbeat on: only the deleted one is silent long enough
        from clusters.models import NodeLastSeen

        NodeLastSeen.objects.exclude(node=gone).update(seen_at=later)
        run_node_lifecycle(later)
    assert lost == [gone.pk]
    assert orrery_node(cluster_a, "dgx-h100-001").state == NodeState.DOWN


# --- through the fake API server --------------------------------------------------------------
# The cluster-scope read of pods that foreign-pod subtraction needs, beyond the adapter's role.
POD_READER = """
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: orrery-adapter-pods-read}
rules:
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: orrery-adapter-pods-read}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: orrery-adapter-pods-read}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: orrery-adapter}
"""


@pytest.fixture
def fake(kube):
    kube.apply_rbac(POD_READER)
    kube.cluster.create("namespaces", "", {"metadata": {"name": "research"}})
    yield kube
    from clusters.adapters.kubernetes.informer import forget_all

    forget_all()


@pytest.fixture
def adapter_client(fake, kube_client):
    return kube_client("adapter")


@pytest.fixture
def inventory_from(django_capture_on_commit_callbacks):
    """``take_inventory`` as the adapter calls it, then the aggregation pass."""
    from clusters.adapters.kubernetes.inventory import take_inventory
    from clusters.services.aggregation import flush_heartbeats

    def run(cluster, api_client):
        with django_capture_on_commit_callbacks(execute=True):
            seen = take_inventory(cluster, api_client, sync_timeout_s=10)
        flush_heartbeats()
        return seen

    return run


def run_pod(
    kube,
    name: str,
    node: str,
    *,
    namespace: str = "research",
    gpus: int = 1,
    labels=None,
    resource: str = GPU,
) -> None:
    """A pod as the scheduler and kubelet of the member cluster leave it: bound and Running."""
    body = {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "nodeName": node,
            "containers": [
                {"name": "main", "image": "busybox:1.36", "resources": {"limits": {resource: str(gpus)}}}
            ],
        },
    }
    kube.cluster.create("pods", namespace, body, manager="kube-controller-manager")
    kube.cluster.patch(
        "pods",
        namespace,
        name,
        {"status": {"phase": "Running"}},
        "application/strategic-merge-patch+json",
        subresource="status",
        manager="kubelet",
    )


def settle(check, timeout: float = 10.0):
    import time

    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s"
        time.sleep(0.02)


def test_inventory_through_the_api_server(kube_cluster, fake, adapter_client, inventory_from):
    from clusters.adapters.kubernetes.inventory import informers_for
    from clusters.choices import GpuHealth, NodeState

    fake.add_gpu_node("h100-a")
    fake.add_gpu_node("h100-b")
    fake.add_gpu_node("mig-a", product="NVIDIA-A100-SXM4-80GB", mig={"mig-1g.10gb": 7})
    fake.add_gpu_node("sick", ready=False)
    fake.add_gpu_node("cpu-only", gpus=0)
    seen = inventory_from(kube_cluster, adapter_client)
    assert (seen.nodes, seen.gpus, seen.unknown_gpu_types) == (4, 25, ())  # 8 + 8 + 8, one A100 in MIG mode
    heartbeats_on_time()
    states = dict(kube_cluster.nodes.values_list("name", "state"))
    assert states == {"h100-a": "ready", "h100-b": "ready", "mig-a": "ready", "sick": "not_ready"}

    nodes, pods = informers_for(kube_cluster, adapter_client)
    fake.cordon("h100-a")
    fake.patch_node("h100-b", {"spec": {"taints": [{"key": "maintenance", "effect": "NoSchedule"}]}})
    run_pod(fake, "slices", "mig-a", gpus=2, resource="nvidia.com/mig-1g.10gb")
    run_pod(fake, "train", "h100-a", gpus=3)
    run_pod(fake, "ours", "h100-a", namespace="orrery", gpus=2, labels={"orrery.io/attempt-id": "7f0c"})
    settle(lambda: {"research/train", "research/slices", "orrery/ours"} <= set(pods.objects()))
    settle(lambda: nodes.get("h100-b")["spec"].get("taints"))
    inventory_from(kube_cluster, adapter_client)
    rows = {n.name: n for n in kube_cluster.nodes.all()}
    assert (rows["h100-a"].state, rows["h100-a"].state_reason) == (NodeState.CORDONED, "kubernetes: cordoned")
    assert rows["h100-b"].state == NodeState.CORDONED
    assert rows["h100-b"].state_reason == "kubernetes: tainted maintenance:NoSchedule"
    taken = rows["h100-a"].gpus.filter(health=GpuHealth.UNHEALTHY).values_list("index", flat=True)
    assert sorted(taken) == [5, 6, 7]  # the foreign pod's three; Orrery's own pod is not subtracted
    slices = rows["mig-a"].gpus.filter(health=GpuHealth.UNHEALTHY).values_list("index", flat=True)
    assert list(slices) == [0]  # its one GPU in MIG mode: two of its instances are a foreign pod's

    fake.delete_node("h100-b")
    settle(lambda: nodes.get("h100-b") is None)
    inventory_from(kube_cluster, adapter_client)
    lost = kube_cluster.nodes.get(name="h100-b")
    assert (lost.state, lost.state_reason) == (
        NodeState.NOT_READY,
        "kubernetes: node deleted, or no longer offers GPUs",
    )


def test_a_pass_with_nothing_changed_skips_and_a_change_is_taken_at_the_next(
    kube_cluster, fake, adapter_client, inventory_from, django_assert_num_queries
):
    from clusters.adapters.kubernetes.inventory import informers_for, take_inventory

    fake.add_gpu_node("h100-a")
    first = inventory_from(kube_cluster, adapter_client)
    with django_assert_num_queries(0):  # nothing moved: no database work at all
        assert take_inventory(kube_cluster, adapter_client) is first
    nodes, _ = informers_for(kube_cluster, adapter_client)
    before = nodes.changes
    fake.cordon("h100-a")
    settle(lambda: nodes.changes > before)
    inventory_from(kube_cluster, adapter_client)
    assert kube_cluster.nodes.get(name="h100-a").state == "cordoned"


def test_without_the_right_to_read_pods_the_inventory_goes_on(
    kube_cluster, kube, kube_client, inventory_from, caplog
):
    from clusters.adapters.kubernetes.informer import forget_all

    try:
        kube.add_gpu_node("h100-a")
        seen = inventory_from(kube_cluster, kube_client("adapter"))  # the adapter's role alone
        assert (seen.nodes, seen.gpus) == (1, 8)
        assert "pods not listed (HTTP 403 Forbidden); foreign pods are not subtracted" in caplog.text
    finally:
        forget_all()


def test_an_unlisted_cluster_is_an_adapter_error(kube_cluster, kube, kube_client):
    from clusters.adapters.base import AdapterError
    from clusters.adapters.kubernetes.informer import forget_all
    from clusters.adapters.kubernetes.inventory import take_inventory

    try:
        with pytest.raises(AdapterError, match="cannot list nodes: HTTP 403 Forbidden"):
            take_inventory(kube_cluster, kube_client("unbound"), sync_timeout_s=0.5)
    finally:
        forget_all()


def test_a_cluster_that_stops_answering_gets_no_heartbeats_from_the_last_answer(
    kube_cluster, fake, adapter_client, inventory_from, monkeypatch
):
    from clusters.adapters.base import AdapterError
    from clusters.adapters.kubernetes import inventory
    from clusters.adapters.kubernetes.inventory import informers_for, take_inventory

    fake.add_gpu_node("h100-a")
    inventory_from(kube_cluster, adapter_client)
    monkeypatch.setattr(inventory, "STALE_AFTER_S", 0.3)
    monkeypatch.setattr(inventory, "REFRESH_S", 0.0)  # every pass a full one, as after 10 s
    nodes, _ = informers_for(kube_cluster, adapter_client)
    del fake.users[fake.adapter_token]  # the credential revoked…
    fake.store.close_all()  # …and the open watch broken: every reconnection is refused (401)
    settle(lambda: nodes.failing_for() > 0.3)
    with pytest.raises(AdapterError, match="the node watch has failed for"):
        take_inventory(kube_cluster, adapter_client)


@pytest.fixture
def kube_cluster(kube, db):
    from tests.factories import ensure_catalog, make_cluster

    ensure_catalog()
    return make_cluster("kube-fake", kind="kubernetes", config={"namespace": "orrery"})


FLEET = 5000


def test_fleet_of_5000_nodes_stays_current(kube_cluster, fake, adapter_client, inventory_from):
    """5,000 GPU nodes: the first list and pass, then how long a cordon and a NotReady take to
    reach the scheduler's snapshot, polling as the periodic pass would (without its 10 s wait).
    The times are printed (``-s``); the bound asserted is generous on purpose."""
    import time

    from clusters.adapters.kubernetes.inventory import informers_for
    from scheduling.engine.cache import SchedulerCache

    for i in range(FLEET):
        fake.add_gpu_node(f"gpu-{i:05}")
    began = time.perf_counter()
    seen = inventory_from(kube_cluster, adapter_client)
    first_pass = time.perf_counter() - began
    assert (seen.nodes, seen.gpus) == (FLEET, FLEET * 8)
    heartbeats_on_time()
    cache = SchedulerCache()
    snap = cache.ensure()
    rows = [snap.row_of[pk] for pk in kube_cluster.nodes.order_by("name").values_list("pk", flat=True)]
    assert all(snap.ready[r] for r in rows)
    nodes, _ = informers_for(kube_cluster, adapter_client)

    def time_to_see(change, name: str) -> float:
        row = snap.row_of[kube_cluster.nodes.get(name=name).pk]
        start = time.perf_counter()
        change(name)
        while cache.ensure().ready[row]:
            assert time.perf_counter() - start < 30, f"{name}'s change not seen within 30 s"
            inventory_from(kube_cluster, adapter_client)
        return time.perf_counter() - start

    began = time.perf_counter()
    inventory_from(kube_cluster, adapter_client)
    steady_pass = time.perf_counter() - began
    cordon = time_to_see(fake.cordon, "gpu-01234")
    not_ready = time_to_see(lambda n: fake.set_node_ready(n, False), "gpu-04321")
    print(
        f"\nfleet of {FLEET} nodes: first list + pass {first_pass:.1f} s, steady pass {steady_pass:.2f} s, "
        f"cordon seen by the scheduler in {cordon:.2f} s, NotReady in {not_ready:.2f} s "
        f"(informer: {nodes.stats})"
    )
