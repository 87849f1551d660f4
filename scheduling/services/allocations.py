"""Binding one job to nodes and GPUs, row by row.

This is the simple path used by operators' tools, tests and demo seeding. The scheduling cycle
commits many decisions at once through a set-based path of its own; both end in the same rows
and rely on the same database constraints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import F

from clusters.models import GpuDevice, Node
from scheduling.choices import JobState
from scheduling.models import Allocation, Job, JobAttempt
from scheduling.services.transitions import transition_job


@dataclass(frozen=True)
class NodePlacement:
    """One node of a decision and the GPU indices chosen on it."""

    node: Node
    gpu_indices: Sequence[int]


class PlacementRefused(Exception):
    """The placement does not fit the job (wrong count, wrong model, other cluster)."""


@transaction.atomic
def bind_job(
    job: Job, placements: Sequence[NodePlacement], *, epoch: int = 0, actor: AbstractBaseUser | None = None
) -> JobAttempt:
    """Create the job's next attempt with its allocations and move the job PENDING → SCHEDULED.

    Raises ``PlacementRefused`` for a placement that does not match the job's request, and
    ``IntegrityError`` if a GPU is already held by another active allocation — the database,
    not this function, is the last word on double allocation.
    """
    if len(placements) != job.nodes:
        raise PlacementRefused(f"job {job.pk} needs {job.nodes} node(s), got {len(placements)}.")
    clusters = {p.node.cluster_id for p in placements}
    if len(clusters) != 1:
        raise PlacementRefused("all nodes of a job must be in one cluster.")
    gpus_by_node: dict[int, list[GpuDevice]] = {}
    for p in placements:
        if len(p.gpu_indices) != job.gpus_per_node:
            raise PlacementRefused(f"job {job.pk} needs {job.gpus_per_node} GPU(s) per node on {p.node}.")
        devices = list(GpuDevice.objects.filter(node=p.node, index__in=list(p.gpu_indices)))
        if len(devices) != job.gpus_per_node or any(d.model_id != job.gpu_model_id for d in devices):
            raise PlacementRefused(f"{p.node} has no GPUs {list(p.gpu_indices)} of model {job.gpu_model}.")
        gpus_by_node[p.node.pk] = devices

    Job.objects.filter(pk=job.pk).update(attempt_count=F("attempt_count") + 1)
    number = Job.objects.values_list("attempt_count", flat=True).get(pk=job.pk)
    attempt = JobAttempt.objects.create(job=job, number=number, cluster_id=clusters.pop(), epoch=epoch)
    rows = []
    for p in placements:
        rows.append(
            Allocation(
                attempt=attempt,
                job=job,
                node=p.node,
                cpu_millicores=job.cpu_millicores_per_node,
                memory_bytes=job.memory_bytes_per_node,
            )
        )
        rows += [Allocation(attempt=attempt, job=job, node=p.node, gpu=d) for d in gpus_by_node[p.node.pk]]
    Allocation.objects.bulk_create(rows)
    nodes = ", ".join(f"{p.node.name}[{','.join(map(str, p.gpu_indices))}]" for p in placements)
    transition_job(
        job.pk, JobState.SCHEDULED, actor=actor, message=f"placed on {nodes}", only_from=[JobState.PENDING]
    )
    return attempt


def retire_mig_instances(instance_ids: list[int]) -> set[int]:
    """The ``retire_mig_instances`` port: of these MIG instances, whose GPU's layout changed, those
    an active allocation holds — they stay — and the released allocations naming the others
    forget them, so the instances can be deleted (``Allocation.mig_instance`` protects them).
    Such a history row keeps its parent GPU, and its job its ``gpu_slice``."""
    if not instance_ids:
        return set()
    held = set(
        Allocation.objects.filter(mig_instance_id__in=instance_ids, active=True).values_list(
            "mig_instance_id", flat=True
        )
    )
    Allocation.objects.filter(
        mig_instance_id__in=[i for i in instance_ids if i not in held], active=False
    ).update(mig_instance=None)
    return held
