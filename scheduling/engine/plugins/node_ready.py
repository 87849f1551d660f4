from __future__ import annotations

import numpy as np

from scheduling.engine.framework import CycleState, JobView
from scheduling.engine.snapshot import Snapshot


class NodeReady:
    """Filter: the node is ready (not cordoned, draining, lost) in a cluster that takes work,
    and — for GPU jobs — has healthy GPUs at all."""

    name = "node_state"

    def filter(self, state: CycleState, snap: Snapshot, job: JobView, rows: np.ndarray) -> np.ndarray:
        ok = snap.ready[rows]
        if not job.gpus:
            return ok
        # A node whose GPUs are all in MIG mode has no whole GPU, and is ready for MIG jobs.
        healthy = snap.gpu_total[rows] + (snap.mig_total[rows].sum(axis=1) if job.slice >= 0 else 0)
        return ok & (healthy > 0)

    def explain(self, job: JobView, snap: Snapshot, refused: int) -> str:
        return f"{refused:,} not ready"
