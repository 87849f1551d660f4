"""MIG on the server's side: instances read from a node's description (hostile ones refused with
the path of the bad field), the rows kept in line slot by slot — never under an instance an
allocation holds —, the layouts operators want told to the node in its heartbeat's answer, and
what a desired entry says of MIG instances and shared GPUs."""

from __future__ import annotations

import copy
import uuid
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from clusters.choices import NodeState
from clusters.models import GpuDevice, MigInstance, Node, NodeEvent
from clusters.services.credentials import (
    create_join_token,
    forget_cached_identities,
    issue_cluster_credential,
)
from clusters.services.mig import want_mig_layout
from scheduling.dispatch.agent import desired_for_node
from scheduling.dispatch.desired import forget_desired
from scheduling.models import Allocation, JobAttempt
from scheduling.services.allocations import NodePlacement, bind_job
from tests.clusters.test_agent_api import post, report
from tests.factories import make_cluster, make_job

pytestmark = pytest.mark.django_db
A100 = "NVIDIA A100-SXM4-80GB"
SIZES = {"1g.10gb": 9728, "2g.20gb": 19968, "3g.40gb": 40192, "4g.40gb": 40192, "7g.80gb": 80896}


def instances(node: str, index: int, profiles: list[str]) -> list[dict[str, Any]]:
    """A GPU's instances as an agent reports them; the UUID follows the slot and profile, as
    real instances get new UUIDs when the layout changes."""
    return [
        {
            "slot": slot,
            "profile": profile,
            "uuid": f"MIG-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}.{index}.{slot}.{profile}')}",
            "memory_mb": SIZES[profile],
            "slices": int(profile[0]),
        }
        for slot, profile in enumerate(profiles)
    ]


def described(name: str = "gpu-001", **layouts: list[str] | None) -> dict[str, Any]:
    """Two A100s; ``gpu0=[...]`` / ``gpu1=[...]`` put one in MIG mode with that layout."""
    gpus = []
    for i in range(2):
        gpu = {"index": i, "model": A100, "uuid": f"GPU-{name}-{i}", "memory_total_mb": 81920}
        if (layout := layouts.get(f"gpu{i}")) is not None:
            gpu["mig"] = instances(name, i, layout)
        gpus.append(gpu)
    return {"name": name, "cpu_millicores": 64_000, "memory_bytes": 2**39, "boot_id": "boot-1", "gpus": gpus}


@pytest.fixture
def cluster():
    return make_cluster("rack-a", kind="native")


@pytest.fixture
def node(client, cluster):
    """gpu-001, registered with GPU 0 in MIG mode (two 1g.10gb and a 3g.40gb)."""
    _, join = create_join_token(cluster)
    answer = post(client, "register", described(gpu0=["1g.10gb", "1g.10gb", "3g.40gb"]), join)
    assert answer.status_code == 201, answer.content
    return answer.json() | {"pk": answer.json()["nodeId"]}


def layout_of(node_id: int, index: int) -> list[tuple[int, str]]:
    return list(
        MigInstance.objects.filter(gpu__node_id=node_id, gpu__index=index).values_list("slot", "profile")
    )


def describe(client, node: dict, body: dict, captured) -> Any:
    with captured(execute=True):  # the heartbeat answer's cache is dropped once the change commits
        return post(client, "describe", body, node["credential"])


# --- what a node reports --------------------------------------------------------------------------


def test_registration_records_the_mig_instances(node):
    gpus = {g.index: g for g in GpuDevice.objects.filter(node_id=node["pk"])}
    assert gpus[0].mig_enabled and not gpus[1].mig_enabled
    rows = list(
        MigInstance.objects.filter(gpu=gpus[0]).values_list("slot", "profile", "uuid", "memory_mb", "slices")
    )
    expected = instances("gpu-001", 0, ["1g.10gb", "1g.10gb", "3g.40gb"])
    assert rows == [(m["slot"], m["profile"], m["uuid"], m["memory_mb"], m["slices"]) for m in expected]
    assert NodeEvent.objects.filter(node_id=node["pk"], reason="GPU 0 MIG 1g.10gb,1g.10gb,3g.40gb").exists()


def _set(path: list[Any], value: Any) -> Any:
    def change(body: dict) -> None:
        target = body
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


def _profiles(*profiles: str) -> Any:
    return _set(["gpus", 0, "mig"], instances("gpu-001", 0, list(profiles)))


def _twice_on_the_node(body: dict) -> None:
    body["gpus"][1]["mig"] = copy.deepcopy(body["gpus"][0]["mig"][:1])


HOSTILE = [
    ("not-a-list", _set(["gpus", 0, "mig"], {"slot": 0}), "gpus[0].mig"),
    ("nine-instances", _profiles(*["1g.10gb"] * 9), "gpus[0].mig"),
    ("too-many-slices", _profiles("7g.80gb", "2g.20gb"), "gpus[0].mig"),
    ("not-an-object", _set(["gpus", 0, "mig", 1], "1g.10gb"), "gpus[0].mig[1]"),
    ("slot-too-high", _set(["gpus", 0, "mig", 1, "slot"], 8), "gpus[0].mig[1].slot"),
    ("slot-negative", _set(["gpus", 0, "mig", 1, "slot"], -1), "gpus[0].mig[1].slot"),
    ("slot-bool", _set(["gpus", 0, "mig", 1, "slot"], True), "gpus[0].mig[1].slot"),
    ("slot-twice", _set(["gpus", 0, "mig", 1, "slot"], 0), "gpus[0].mig[1].slot"),
    ("profile-injected", _set(["gpus", 0, "mig", 0, "profile"], "1g.10gb; reboot"), "gpus[0].mig[0].profile"),
    ("profile-missing", _set(["gpus", 0, "mig", 0, "profile"], None), "gpus[0].mig[0].profile"),
    (
        "profile-huge",
        _set(["gpus", 0, "mig", 0, "profile"], "1g." + "9" * 10_000 + "gb"),
        "gpus[0].mig[0].profile",
    ),
    ("uuid-nul", _set(["gpus", 0, "mig", 0, "uuid"], "MIG-\x00abc"), "gpus[0].mig[0].uuid"),
    ("uuid-long", _set(["gpus", 0, "mig", 0, "uuid"], "MIG-" + "a" * 61), "gpus[0].mig[0].uuid"),
    ("uuid-not-mig", _set(["gpus", 0, "mig", 0, "uuid"], "GPU-1234"), "gpus[0].mig[0].uuid"),
    ("uuid-comma", _set(["gpus", 0, "mig", 0, "uuid"], "MIG-a,MIG-b"), "gpus[0].mig[0].uuid"),
    ("uuid-missing", _set(["gpus", 0, "mig", 0, "uuid"], None), "gpus[0].mig[0].uuid"),
    ("uuid-twice-on-node", _twice_on_the_node, "gpus[1].mig[0].uuid"),
    ("memory-huge", _set(["gpus", 0, "mig", 0, "memory_mb"], 10**12), "gpus[0].mig[0].memory_mb"),
    ("memory-text", _set(["gpus", 0, "mig", 0, "memory_mb"], "10gb"), "gpus[0].mig[0].memory_mb"),
    ("memory-float", _set(["gpus", 0, "mig", 0, "memory_mb"], 9728.5), "gpus[0].mig[0].memory_mb"),
    ("slices-not-its-profile", _set(["gpus", 0, "mig", 2, "slices"], 1), "gpus[0].mig[2].slices"),
    ("slices-zero", _set(["gpus", 0, "mig", 0, "slices"], 0), "gpus[0].mig[0].slices"),
    ("slices-huge", _set(["gpus", 0, "mig", 0, "slices"], 2**40), "gpus[0].mig[0].slices"),
]


@pytest.mark.parametrize(
    ("change", "path"), [case[1:] for case in HOSTILE], ids=[case[0] for case in HOSTILE]
)
def test_a_hostile_mig_list_is_400_with_its_path_and_nothing_is_stored(client, cluster, change, path):
    body = described(gpu0=["1g.10gb", "1g.10gb", "3g.40gb"])
    change(body)
    _, join = create_join_token(cluster)
    answer = post(client, "register", body, join)
    assert answer.status_code == 400, answer.content
    assert answer.json()["errors"][0]["path"] == path
    assert not Node.objects.exists() and not MigInstance.objects.exists()


def test_a_collector_declaring_mig_nodes_is_checked_alike(client, cluster):
    _, secret = issue_cluster_credential(cluster)
    nodes = [described("c-1"), described("c-2", gpu1=["3g.40gb"])]
    nodes[1]["gpus"][1]["mig"][0]["slot"] = 99
    answer = post(client, "nodes", {"cluster": "rack-a", "nodes": nodes}, secret)
    assert answer.status_code == 400 and answer.json()["errors"][0]["path"] == "nodes[1].gpus[1].mig[0].slot"


# --- keeping the rows in line ---------------------------------------------------------------------


def test_a_new_layout_replaces_the_instances_slot_by_slot(client, node, django_capture_on_commit_callbacks):
    before = dict(MigInstance.objects.filter(gpu__node_id=node["pk"]).values_list("slot", "pk"))
    answer = describe(
        client,
        node,
        described(gpu0=["1g.10gb", "3g.40gb"], gpu1=["7g.80gb"]),
        django_capture_on_commit_callbacks,
    )
    assert answer.status_code == 200, answer.content
    assert layout_of(node["pk"], 0) == [(0, "1g.10gb"), (1, "3g.40gb")]
    assert layout_of(node["pk"], 1) == [(0, "7g.80gb")]
    after = dict(MigInstance.objects.filter(gpu__node_id=node["pk"], gpu__index=0).values_list("slot", "pk"))
    assert after[0] == before[0]  # the same instance (slot, profile and UUID): the same row
    assert after[1] != before[1]
    assert GpuDevice.objects.get(node_id=node["pk"], index=1).mig_enabled
    assert NodeEvent.objects.filter(
        node_id=node["pk"], reason="GPU 0 MIG 1g.10gb,3g.40gb; GPU 1 MIG 7g.80gb"
    ).exists()


def test_describing_the_same_layout_again_changes_nothing(client, node, django_capture_on_commit_callbacks):
    rows = list(MigInstance.objects.values_list("pk", "slot", "profile", "uuid"))
    events = NodeEvent.objects.count()
    describe(
        client, node, described(gpu0=["1g.10gb", "1g.10gb", "3g.40gb"]), django_capture_on_commit_callbacks
    )
    assert list(MigInstance.objects.values_list("pk", "slot", "profile", "uuid")) == rows
    assert NodeEvent.objects.count() == events


def test_new_sizes_of_the_same_instance_are_updated_in_place(
    client, node, django_capture_on_commit_callbacks
):
    body = described(gpu0=["1g.10gb", "1g.10gb", "3g.40gb"])
    body["gpus"][0]["mig"][2]["memory_mb"] = 40000
    pk = MigInstance.objects.get(slot=2).pk
    describe(client, node, body, django_capture_on_commit_callbacks)
    assert MigInstance.objects.get(slot=2).memory_mb == 40000 and MigInstance.objects.get(slot=2).pk == pk


def test_mig_turned_off_deletes_the_instances(client, node, django_capture_on_commit_callbacks):
    describe(client, node, described(), django_capture_on_commit_callbacks)
    assert not MigInstance.objects.exists()
    assert not GpuDevice.objects.filter(mig_enabled=True).exists()
    assert NodeEvent.objects.filter(node_id=node["pk"], reason="GPU 0 MIG off").exists()


def test_mig_on_without_instances_is_mig_on(client, node, django_capture_on_commit_callbacks):
    describe(client, node, described(gpu0=[], gpu1=[]), django_capture_on_commit_callbacks)
    assert not MigInstance.objects.exists() and GpuDevice.objects.filter(mig_enabled=True).count() == 2


@pytest.fixture
def held(node, alice, queue):
    """An active allocation of alice's job on gpu-001's instance in slot 2 (the 3g.40gb)."""
    Node.objects.filter(pk=node["pk"]).update(state=NodeState.READY)
    job = make_job(alice, queue, gpus=1, model="a100", gpu_slice="3g.40gb")
    attempt = bind_job(job, [NodePlacement(Node.objects.get(pk=node["pk"]), [0])])
    instance = MigInstance.objects.get(gpu__node_id=node["pk"], slot=2)
    Allocation.objects.filter(attempt=attempt, gpu__isnull=False).update(mig_instance=instance)
    return instance


def test_an_instance_an_allocation_holds_is_never_changed(
    client, node, held, django_capture_on_commit_callbacks
):
    describe(client, node, described(gpu0=["7g.80gb"]), django_capture_on_commit_callbacks)
    kept = MigInstance.objects.get(pk=held.pk)
    assert (kept.slot, kept.profile, kept.uuid) == (2, "3g.40gb", held.uuid)
    assert layout_of(node["pk"], 0) == [(0, "7g.80gb"), (2, "3g.40gb")]
    describe(client, node, described(), django_capture_on_commit_callbacks)  # MIG off, under a held instance
    assert layout_of(node["pk"], 0) == [(2, "3g.40gb")]
    assert GpuDevice.objects.get(node_id=node["pk"], index=0).mig_enabled  # until it is released


def test_a_released_instance_goes_and_its_history_keeps_the_gpu(
    client, node, held, django_capture_on_commit_callbacks
):
    allocation = Allocation.objects.get(mig_instance=held)
    Allocation.objects.filter(pk=allocation.pk).update(active=False, released_at=timezone.now())
    describe(client, node, described(gpu0=["7g.80gb"]), django_capture_on_commit_callbacks)
    assert layout_of(node["pk"], 0) == [(0, "7g.80gb")]
    allocation.refresh_from_db()
    assert allocation.mig_instance_id is None and allocation.gpu.index == 0


def test_an_instance_of_another_node_is_left_out_not_a_500(client, cluster, node):
    body = described("gpu-002", gpu1=["1g.10gb", "1g.10gb"])
    body["gpus"][1]["mig"][0]["uuid"] = MigInstance.objects.get(slot=0).uuid  # gpu-001's
    _, join = create_join_token(cluster)
    answer = post(client, "register", body, join)
    assert answer.status_code == 201, answer.content
    assert layout_of(answer.json()["nodeId"], 1) == [(1, "1g.10gb")]


def test_a_node_of_plain_gpus_reads_no_mig_rows(cluster):
    from clusters.api.agent import parse_node_description
    from clusters.services.credentials import upsert_node

    upsert_node(cluster, parse_node_description(described("plain")))
    with CaptureQueriesContext(connection) as done:
        upsert_node(cluster, parse_node_description(described("plain")))
    assert done.captured_queries and not [q for q in done.captured_queries if "miginstance" in q["sql"]]


# --- describing itself ------------------------------------------------------------------------------


def test_a_node_describes_only_itself_with_its_own_credential(client, cluster, node):
    body = described("gpu-002", gpu0=["7g.80gb"])
    assert post(client, "describe", body, node["credential"]).status_code == 403
    assert post(client, "describe", body, "orn_" + "x" * 43).status_code == 401
    _, collector = issue_cluster_credential(cluster)
    assert post(client, "describe", described(gpu0=["7g.80gb"]), collector).status_code == 401
    assert not Node.objects.filter(name="gpu-002").exists()
    assert layout_of(node["pk"], 0) == [(0, "1g.10gb"), (1, "1g.10gb"), (2, "3g.40gb")]


def test_describing_itself_leaves_the_node_ready(client, node, django_capture_on_commit_callbacks):
    Node.objects.filter(pk=node["pk"]).update(state=NodeState.READY)
    describe(client, node, described(gpu0=["7g.80gb"]), django_capture_on_commit_callbacks)
    assert Node.objects.get(pk=node["pk"]).state == NodeState.READY


def test_a_description_keeps_what_operators_set_on_a_gpu(client, node, django_capture_on_commit_callbacks):
    GpuDevice.objects.filter(node_id=node["pk"], index=1).update(
        shareable=True, mig_layout_wanted=["7g.80gb"]
    )
    describe(client, node, described(gpu0=["7g.80gb"]), django_capture_on_commit_callbacks)
    gpu = GpuDevice.objects.get(node_id=node["pk"], index=1)
    assert gpu.shareable and gpu.mig_layout_wanted == ["7g.80gb"]


# --- the layouts operators want ----------------------------------------------------------------------


def heartbeat(client, node: dict, seq: int) -> dict:
    answer = post(client, "heartbeat", report(seq=seq), node["credential"])
    assert answer.status_code == 200, answer.content
    return answer.json()


def gpu(node: dict, index: int) -> GpuDevice:
    return GpuDevice.objects.get(node_id=node["pk"], index=index)


def test_a_wanted_layout_is_told_until_the_node_has_it(
    client, node, django_assert_max_num_queries, django_capture_on_commit_callbacks
):
    assert "mig_layouts" not in heartbeat(client, node, 1)
    with django_capture_on_commit_callbacks(execute=True):
        want_mig_layout(gpu(node, 0), ["3g.40gb", "3g.40gb"])
        want_mig_layout(gpu(node, 1), ["7g.80gb"])
    forget_cached_identities()  # as after CACHE_TTL_S: the node's identity is read again
    with django_assert_max_num_queries(3):  # identity, desired, the layouts: then all cached
        answer = heartbeat(client, node, 2)
    assert answer["mig_layouts"] == [
        {"gpu": 0, "profiles": ["3g.40gb", "3g.40gb"]},
        {"gpu": 1, "profiles": ["7g.80gb"]},
    ]
    with django_assert_max_num_queries(0):
        heartbeat(client, node, 3)
    describe(client, node, described(gpu0=["3g.40gb", "3g.40gb"]), django_capture_on_commit_callbacks)
    assert heartbeat(client, node, 4)["mig_layouts"] == [{"gpu": 1, "profiles": ["7g.80gb"]}]
    describe(
        client,
        node,
        described(gpu0=["3g.40gb", "3g.40gb"], gpu1=["7g.80gb"]),
        django_capture_on_commit_callbacks,
    )
    assert "mig_layouts" not in heartbeat(client, node, 5)


@pytest.mark.parametrize(
    ("index", "wanted", "told"),
    [
        (0, ["3g.40gb", "1g.10gb", "1g.10gb"], False),  # the same instances, in another order
        (0, ["1g.10gb", "1g.10gb"], True),
        (0, [], True),  # MIG off
        (1, [], False),  # off already
        (1, ["1g.10gb"], True),
    ],
    ids=["same-in-another-order", "fewer", "turn-off", "off-already", "turn-on"],
)
def test_a_layout_is_told_only_where_it_differs(
    client, node, index, wanted, told, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        want_mig_layout(gpu(node, index), wanted)
    forget_cached_identities()
    answer = heartbeat(client, node, 1)
    assert answer.get("mig_layouts") == ([{"gpu": index, "profiles": wanted}] if told else None)


def test_a_wish_written_around_the_service_that_is_no_layout_is_not_sent(client, node):
    GpuDevice.objects.filter(node_id=node["pk"], index=1).update(mig_layout_wanted=["9g.1gb", "x; reboot"])
    forget_cached_identities()
    assert "mig_layouts" not in heartbeat(client, node, 1)


@pytest.mark.parametrize(
    "layout", [["1g.10gb"] * 9, ["7g.80gb", "1g.10gb", "1g.10gb"], ["1g.10gb; reboot"], "7g.80gb"]
)
def test_an_operator_cannot_want_a_layout_that_cannot_be(node, layout):
    with pytest.raises(ValidationError):
        want_mig_layout(gpu(node, 0), layout)
    assert gpu(node, 0).mig_layout_wanted is None


def test_an_operator_can_leave_the_layout_be_again(node):
    want_mig_layout(gpu(node, 0), ["7g.80gb"])
    want_mig_layout(gpu(node, 0), None)
    assert gpu(node, 0).mig_layout_wanted is None


# --- what a desired entry says of a share -------------------------------------------------------------


@pytest.fixture
def placed(node, alice, queue):
    Node.objects.filter(pk=node["pk"]).update(state=NodeState.READY)
    job = make_job(alice, queue, gpus=1, model="a100")
    attempt = bind_job(job, [NodePlacement(Node.objects.get(pk=node["pk"]), [0])])
    return Allocation.objects.filter(attempt=attempt, gpu__isnull=False)


def test_a_desired_entry_names_its_mig_instance(node, held):
    forget_desired([node["pk"]])
    (entry,) = desired_for_node(node["pk"])
    assert (entry["gpus"], entry["mig_profile"], entry["mig_uuids"]) == ([0], "3g.40gb", [held.uuid])
    assert "gpu_memory_mb" not in entry


def test_a_desired_entry_names_its_fraction_of_a_shared_gpu(node, placed):
    placed.update(gpu_memory_mb=20480)
    forget_desired([node["pk"]])
    (entry,) = desired_for_node(node["pk"])
    assert (entry["gpus"], entry["gpu_memory_mb"], entry["gpu_share"]) == ([0], 20480, 0.25)
    assert "mig_uuids" not in entry


def test_a_desired_entry_of_whole_gpus_says_nothing_more(node, placed):
    forget_desired([node["pk"]])
    (entry,) = desired_for_node(node["pk"])
    assert entry["gpus"] == [0] and not {"mig_uuids", "mig_profile", "gpu_memory_mb", "gpu_share"} & set(
        entry
    )
    assert JobAttempt.objects.filter(pk=entry["attempt"], active=True).exists()
