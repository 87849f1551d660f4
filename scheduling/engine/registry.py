"""Every plugin by name: the same key in profiles, in this dict and in each plugin's ``name``."""

from __future__ import annotations

from scheduling.engine.plugins.binpack import Binpack
from scheduling.engine.plugins.cluster_affinity import ClusterAffinity
from scheduling.engine.plugins.fair_share import FairShare
from scheduling.engine.plugins.gang import Gang
from scheduling.engine.plugins.gpu_model import GpuModel
from scheduling.engine.plugins.node_state import NodeState
from scheduling.engine.plugins.priority import Priority
from scheduling.engine.plugins.quota import Quota
from scheduling.engine.plugins.resources_fit import ResourcesFit
from scheduling.engine.plugins.selectors import Selectors
from scheduling.engine.plugins.spread import Spread

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
