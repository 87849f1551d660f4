"""The scheduler's columnar picture of the fleet: one row per node, one numpy array per fact.

Free GPUs are both a count (``gpu_free``) and a bitmask of free, healthy indices
(``free_bits``), so a decision names exact GPU indices. ``take``/``give`` change one row and
log it, so a class's filter mask can be brought up to date by re-checking only changed rows.

Smaller than whole GPUs (``docs/scheduling-policies.md``, fine-grained GPUs):

* **MIG**: a GPU in MIG mode is never handed out whole (it is in neither ``gpu_total`` nor
  ``free_bits``); its instances are counted per row and profile in ``mig_free`` (rows × the
  fleet's profiles), so a MIG job's filter is one column compare. Which instances are free is
  kept per row (``mig_all`` less ``mig_held``), touched only when a row changes.
* **Shared GPUs**: a GPU an operator marked shareable is whole-free (in ``free_bits``) while
  nothing of it is shared out; once a fraction is handed out it leaves ``free_bits`` and only
  fractions fit until the last one is given back. ``share_free`` is, per row, the most memory
  one shareable GPU can still give: what is not handed out *and* not in use by the telemetry
  (a job that uses more than it asked for is not given a neighbour that would not fit).
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


@dataclass
class SharedGpu:
    """A shareable GPU as the scheduler counts it: memory (MiB) handed out in fractions, in use
    per fresh telemetry, and whether one job holds it whole."""

    memory: int
    used: int = 0
    actual: int = 0
    whole: bool = False
    healthy: bool = True

    def free(self) -> int:
        if self.whole or not self.healthy:
            return 0
        return max(self.memory - max(self.used, self.actual), 0)


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
    # Fine-grained GPUs (see the module's docstring).
    gpu_mem: np.ndarray | None = None  # int32 MiB of one of the row's GPUs; 0 without GPUs
    mig_profiles: list[str] = field(default_factory=list)  # the fleet's MIG profiles ("1g.10gb")
    mig_free: np.ndarray | None = None  # int16 rows × profiles: free instances
    mig_total: np.ndarray | None = None  # int16 rows × profiles: instances of healthy GPUs
    mig_all: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)  # row → (id, profile, GPU)
    mig_held: set[int] = field(default_factory=set)  # instance ids held
    mig_gpus: dict[int, set[int]] = field(default_factory=dict)  # row → GPU indices in MIG mode
    sick: dict[int, set[int]] = field(default_factory=dict)  # row → unhealthy GPU indices (MIG, shared)
    shared: dict[int, dict[int, SharedGpu]] = field(default_factory=dict)  # row → index → shareable GPU
    share_free: np.ndarray | None = None  # int32 MiB: the most one shareable GPU of the row can give
    share_cap: np.ndarray | None = None  # int32 MiB: the largest shareable GPU of the row
    # Topology: the block (switch, else rack) each row is under, -1 unknown; gangs that ask keep
    # to one block.
    block: np.ndarray | None = None  # int32 index into block_names
    block_names: list[str] = field(default_factory=list)
    # Telemetry, exponential averages (``scheduling.engine.telemetry``); NaN where unknown, and
    # ``telemetry_at`` (epoch seconds, 0 never) says how fresh.
    util: np.ndarray | None = None  # float32 percent: mean GPU utilisation of the row
    mem_used: np.ndarray | None = None  # float32 fraction of the row's GPU memory in use
    temp: np.ndarray | None = None  # float32 °C: the row's hottest GPU
    telemetry_at: np.ndarray | None = None  # float64
    # Energy: per row, its GPU model's relative throughput per watt (0 unknown) and its
    # cluster's price per kWh and carbon intensity (g/kWh), NaN unknown.
    perf_per_watt: np.ndarray | None = None  # float32
    price: np.ndarray | None = None  # float32
    carbon: np.ndarray | None = None  # float32

    def __post_init__(self) -> None:
        n = len(self.node_id)
        self.row_of = {int(nid): i for i, nid in enumerate(self.node_id)}
        self.model_index = {m: i for i, m in enumerate(self.model_ids)}
        self.cluster_index = {c: i for i, c in enumerate(self.cluster_ids)}
        self.profile_index = {p: i for i, p in enumerate(self.mig_profiles)}
        self.all_rows = np.arange(n)
        ints = {"gpu_mem": np.int32, "share_free": np.int32, "share_cap": np.int32}
        for name, dtype in ints.items():
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(n, dtype=dtype))
        for name in ("mig_free", "mig_total"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros((n, len(self.mig_profiles)), dtype=np.int16))
        if self.block is None:
            self.block = np.full(n, -1, dtype=np.int32)
        for name in ("util", "mem_used", "temp", "perf_per_watt", "price", "carbon"):
            if getattr(self, name) is None:
                setattr(self, name, np.full(n, np.nan, dtype=np.float32))
        if self.telemetry_at is None:
            self.telemetry_at = np.zeros(n, dtype=np.float64)

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
        self._whole(row, indices, True)
        self.changed.append(row)

    def give(self, row: int, indices: tuple[int, ...], cpu: int, memory: int) -> None:
        for i in indices:
            self.free_bits[row] |= np.uint64(1 << i)
        self.gpu_free[row] += len(indices)
        self.cpu_free[row] += cpu
        self.mem_free[row] += memory
        self._whole(row, indices, False)
        self.changed.append(row)

    def _whole(self, row: int, indices: tuple[int, ...], held: bool) -> None:
        """A shareable GPU held whole gives no fractions (and is given back whole)."""
        shared = self.shared.get(row)
        if shared and any(i in shared for i in indices):
            for i in indices:
                if i in shared:
                    shared[i].whole = held
            self._recount_shared(row)

    # --- MIG instances --------------------------------------------------------------------
    def take_instances(self, row: int, instances: tuple[int, ...]) -> None:
        self.mig_held.update(instances)
        self._recount_mig(row)
        self.changed.append(row)

    def give_instances(self, row: int, instances: tuple[int, ...]) -> None:
        self.mig_held.difference_update(instances)
        self._recount_mig(row)
        self.changed.append(row)

    def free_instances(self, row: int, profile: int) -> list[tuple[int, int]]:
        """(instance id, GPU index) of the row's free instances of ``profile``."""
        sick = self.sick.get(row, ())
        return [
            (inst, gpu)
            for inst, p, gpu in self.mig_all.get(row, ())
            if p == profile and inst not in self.mig_held and gpu not in sick
        ]

    def choose_instances(self, row: int, profile: int, count: int) -> tuple[tuple[int, int], ...]:
        """``count`` free instances of ``profile``: from the GPUs with the fewest free instances
        first, so partly used GPUs fill up and whole GPUs' layouts stay free."""
        free = self.free_instances(row, profile)
        left: dict[int, int] = {}
        for _, gpu in free:
            left[gpu] = left.get(gpu, 0) + 1
        return tuple(sorted(free, key=lambda f: (left[f[1]], f[1], f[0]))[:count])

    def _recount_mig(self, row: int) -> None:
        free = np.zeros(len(self.mig_profiles), dtype=np.int16)
        total = np.zeros(len(self.mig_profiles), dtype=np.int16)
        sick = self.sick.get(row, ())
        for inst, p, gpu in self.mig_all.get(row, ()):
            if gpu in sick:
                continue
            total[p] += 1
            if inst not in self.mig_held:
                free[p] += 1
        self.mig_free[row] = free
        self.mig_total[row] = total

    # --- shared GPUs ----------------------------------------------------------------------
    def share_need(self, job: Any, rows: np.ndarray) -> np.ndarray:
        """MiB a shared-GPU job needs on each of ``rows``: what it asked for by memory, or its
        share of the row's GPU memory (rounded up)."""
        need = np.full(len(rows), job.share_mb, dtype=np.int64)
        if job.share_milli:
            by_share = (self.gpu_mem[rows].astype(np.int64) * job.share_milli + 999) // 1000
            need = np.maximum(need, by_share)
        return need

    def choose_share(self, row: int, need: int) -> int | None:
        """The shareable GPU of the row to give ``need`` MiB from: the one that fits it most
        tightly (best fit keeps the roomiest GPUs for larger fractions); None if none fits."""
        fits = [(g.free(), i) for i, g in self.shared.get(row, {}).items() if g.free() >= need]
        return min(fits)[1] if fits else None

    def take_share(self, row: int, index: int, mb: int) -> None:
        gpu = self.shared[row][index]
        if not gpu.used and not gpu.whole and self.free_bits[row] >> np.uint64(index) & np.uint64(1):
            self.free_bits[row] &= ~np.uint64(1 << index)  # shared out: no longer whole-free
            self.gpu_free[row] -= 1
        gpu.used += mb
        self._recount_shared(row)
        self.changed.append(row)

    def give_share(self, row: int, index: int, mb: int) -> None:
        gpu = self.shared[row][index]
        gpu.used = max(gpu.used - mb, 0)
        if not gpu.used and gpu.healthy and not gpu.whole:
            self.free_bits[row] |= np.uint64(1 << index)
            self.gpu_free[row] += 1
        self._recount_shared(row)
        self.changed.append(row)

    def set_actual(self, row: int, index: int, mb: int) -> None:
        """Memory in use on a shareable GPU per fresh telemetry (0: unknown or stale)."""
        gpu = self.shared.get(row, {}).get(index)
        if gpu is not None and gpu.actual != mb:
            gpu.actual = mb
            self._recount_shared(row)
            self.changed.append(row)

    def _recount_shared(self, row: int) -> None:
        gpus = self.shared.get(row, {})
        self.share_free[row] = max((g.free() for g in gpus.values()), default=0)
        self.share_cap[row] = max((g.memory for g in gpus.values() if g.healthy), default=0)

    def set_sick(self, row: int, indices: set[int]) -> None:
        """The row's unhealthy GPUs, for MIG instances and shareable GPUs (whole GPUs' health is
        ``free_bits``)."""
        if self.sick.get(row, set()) == indices:
            return
        self.sick[row] = indices
        for i, gpu in self.shared.get(row, {}).items():
            gpu.healthy = i not in indices
        if row in self.mig_all:
            self._recount_mig(row)
        if row in self.shared:
            self._recount_shared(row)
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
