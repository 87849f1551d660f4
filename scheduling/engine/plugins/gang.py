from __future__ import annotations

import numpy as np

from scheduling.choices import PendingReason
from scheduling.engine.framework import OK, Code, CycleState, JobView, Status
from scheduling.engine.snapshot import Snapshot


class Gang:
    """PreFilter: a multi-node job must find all its nodes in one cluster, or none. This checks
    that some cluster has at least that many nodes of the model at all; the cycle's selection
    then places all tasks in one decision or none (``cycle.decide.select``)."""

    name = "gang"

    def pre_filter(self, state: CycleState, snap: Snapshot, job: JobView) -> Status:
        if job.nodes <= 1:
            return OK
        key = ("gang", job.model)
        largest = state.data.get(key)
        if largest is None:
            candidates = snap.ready & ((snap.model == job.model) if job.gpus else True)
            counts = np.bincount(snap.cluster[candidates], minlength=len(snap.cluster_ids))
            largest = state.data[key] = int(counts.max()) if len(counts) else 0
        if largest >= job.nodes:
            return OK
        return Status(
            Code.UNSCHEDULABLE,
            PendingReason.RESOURCES,
            f"needs {job.nodes} nodes in one cluster; the largest has {largest} ready",
        )
