from __future__ import annotations

import numpy as np

from scheduling.engine.framework import CycleState, JobView
from scheduling.engine.snapshot import Snapshot


class ClusterAffinity:
    """Filter: the node is in one of the clusters of ``placement.clusters`` (any when empty)."""

    name = "cluster_affinity"

    def filter(self, state: CycleState, snap: Snapshot, job: JobView, rows: np.ndarray) -> np.ndarray:
        if not job.clusters:
            return np.ones(len(rows), dtype=bool)
        return np.isin(snap.cluster[rows], job.clusters)

    def explain(self, job: JobView, snap: Snapshot, refused: int) -> str:
        return f"{refused:,} are in other clusters"
