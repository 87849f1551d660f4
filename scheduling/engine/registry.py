"""Every plugin by name: the same key in profiles, in this dict and in each plugin's ``name``.

Keys are operator configuration and never change. Three plugins are named differently from
their key so that their classes do not read as the model or choice of the same name:
``node_state`` is ``NodeReady``, ``gpu_model`` is ``GpuModelMatch`` and ``selectors`` is
``NodeSelector``.
"""

from __future__ import annotations

from scheduling.engine.plugins.array_throttle import ArrayThrottle
from scheduling.engine.plugins.backfill import Backfill
from scheduling.engine.plugins.binpack import Binpack
from scheduling.engine.plugins.cluster_affinity import ClusterAffinity
from scheduling.engine.plugins.energy import Energy
from scheduling.engine.plugins.fair_share import FairShare
from scheduling.engine.plugins.gang import Gang
from scheduling.engine.plugins.gpu_model_match import GpuModelMatch
from scheduling.engine.plugins.load_aware import LoadAware
from scheduling.engine.plugins.node_ready import NodeReady
from scheduling.engine.plugins.node_selector import NodeSelector
from scheduling.engine.plugins.preemption import Preemption
from scheduling.engine.plugins.priority import Priority
from scheduling.engine.plugins.quota import Quota
from scheduling.engine.plugins.resources_fit import ResourcesFit
from scheduling.engine.plugins.spread import Spread
from scheduling.engine.plugins.user_limits import UserLimits

REGISTRY: dict[str, type] = {
    "node_state": NodeReady,
    "gpu_model": GpuModelMatch,
    "resources_fit": ResourcesFit,
    "selectors": NodeSelector,
    "cluster_affinity": ClusterAffinity,
    "quota": Quota,
    "user_limits": UserLimits,
    "array_throttle": ArrayThrottle,
    "gang": Gang,
    "priority": Priority,
    "fair_share": FairShare,
    "binpack": Binpack,
    "spread": Spread,
    "load_aware": LoadAware,
    "energy": Energy,
    "backfill": Backfill,
    "preemption": Preemption,
}
assert all(cls.name == key for key, cls in REGISTRY.items())
