"""What a Kubernetes node offers in GPUs, read from its resources and GPU feature discovery's
labels (pure: tested on recorded nodes). Three ways NVIDIA's device plugin hands GPUs out:

* **Whole GPUs**: ``nvidia.com/gpu``, one unit a GPU.
* **MIG instances**: with the *mixed* strategy, ``nvidia.com/mig-<profile>`` per profile (GFD
  adds ``nvidia.com/mig-<profile>.memory``, the instance's MiB); with the *single* strategy
  (``nvidia.com/mig.strategy: single``) every GPU has the same layout, the instances are
  ``nvidia.com/gpu`` and the product label says ``<product>-MIG-<profile>``. Either way Orrery
  sees GPUs of the product's model in MIG mode, holding instances of those profiles, grouped
  into GPUs by ``clusters.adapters.mig.pack`` (the device plugin picks the physical instance;
  Orrery counts them per profile). They come after the whole GPUs, indices counting on.
* **Shared GPUs** (the plugin's time-slicing or MPS: ``nvidia.com/gpu.replicas`` > 1): each GPU
  is advertised as that many replicas of ``nvidia.com/gpu``, or of ``nvidia.com/gpu.shared``
  where the plugin renames them (``renameByDefault``). Orrery counts the GPUs (replicas ÷
  replicas per GPU) and asks for the resource the node advertises. Time-sliced MIG instances
  (``nvidia.com/mig-<profile>.replicas``) are counted the same way.

Counts past what a node can hold (``MAX_GPUS``) are cut there: a node's resources never make
Orrery write more rows than a real node has GPUs.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.utils import parse_quantity

from clusters.adapters.mig import layout_label, pack, parse_profile
from clusters.ingest.records import MAX_GPUS

GPU = "nvidia.com/gpu"
SHARED_GPU = "nvidia.com/gpu.shared"
MIG_PREFIX = "nvidia.com/mig-"
PRODUCT_LABEL = "nvidia.com/gpu.product"
MEMORY_LABEL = "nvidia.com/gpu.memory"
REPLICAS_LABEL = "nvidia.com/gpu.replicas"
MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"
#: The resource a node's whole GPUs are asked for by (``nvidia.com/gpu`` or ``…gpu.shared``).
RESOURCE_LABEL = "orrery.io/gpu-resource"
#: The node's MIG instances in a few words (``1g.10gb:7``): changes whenever the layout does.
MIG_LAYOUT_LABEL = "orrery.io/mig-layout"
MAX_REPLICAS = 1024
_SINGLE_PRODUCT = re.compile(r"^(.+)-MIG-([^-]+)$")


def quantity(value: Any, scale: int = 1) -> int:
    """A Kubernetes quantity (``"222"``, ``"500m"``, ``"2102984852Ki"``) times ``scale``, as an
    int (0 for nothing or nonsense)."""
    if value in (None, ""):
        return 0
    try:
        return max(int(parse_quantity(value) * scale), 0)
    except (ValueError, ArithmeticError, TypeError):
        return 0


@dataclass(frozen=True)
class GpuOffer:
    """What a node offers in one GPU resource: ``capacity`` devices, ``allocatable`` usable
    (GPUs, or MIG instances of ``profile``; a shared resource's replicas already divided by
    ``replicas``, the units one device is advertised as)."""

    resource: str
    type_name: str  # the product as catalog lookup sees it, e.g. "NVIDIA-H100-80GB-HBM3"
    capacity: int
    allocatable: int
    profile: str = ""  # the MIG profile ("1g.10gb"), "" for whole GPUs
    replicas: int = 1


@dataclass(frozen=True)
class NodeGpus:
    """Every GPU a node offers Orrery: ``whole`` GPUs (capacity 0 on a node all in MIG mode),
    then the GPUs in MIG mode (``layout``: each its instances, in the agent-report shape), whose
    instances the ``mig`` offers count per profile. ``memory_mb``: a whole GPU's (GFD), 0 unknown."""

    whole: GpuOffer
    mig: tuple[GpuOffer, ...] = ()
    layout: tuple[tuple[dict[str, Any], ...], ...] = field(default=())
    memory_mb: int = 0

    @property
    def count(self) -> int:
        return self.whole.capacity + len(self.layout)

    @property
    def layout_label(self) -> str:
        return layout_label({o.profile: o.capacity for o in self.mig})


def node_gpus(node: dict[str, Any]) -> NodeGpus | None:
    """Every GPU the node offers (module docstring), or None when it offers none."""
    status = node.get("status") or {}
    capacity, allocatable = status.get("capacity") or {}, status.get("allocatable") or {}
    labels = (node.get("metadata") or {}).get("labels") or {}
    product = str(labels.get(PRODUCT_LABEL) or "") or "NVIDIA GPU"
    single = _single_strategy(labels, product)
    if single is not None:
        product, profile = single
        mig = [_offer(GPU, product, capacity, allocatable, _replicas(labels, REPLICAS_LABEL), profile)]
        memory = {profile: quantity(labels.get(MEMORY_LABEL))}
        whole = GpuOffer(GPU, product, 0, 0)
    else:
        whole = _whole(product, capacity, allocatable, _replicas(labels, REPLICAS_LABEL))
        mig, memory = [], {}
        for resource in sorted(set(capacity) | set(allocatable)):
            found = (
                parse_profile(resource.removeprefix(MIG_PREFIX)) if resource.startswith(MIG_PREFIX) else None
            )
            if found is None:
                continue
            replicas = _replicas(labels, f"{resource}.replicas")
            mig.append(_offer(resource, product, capacity, allocatable, replicas, found.name))
            memory[found.name] = quantity(labels.get(f"{resource}.memory"))
    mig = [o for o in mig if o.capacity > 0]
    gpu_memory = 0 if single else quantity(labels.get(MEMORY_LABEL))  # single: the instance's
    counts = {o.profile: o.capacity for o in mig}
    layout, _ = pack(counts, max_gpus=MAX_GPUS - whole.capacity, memory_mb=memory, gpu_memory_mb=gpu_memory)
    if whole.capacity <= 0 and not layout:
        return None
    return NodeGpus(whole, tuple(mig), tuple(tuple(gpu) for gpu in layout), gpu_memory)


def _single_strategy(labels: Mapping[str, Any], product: str) -> tuple[str, str] | None:
    """``(the GPUs' product, their profile)`` on a node whose GPUs are all in MIG mode under the
    single strategy (``NVIDIA-A100-SXM4-80GB-MIG-1g.10gb``), None otherwise."""
    if labels.get(MIG_STRATEGY_LABEL) != "single":
        return None
    match = _SINGLE_PRODUCT.fullmatch(product)
    profile = parse_profile(match.group(2)) if match else None
    return (match.group(1), profile.name) if match and profile else None


def _whole(
    product: str, capacity: Mapping[str, Any], allocatable: Mapping[str, Any], replicas: int
) -> GpuOffer:
    """Whole GPUs: ``nvidia.com/gpu``, or ``nvidia.com/gpu.shared`` where the plugin renamed a
    time-sliced node's replicas (and advertises no plain GPU)."""
    plain = quantity(capacity.get(GPU)) or quantity(allocatable.get(GPU))
    shared = quantity(capacity.get(SHARED_GPU)) or quantity(allocatable.get(SHARED_GPU))
    resource = SHARED_GPU if shared and not plain else GPU
    return _offer(resource, product, capacity, allocatable, replicas)


def _offer(
    resource: str,
    type_name: str,
    capacity: Mapping[str, Any],
    allocatable: Mapping[str, Any],
    replicas: int,
    profile: str = "",
) -> GpuOffer:
    """One resource, in devices: replicas divided out (the plugin withdraws all of an unhealthy
    device's replicas at once), allocatable never above capacity, both cut at ``MAX_GPUS`` GPUs'
    worth."""
    cap, alloc = quantity(capacity.get(resource)), quantity(allocatable.get(resource))
    alloc = min(alloc, cap) if cap else alloc
    cap = max(cap, alloc)
    most = MAX_GPUS * 7 if profile else MAX_GPUS
    cap, alloc = min(cap // replicas, most), min(alloc // replicas, most)
    return GpuOffer(resource, type_name, cap, alloc, profile, replicas)


def _replicas(labels: Mapping[str, Any], key: str) -> int:
    """Replicas a device is advertised as (GFD's label; 1 without, or for nonsense)."""
    value = labels.get(key)
    if not isinstance(value, str) or not value.isdigit():
        return 1
    return min(max(int(value), 1), MAX_REPLICAS)


def gpu_offer(node: dict[str, Any]) -> GpuOffer | None:
    """The node's whole GPUs, or None when it offers no GPU at all."""
    gpus = node_gpus(node)
    return gpus.whole if gpus is not None else None


def foreign_gpus(offer: GpuOffer, units: int) -> int:
    """GPUs taken by ``units`` of the offer's resource held by pods Orrery did not place: a unit
    a GPU; a replica of a shared GPU may be on any GPU (the plugin spreads them), so each counts
    as one GPU taken, up to the node's."""
    return min(max(units, 0), offer.capacity)


def unavailable_gpus(offer: GpuOffer, foreign: int, held: set[int]) -> dict[int, str]:
    """``{GPU index: why Orrery may not use it}`` among the whole GPUs: the device plugin's
    withdrawn GPUs, then those ``foreign`` pods hold, taken from the highest indices Orrery does
    not hold itself."""
    withdrawn = offer.capacity - offer.allocatable
    free = [i for i in range(offer.capacity - 1, -1, -1) if i not in held]
    out: dict[int, str] = {}
    for n, index in enumerate(free[: withdrawn + max(foreign, 0)]):
        out[index] = (
            "not allocatable (withdrawn by the device plugin)"
            if n < withdrawn
            else "in use by pods Orrery did not place"
        )
    return out


def unavailable_mig_gpus(gpus: NodeGpus, foreign: Mapping[str, int], held: set[int]) -> dict[int, str]:
    """``{GPU index: why}`` among the GPUs in MIG mode: from the highest index Orrery holds
    nothing on, enough of them that the instances they hold cover, for each profile, those the
    device plugin withdrew and those pods Orrery did not place hold (``foreign``: units per
    resource). Health is a GPU's, not an instance's: what such a GPU has left free waits until
    the foreign pod is gone, and nothing taken is ever handed out."""
    start = gpus.whole.capacity
    order = [start + i for i in range(len(gpus.layout) - 1, -1, -1) if start + i not in held]
    withdrawn = {o.profile: o.capacity - o.allocatable for o in gpus.mig}
    need = {o.profile: withdrawn[o.profile] + foreign_gpus(o, foreign.get(o.resource, 0)) for o in gpus.mig}
    out: dict[int, str] = {}
    for index in order:
        here = Counter(instance["profile"] for instance in gpus.layout[index - start])
        if not any(need.get(profile, 0) > 0 for profile in here):
            continue
        out[index] = (
            "not allocatable (withdrawn by the device plugin)"
            if any(withdrawn.get(profile, 0) > 0 for profile in here)
            else "MIG instances in use by pods Orrery did not place"
        )
        for profile, n in here.items():
            need[profile] = need.get(profile, 0) - n
            withdrawn[profile] = withdrawn.get(profile, 0) - n
    return out
