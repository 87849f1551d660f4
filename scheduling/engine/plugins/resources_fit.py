from __future__ import annotations

import numpy as np

from scheduling.engine.framework import CycleState, JobView
from scheduling.engine.snapshot import Snapshot


class ResourcesFit:
    """Filter: enough free cpu and memory on the node for one of the job's tasks, and enough of
    what it takes of GPUs: free healthy whole GPUs, free MIG instances of its profile, or one
    shareable GPU with its fraction of memory free — not handed out, and not in use by the
    telemetry (shared GPUs are placed by what is used as well as by what is allocated)."""

    name = "resources_fit"
    capacity = True

    def filter(self, state: CycleState, snap: Snapshot, job: JobView, rows: np.ndarray) -> np.ndarray:
        ok = (snap.cpu_free[rows] >= job.cpu) & (snap.mem_free[rows] >= job.memory)
        if not job.gpus:
            return ok
        if job.slice >= 0:
            return ok & (snap.mig_free[rows, job.slice] >= job.gpus)
        if job.fractional and not job.shared:  # a MIG profile no GPU of the fleet has
            return np.zeros(len(rows), dtype=bool)
        if job.shared:
            return ok & (snap.share_free[rows] >= snap.share_need(job, rows))
        return ok & (snap.gpu_free[rows] >= job.gpus)

    def explain(self, job: JobView, snap: Snapshot, refused: int) -> str:
        if not job.gpus:
            return f"{refused:,} lack free cpu or memory"
        model = snap.model_names[job.model]
        if job.slice >= 0:
            return f"{refused:,} lack {job.gpus} free {model} MIG {snap.mig_profiles[job.slice]}"
        if job.fractional and not job.shared:
            return f"{refused:,} have no GPU in MIG mode with that profile"
        if job.shared:
            wanted = f"{job.share_mb / 1024:.3g} GiB" if job.share_mb else f"{job.share_milli / 10:g}%"
            return f"{refused:,} lack a shareable {model} with {wanted} free"
        return f"{refused:,} lack {job.gpus} free {model}"
