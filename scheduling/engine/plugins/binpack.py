from __future__ import annotations

import numpy as np

from scheduling.engine.framework import CycleState, JobView
from scheduling.engine.snapshot import Snapshot


class Binpack:
    """Score: prefer the node the job fills most (fewest GPUs — or cpu for CPU-only jobs — left
    free afterwards), keeping whole nodes free for large jobs."""

    name = "binpack"

    def score(self, state: CycleState, snap: Snapshot, job: JobView, rows: np.ndarray) -> np.ndarray:
        if job.slice >= 0:  # MIG instances: the node whose instances of the profile it fills most
            total = np.maximum(snap.mig_total[rows, job.slice], 1)
            left = snap.mig_free[rows, job.slice] - job.gpus
        elif job.shared:  # a fraction: the node whose shareable GPU it fills most
            total = np.maximum(snap.share_cap[rows], 1)
            left = snap.share_free[rows] - snap.share_need(job, rows)
        elif job.gpus:
            total = np.maximum(snap.gpu_total[rows], 1)
            left = snap.gpu_free[rows] - job.gpus
        else:
            total = np.maximum(snap.cpu_free[rows], 1)
            left = snap.cpu_free[rows] - job.cpu
        return 1.0 - left / total
