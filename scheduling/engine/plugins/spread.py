from __future__ import annotations

import numpy as np

from scheduling.engine.framework import CycleState, JobView
from scheduling.engine.snapshot import Snapshot


class Spread:
    """Score: prefer the emptiest node (the opposite of binpack), to spread load and heat."""

    name = "spread"

    def score(self, state: CycleState, snap: Snapshot, job: JobView, rows: np.ndarray) -> np.ndarray:
        if job.gpus:
            return snap.gpu_free[rows] / np.maximum(snap.gpu_total[rows], 1)
        return snap.cpu_free[rows] / np.maximum(snap.cpu_free.max(initial=1), 1)
