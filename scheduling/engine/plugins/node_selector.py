from __future__ import annotations

import numpy as np

from scheduling.engine.framework import CycleState, JobView
from scheduling.engine.snapshot import Snapshot


class NodeSelector:
    """Filter: the node carries every label of the job's ``placement.nodeSelector``."""

    name = "selectors"

    def filter(self, state: CycleState, snap: Snapshot, job: JobView, rows: np.ndarray) -> np.ndarray:
        ok = np.ones(len(rows), dtype=bool)
        for key, value in job.selector:
            ok &= snap.label_mask(key, value)[rows]
        return ok

    def explain(self, job: JobView, snap: Snapshot, refused: int) -> str:
        wanted = ",".join(f"{k}={v}" for k, v in job.selector)
        return f"{refused:,} do not match {wanted}"
