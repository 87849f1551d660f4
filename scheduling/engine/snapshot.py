"""The scheduler's columnar picture of the fleet: one row per node, one numpy array per fact.

Free GPUs are both a count (``gpu_free``) and a bitmask of free, healthy indices
(``free_bits``), so a decision names exact GPU indices. ``take``/``give`` change one row and
log it, so a class's filter mask can be brought up to date by re-checking only changed rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class QuotaBook:
    """GPUs held per (queue, model row index) against nominal quota, with cohorts.

    A queue with no quota rows at all is not limited (and takes no part in its cohort's sums).
    Otherwise it may hold up to its nominal quota of a model, and borrow beyond it what its
    cohort leaves unused, up to its borrowing limit (None = no limit): the queues of a cohort
    together never hold more than the sum of their nominal quotas."""

    limited: set[int] = field(default_factory=set)
    nominal: dict[tuple[int, int], int] = field(default_factory=dict)
    borrowing_limit: dict[tuple[int, int], int | None] = field(default_factory=dict)
    used: dict[tuple[int, int], int] = field(default_factory=dict)
    cohort_of: dict[int, str] = field(default_factory=dict)
    members: dict[str, list[int]] = field(default_factory=dict)

    def headroom(self, queue: int, model: int) -> int:
        """How many more GPUs of ``model`` the queue may hold now (a large number if unlimited).

        Alone, a queue may fill its nominal quota. In a cohort, it may use whatever of the
        cohort's quota is unused — its own and what the others leave idle, minus what anyone
        already borrowed — but no more than its nominal quota plus its borrowing limit."""
        if queue not in self.limited:
            return 1 << 30
        key = (queue, model)
        nominal, used = self.nominal.get(key, 0), self.used.get(key, 0)
        cohort = self.cohort_of.get(queue)
        if not cohort:
            return max(nominal - used, 0)
        members = [q for q in self.members[cohort] if q in self.limited]
        cohort_free = sum(self.nominal.get((q, model), 0) - self.used.get((q, model), 0) for q in members)
        limit = self.borrowing_limit.get(key)
        ceiling = cohort_free if limit is None else min(cohort_free, nominal + limit - used)
        return max(ceiling, 0)

    def add(self, queue: int, model: int, gpus: int) -> None:
        key = (queue, model)
        self.used[key] = self.used.get(key, 0) + gpus

    def describe(self, queue_name: str, queue: int, model: int, model_name: str) -> str:
        key = (queue, model)
        return f"queue {queue_name} at {self.used.get(key, 0)}/{self.nominal.get(key, 0)} {model_name}"


@dataclass
class LimitBook:
    """Per-user limits of queues (``Queue.max_running_jobs_per_user``, ``max_gpus_per_user``) and
    what counts against them and against arrays' throttles: jobs and GPUs held per (queue,
    owner), members holding resources per array. A job counts from the moment the cycle that
    places it assumes it (so later decisions of the same cycle see it) until it gives back
    what it holds — every active state, PREEMPTED (draining) included."""

    max_jobs: dict[int, int] = field(default_factory=dict)  # queue id → running jobs per user
    max_gpus: dict[int, int] = field(default_factory=dict)  # queue id → GPUs per user
    jobs: dict[tuple[int, int], int] = field(default_factory=dict)  # (queue, owner) → jobs holding
    gpus: dict[tuple[int, int], int] = field(default_factory=dict)  # (queue, owner) → GPUs held
    members: dict[int, int] = field(default_factory=dict)  # array id → members holding
    owners: dict[int, str] = field(default_factory=dict)  # user id → username, for the reasons

    def limits_users(self, queue: int) -> bool:
        return queue in self.max_jobs or queue in self.max_gpus

    def add(self, queue: int, owner: int, array: int, gpus: int, sign: int = 1) -> None:
        """Count one job holding ``gpus`` (``sign=-1``: give it back). Counts that reach zero go,
        so the book holds only what is held now."""
        key = (queue, owner)
        _bump(self.jobs, key, sign)
        _bump(self.gpus, key, sign * gpus)
        if array:
            _bump(self.members, array, sign)

    def owner_name(self, owner: int) -> str:
        return self.owners.get(owner) or f"user {owner}"


def _bump(counts: dict[Any, int], key: Any, by: int) -> None:
    value = counts.get(key, 0) + by
    if value:
        counts[key] = value
    else:
        counts.pop(key, None)


@dataclass
class Snapshot:
    node_id: np.ndarray  # int64
    cluster: np.ndarray  # int32, index into cluster_ids
    model: np.ndarray  # int32, index into model_ids; -1 without GPUs
    ready: np.ndarray  # bool: node and cluster accept new work
    gpu_total: np.ndarray  # int32: healthy GPUs
    gpu_free: np.ndarray  # int32
    free_bits: np.ndarray  # uint64: bit i set = GPU index i free and healthy
    cpu_free: np.ndarray  # int64 millicores
    mem_free: np.ndarray  # int64 bytes
    cluster_ids: list[int]
    cluster_names: list[str]
    model_ids: list[int]
    model_names: list[str]
    gpu_ids: list[dict[int, int]]  # per row: GPU index → GpuDevice id
    groups: list[dict[int, str]]  # per row: GPU index → topology group ("" unknown)
    labels: list[dict[str, str]]
    names: list[str] = field(default_factory=list)
    quota: QuotaBook = field(default_factory=QuotaBook)
    limits: LimitBook = field(default_factory=LimitBook)
    queue_names: dict[int, str] = field(default_factory=dict)
    queue_models: dict[int, tuple[int, ...]] = field(default_factory=dict)  # any-model order per queue
    changed: list[int] = field(default_factory=list)
    _label_masks: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.row_of = {int(n): i for i, n in enumerate(self.node_id)}
        self.model_index = {m: i for i, m in enumerate(self.model_ids)}
        self.cluster_index = {c: i for i, c in enumerate(self.cluster_ids)}
        self.all_rows = np.arange(len(self.node_id))

    def __len__(self) -> int:
        return len(self.node_id)

    def label_mask(self, key: str, value: str) -> np.ndarray:
        mask = self._label_masks.get((key, value))
        if mask is None:
            mask = np.fromiter(
                (lbl.get(key) == value for lbl in self.labels), dtype=bool, count=len(self.labels)
            )
            self._label_masks[(key, value)] = mask
        return mask

    def take(self, row: int, indices: tuple[int, ...], cpu: int, memory: int) -> None:
        for i in indices:
            self.free_bits[row] &= ~np.uint64(1 << i)
        self.gpu_free[row] -= len(indices)
        self.cpu_free[row] -= cpu
        self.mem_free[row] -= memory
        self.changed.append(row)

    def give(self, row: int, indices: tuple[int, ...], cpu: int, memory: int) -> None:
        for i in indices:
            self.free_bits[row] |= np.uint64(1 << i)
        self.gpu_free[row] += len(indices)
        self.cpu_free[row] += cpu
        self.mem_free[row] += memory
        self.changed.append(row)

    def set_ready(self, row: int, ready: bool) -> None:
        self.ready[row] = ready
        self.changed.append(row)

    def free_indices(self, row: int) -> list[int]:
        bits = int(self.free_bits[row])
        return [i for i in range(64) if bits >> i & 1]

    def choose_gpus(self, row: int, count: int) -> tuple[int, ...]:
        """``count`` free indices, from one NVLink/PCIe group when the node reports groups and
        one group can hold them all (the fullest group that fits, to keep whole groups free)."""
        free = self.free_indices(row)
        groups = self.groups[row]
        if count and groups:
            by_group: dict[str, list[int]] = {}
            for i in free:
                by_group.setdefault(groups.get(i, ""), []).append(i)
            fitting = [g for g in by_group.values() if len(g) >= count]
            if fitting:
                return tuple(min(fitting, key=len)[:count])
        return tuple(free[:count])
