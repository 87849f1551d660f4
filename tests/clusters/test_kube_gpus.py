"""What a Kubernetes node offers in GPUs (``clusters/adapters/kubernetes/gpus.py``): whole GPUs,
MIG instances (mixed and single strategies), time-sliced or MPS replicas, read from nodes recorded
from a real kube-apiserver (``tests/kubefake/recordings``: 011 an H100 node, 012 an A100 in MIG
mode) with their resources and GFD labels changed as the device plugin would change them."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from clusters.adapters.kubernetes.gpus import (
    GPU,
    SHARED_GPU,
    GpuOffer,
    NodeGpus,
    node_gpus,
    unavailable_mig_gpus,
)

RECORDINGS = Path(__file__).resolve().parents[1] / "kubefake" / "recordings"


def recorded(name: str) -> dict[str, Any]:
    data = json.loads(next(RECORDINGS.glob(f"{name}-*.json")).read_text())
    exchanges = data.get("exchanges") or [data]
    return copy.deepcopy(exchanges[-1]["response"]["body"])


def node(name: str = "011", *, resources: dict[str, str] | None = None, labels: dict[str, str] | None = None):
    """A recorded node with some resources (capacity and allocatable alike) and labels changed;
    a value of None removes it."""
    body = recorded(name)
    for key in ("capacity", "allocatable"):
        for resource, value in (resources or {}).items():
            if value is None:
                body["status"][key].pop(resource, None)
            else:
                body["status"][key][resource] = value
    for label, value in (labels or {}).items():
        if value is None:
            body["metadata"]["labels"].pop(label, None)
        else:
            body["metadata"]["labels"][label] = value
    return body


def shapes(gpus: NodeGpus) -> list[list[str]]:
    return [[i["profile"] for i in gpu] for gpu in gpus.layout]


H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"
MIG_1G = "nvidia.com/mig-1g.10gb"


@pytest.mark.parametrize(
    ("body", "whole", "mig", "layout"),
    [
        (node(), GpuOffer(GPU, H100, 8, 8), (), []),
        (
            node("012"),
            GpuOffer(GPU, A100, 0, 0),
            (GpuOffer(MIG_1G, A100, 7, 7, "1g.10gb"),),
            [["1g.10gb"] * 7],
        ),
        (
            node("012", resources={GPU: "4", "nvidia.com/mig-3g.40gb": "8"}),
            GpuOffer(GPU, A100, 4, 4),
            (
                GpuOffer(MIG_1G, A100, 7, 7, "1g.10gb"),
                GpuOffer("nvidia.com/mig-3g.40gb", A100, 8, 8, "3g.40gb"),
            ),
            [["3g.40gb"] * 2] * 4 + [["1g.10gb"] * 7],  # two 3g.40gb spend an A100's memory
        ),
        (
            node(
                resources={GPU: "56"},
                labels={
                    "nvidia.com/mig.strategy": "single",
                    "nvidia.com/gpu.product": f"{A100}-MIG-1g.10gb",
                    "nvidia.com/gpu.memory": "9728",
                },
            ),
            GpuOffer(GPU, A100, 0, 0),
            (GpuOffer(GPU, A100, 56, 56, "1g.10gb"),),
            [["1g.10gb"] * 7] * 8,
        ),
        (
            node(
                resources={GPU: "32"},
                labels={
                    "nvidia.com/gpu.replicas": "4",
                    "nvidia.com/gpu.sharing-strategy": "time-slicing",
                    "nvidia.com/gpu.product": f"{H100}-SHARED",
                },
            ),
            GpuOffer(GPU, f"{H100}-SHARED", 8, 8, replicas=4),
            (),
            [],
        ),
        (
            node(resources={GPU: None, SHARED_GPU: "32"}, labels={"nvidia.com/gpu.replicas": "4"}),
            GpuOffer(SHARED_GPU, H100, 8, 8, replicas=4),
            (),
            [],
        ),
        (
            node("012", resources={MIG_1G: "14"}, labels={"nvidia.com/mig-1g.10gb.replicas": "2"}),
            GpuOffer(GPU, A100, 0, 0),
            (GpuOffer(MIG_1G, A100, 7, 7, "1g.10gb", replicas=2),),
            [["1g.10gb"] * 7],
        ),
        (
            node(resources={GPU: "1000000"}, labels={"nvidia.com/gpu.replicas": "0"}),
            GpuOffer(GPU, H100, 64, 64),
            (),
            [],
        ),
        (
            node("012", resources={GPU: "64", MIG_1G: "99999", "nvidia.com/mig-bogus": "3"}),
            GpuOffer(GPU, A100, 64, 64),
            (GpuOffer(MIG_1G, A100, 448, 448, "1g.10gb"),),
            [],
        ),
        (
            node(
                resources={GPU: "32"},
                labels={"nvidia.com/gpu.replicas": "lots", "nvidia.com/gpu.product": None},
            ),
            GpuOffer(GPU, "NVIDIA GPU", 32, 32),
            (),
            [],
        ),
    ],
    ids=[
        "whole-gpus",
        "all-in-mig-mode",
        "whole-and-mig",
        "single-strategy",
        "time-sliced",
        "time-sliced-renamed",
        "time-sliced-mig",
        "a-million-gpus-cut-and-zero-replicas-is-one",
        "no-room-left-for-instances",
        "nonsense-replicas-and-no-product",
    ],
)
def test_what_a_node_offers(body, whole, mig, layout):
    gpus = node_gpus(body)
    assert gpus is not None
    assert (gpus.whole, gpus.mig, shapes(gpus)) == (whole, mig, layout)
    assert gpus.count <= 64


@pytest.mark.parametrize(
    "resources",
    [{GPU: "0"}, {GPU: None}, {GPU: "0", "nvidia.com/mig-bogus": "7"}, {GPU: "nonsense"}],
    ids=["zero", "none", "not-a-profile", "nonsense"],
)
def test_a_node_without_gpus_offers_none(resources):
    assert node_gpus(node(resources=resources)) is None


def mixed(allocatable: dict[str, str] | None = None) -> NodeGpus:
    body = node("012", resources={GPU: "1", MIG_1G: "14", "nvidia.com/mig-3g.40gb": "2"})
    body["status"]["allocatable"].update(allocatable or {})
    gpus = node_gpus(body)
    assert gpus is not None
    # whole GPU 0; then 3g.40gb ×2 on GPU 1, 1g.10gb ×7 on GPUs 2 and 3
    assert shapes(gpus) == [["3g.40gb", "3g.40gb"], ["1g.10gb"] * 7, ["1g.10gb"] * 7]
    return gpus


WITHDRAWN = "not allocatable (withdrawn by the device plugin)"
FOREIGN = "MIG instances in use by pods Orrery did not place"


@pytest.mark.parametrize(
    ("gpus", "foreign", "held", "expected"),
    [
        (mixed(), {}, set(), {}),
        (mixed(), {MIG_1G: 1}, set(), {3: FOREIGN}),
        (mixed(), {MIG_1G: 8}, set(), {3: FOREIGN, 2: FOREIGN}),
        (mixed(), {MIG_1G: 7}, {3}, {2: FOREIGN}),
        (mixed(), {"nvidia.com/mig-3g.40gb": 1}, set(), {1: FOREIGN}),
        (mixed({MIG_1G: "13"}), {MIG_1G: 7}, set(), {3: WITHDRAWN, 2: FOREIGN}),
        (mixed(), {MIG_1G: 10**6}, set(), {3: FOREIGN, 2: FOREIGN}),
        (mixed(), {MIG_1G: 3}, {1, 2, 3}, {}),
        (mixed(), {GPU: 1}, set(), {}),
    ],
    ids=[
        "nothing",
        "one-instance-takes-its-gpu",
        "enough-gpus-to-cover",
        "never-a-gpu-orrery-holds",
        "by-profile",
        "withdrawn-first",
        "never-more-than-there-are",
        "all-held-nothing-to-take",
        "whole-gpus-are-not-mig",
    ],
)
def test_unavailable_mig_instances_take_their_gpus(gpus, foreign, held, expected):
    assert unavailable_mig_gpus(gpus, foreign, held) == expected
