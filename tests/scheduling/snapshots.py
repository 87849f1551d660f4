"""Tiny snapshots for plugin tests: ``snapshot(node(gpus=8, free=3), node(model=1))``.

Fine-grained GPUs, telemetry and energy facts are opt-in: ``node(mig={0: ["3g.40gb", "3g.40gb"]})``
puts GPU 0 in MIG mode with two instances, ``node(shared={1: 81920})`` marks GPU 1 shareable,
``node(util=90, temp=88, seen=1000.0)`` gives it a telemetry reading taken at epoch second 1000,
and ``snapshot(..., perf_per_watt=[…], price=[…], carbon=[…])`` the per-model and per-cluster
energy facts."""

from __future__ import annotations

from typing import Any

import numpy as np

from scheduling.engine.framework import WHOLE, CycleState, JobView
from scheduling.engine.snapshot import SharedGpu, Snapshot

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
    mig: dict[int, list[str]] | None = None,
    shared: dict[int, int] | None = None,
    block: int = -1,
    util: float = np.nan,
    mem_used: float = np.nan,
    temp: float = np.nan,
    seen: float = 0.0,
) -> dict[str, Any]:
    """One node: ``free`` of its whole GPUs free (the highest indices), ``mig`` GPU index →
    its instances' profiles (those GPUs are not whole GPUs), ``shared`` GPU index → memory (MiB)
    of a shareable GPU; telemetry averages taken at ``seen`` (epoch seconds, 0: never)."""
    mig = mig or {}
    free = gpus - len(mig) if free is None else free
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
        "mig": mig,
        "shared": shared or {},
        "block": block,
        "telemetry": (util, mem_used, temp, seen),
    }


def snapshot(
    *nodes: dict[str, Any],
    clusters: int = 2,
    perf_per_watt: list[float] | None = None,
    price: list[float] | None = None,
    carbon: list[float] | None = None,
) -> Snapshot:
    """The nodes as snapshot rows; ``perf_per_watt`` per model, ``price`` and ``carbon`` per
    cluster (NaN: unknown; left out: unknown everywhere)."""
    bits = [_free_bits(n) for n in nodes]
    snap = Snapshot(
        node_id=np.arange(1, len(nodes) + 1, dtype=np.int64),
        cluster=np.array([n["cluster"] for n in nodes], dtype=np.int32),
        model=np.array([n["model"] if n["gpus"] else -1 for n in nodes], dtype=np.int32),
        ready=np.array([n["ready"] for n in nodes], dtype=bool),
        gpu_total=np.array([n["gpus"] - len(n["mig"]) for n in nodes], dtype=np.int32),
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
        mig_profiles=sorted({p for n in nodes for profiles in n["mig"].values() for p in profiles}),
        block=np.array([n["block"] for n in nodes], dtype=np.int32),
        block_names=[f"b{i}" for i in range(max((n["block"] for n in nodes), default=-1) + 1)],
        util=np.array([n["telemetry"][0] for n in nodes], dtype=np.float32),
        mem_used=np.array([n["telemetry"][1] for n in nodes], dtype=np.float32),
        temp=np.array([n["telemetry"][2] for n in nodes], dtype=np.float32),
        telemetry_at=np.array([n["telemetry"][3] for n in nodes], dtype=np.float64),
    )
    _fine_grained(snap, nodes)
    if perf_per_watt is not None:
        by_model = np.array([*perf_per_watt, np.nan], dtype=np.float32)
        snap.perf_per_watt = by_model[snap.model]  # -1 (no GPUs) picks the NaN
    if price is not None:
        snap.price = np.array(price, dtype=np.float32)[snap.cluster]
    if carbon is not None:
        snap.carbon = np.array(carbon, dtype=np.float32)[snap.cluster]
    return snap


def _free_bits(n: dict[str, Any]) -> int:
    whole = [i for i in range(n["gpus"]) if i not in n["mig"]]
    return sum(1 << i for i in whole[len(whole) - n["free"] :])


def _fine_grained(snap: Snapshot, nodes: tuple[dict[str, Any], ...]) -> None:
    """MIG instances (ids from 1, in node order) and shareable GPUs, counted as the cache does."""
    instance = 0
    for row, n in enumerate(nodes):
        for gpu, profiles in n["mig"].items():
            snap.mig_gpus.setdefault(row, set()).add(gpu)
            for profile in profiles:
                instance += 1
                snap.mig_all.setdefault(row, []).append((instance, snap.profile_index[profile], gpu))
        if n["mig"]:
            snap._recount_mig(row)
        if n["shared"]:
            snap.shared[row] = {i: SharedGpu(mb) for i, mb in n["shared"].items()}
            snap._recount_shared(row)


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
    slice: int = WHOLE,
    share_mb: int = 0,
    share_milli: int = 0,
    topology: str = "",
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
        slice=slice,
        share_mb=share_mb,
        share_milli=share_milli,
        topology=topology,
    )


def state(**data: Any) -> CycleState:
    return CycleState(
        epoch=1, data={"queue_priority": {}, "queue_project": {1: 1, 2: 2}, "project_weight": {}} | data
    )
