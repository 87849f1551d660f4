from __future__ import annotations

import numpy as np

from scheduling.engine.framework import CycleState, JobView
from scheduling.engine.snapshot import Snapshot


class ResourcesFit:
    """Filter: enough free healthy GPUs, cpu and memory on the node for one of the job's tasks."""

    name = "resources_fit"
    capacity = True

    def filter(self, state: CycleState, snap: Snapshot, job: JobView, rows: np.ndarray) -> np.ndarray:
        ok = (snap.cpu_free[rows] >= job.cpu) & (snap.mem_free[rows] >= job.memory)
        return ok & (snap.gpu_free[rows] >= job.gpus) if job.gpus else ok

    def explain(self, job: JobView, snap: Snapshot, refused: int) -> str:
        if job.gpus:
            return f"{refused:,} lack {job.gpus} free {snap.model_names[job.model]}"
        return f"{refused:,} lack free cpu or memory"
