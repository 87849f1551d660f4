from __future__ import annotations

from typing import Any

from scheduling.engine.framework import OK, CycleState, JobView, Placement, Status
from scheduling.engine.snapshot import Snapshot


class FairShare:
    """QueueSort + Reserve: dominant-resource fairness between projects. A project's share is
    its largest fraction of any GPU model's fleet (its dominant resource), divided by its weight
    (the largest fair-share weight of its queues). Lower shares go first; a placement raises the
    project's share at once, so one project cannot take a whole cycle."""

    name = "fair_share"

    def _usage(self, state: CycleState, snap: Snapshot) -> dict[int, dict[int, int]]:
        usage = state.data.get("fair_share.usage")
        if usage is None:
            usage = {}
            project_of = state.data["queue_project"]
            for (queue, model), gpus in snap.quota.used.items():
                per = usage.setdefault(project_of.get(queue, 0), {})
                per[model] = per.get(model, 0) + gpus
            state.data["fair_share.usage"] = usage
            totals: dict[int, int] = {}
            for model, total in zip(snap.model, snap.gpu_total, strict=True):
                if model >= 0:
                    totals[int(model)] = totals.get(int(model), 0) + int(total)
            state.data["fair_share.totals"] = totals
        return usage

    def share(self, state: CycleState, snap: Snapshot, project: int) -> float:
        shares = state.data.setdefault("fair_share.shares", {})
        if project not in shares:
            usage = self._usage(state, snap).get(project, {})
            totals = state.data["fair_share.totals"]
            dominant = max((gpus / totals[m] for m, gpus in usage.items() if totals.get(m)), default=0.0)
            shares[project] = dominant / max(state.data["project_weight"].get(project, 1.0), 1e-9)
        return shares[project]

    def sort_key(self, state: CycleState, snap: Snapshot, job: JobView) -> tuple[Any, ...]:
        return (self.share(state, snap, job.project_id),)

    def reserve(self, state: CycleState, snap: Snapshot, placement: Placement) -> Status:
        job = placement.job
        if job.total_gpus and job.model >= 0:
            per = self._usage(state, snap).setdefault(job.project_id, {})
            per[job.model] = per.get(job.model, 0) + job.total_gpus
            state.data.get("fair_share.shares", {}).pop(job.project_id, None)
        return OK

    def unreserve(self, state: CycleState, snap: Snapshot, placement: Placement) -> None:
        job = placement.job
        if job.total_gpus and job.model >= 0:
            per = self._usage(state, snap).setdefault(job.project_id, {})
            per[job.model] = per.get(job.model, 0) - job.total_gpus
            state.data.get("fair_share.shares", {}).pop(job.project_id, None)
