"""Every plugin by name: the same key in profiles, in this dict and in each plugin's ``name``."""

from __future__ import annotations

from scheduling.plugins.binpack import Binpack
from scheduling.plugins.cluster_affinity import ClusterAffinity
from scheduling.plugins.fair_share import FairShare
from scheduling.plugins.gang import Gang
from scheduling.plugins.gpu_model import GpuModel
from scheduling.plugins.node_state import NodeState
from scheduling.plugins.priority import Priority
from scheduling.plugins.quota import Quota
from scheduling.plugins.resources_fit import ResourcesFit
from scheduling.plugins.selectors import Selectors
from scheduling.plugins.spread import Spread

REGISTRY: dict[str, type] = {
    "node_state": NodeState,
    "gpu_model": GpuModel,
    "resources_fit": ResourcesFit,
    "selectors": Selectors,
    "cluster_affinity": ClusterAffinity,
    "quota": Quota,
    "gang": Gang,
    "priority": Priority,
    "fair_share": FairShare,
    "binpack": Binpack,
    "spread": Spread,
}
assert all(cls.name == key for key, cls in REGISTRY.items())
