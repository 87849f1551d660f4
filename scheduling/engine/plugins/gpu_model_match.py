from __future__ import annotations

import numpy as np

from scheduling.engine.framework import CycleState, JobView
from scheduling.engine.snapshot import Snapshot


class GpuModelMatch:
    """Filter: the node's GPUs are the model the job asks for (any node for CPU-only jobs)."""

    name = "gpu_model"

    def filter(self, state: CycleState, snap: Snapshot, job: JobView, rows: np.ndarray) -> np.ndarray:
        if job.gpus == 0:
            return np.ones(len(rows), dtype=bool)
        return snap.model[rows] == job.model

    def explain(self, job: JobView, snap: Snapshot, refused: int) -> str:
        return f"{refused:,} have no {snap.model_names[job.model]}"
