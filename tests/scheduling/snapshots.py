"""Tiny snapshots for plugin tests: ``snapshot(node(gpus=8, free=3), node(model=1))``."""

from __future__ import annotations

from typing import Any

import numpy as np

from scheduling.engine.framework import CycleState, JobView
from scheduling.engine.snapshot import Snapshot

MODELS = ["h100-80g", "a100-80g"]


def node(
    *,
    cluster: int = 0,
    model: int = 0,
    gpus: int = 8,
    free: int | None = None,
    cpu: int = 64_000,
    memory: int = 2**40,
    ready: bool = True,
    labels: dict[str, str] | None = None,
    groups: dict[int, str] | None = None,
) -> dict[str, Any]:
    free = gpus if free is None else free
    return {
        "cluster": cluster,
        "model": model,
        "gpus": gpus,
        "free": free,
        "cpu": cpu,
        "memory": memory,
        "ready": ready,
        "labels": labels or {},
        "groups": groups or {},
    }


def snapshot(*nodes: dict[str, Any], clusters: int = 2) -> Snapshot:
    bits = [sum(1 << i for i in range(n["gpus"] - n["free"], n["gpus"])) for n in nodes]
    return Snapshot(
        node_id=np.arange(1, len(nodes) + 1, dtype=np.int64),
        cluster=np.array([n["cluster"] for n in nodes], dtype=np.int32),
        model=np.array([n["model"] if n["gpus"] else -1 for n in nodes], dtype=np.int32),
        ready=np.array([n["ready"] for n in nodes], dtype=bool),
        gpu_total=np.array([n["gpus"] for n in nodes], dtype=np.int32),
        gpu_free=np.array([n["free"] for n in nodes], dtype=np.int32),
        free_bits=np.array(bits, dtype=np.uint64),
        cpu_free=np.array([n["cpu"] for n in nodes], dtype=np.int64),
        mem_free=np.array([n["memory"] for n in nodes], dtype=np.int64),
        cluster_ids=list(range(100, 100 + clusters)),
        cluster_names=[f"c{i}" for i in range(clusters)],
        model_ids=[1, 2],
        model_names=MODELS,
        gpu_ids=[{i: 1000 * r + i for i in range(n["gpus"])} for r, n in enumerate(nodes)],
        groups=[n["groups"] for n in nodes],
        labels=[n["labels"] for n in nodes],
        names=[f"n{r}" for r in range(len(nodes))],
    )


def job(
    *,
    gpus: int = 1,
    model: int = 0,
    nodes: int = 1,
    cpu: int = 0,
    memory: int = 0,
    queue: int = 1,
    project: int = 1,
    priority: int = 0,
    clusters: tuple[int, ...] = (),
    selector: tuple[tuple[str, str], ...] = (),
    job_id: int = 1,
    submitted: float = 0.0,
) -> JobView:
    return JobView(
        id=job_id,
        queue_id=queue,
        project_id=project,
        priority=priority,
        submitted_at=submitted,
        nodes=nodes,
        gpus=gpus,
        model=model if gpus else -1,
        cpu=cpu,
        memory=memory,
        clusters=clusters,
        selector=selector,
    )


def state(**data: Any) -> CycleState:
    return CycleState(
        epoch=1, data={"queue_priority": {}, "queue_project": {1: 1, 2: 2}, "project_weight": {}} | data
    )
