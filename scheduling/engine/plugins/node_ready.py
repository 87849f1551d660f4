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
        return ok & (snap.gpu_total[rows] > 0) if job.gpus else ok

    def explain(self, job: JobView, snap: Snapshot, refused: int) -> str:
        return f"{refused:,} not ready"
