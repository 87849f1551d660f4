"""The scheduler's cache: the snapshot and the pending queue, built once from the database and
then kept current from the event logs, not rebuilt every cycle.

The logs are the append-only ``JobEvent`` and ``NodeEvent`` tables: every change of a job's
state (and so every allocation made or released) and every change of a node's state appends a
row. Each sync reads the rows appended since the last one and re-reads just the jobs and nodes
they name. Reading again is harmless — the cache compares what it counted with what the database
holds now — so the window re-reads a few recent events to catch rows that committed out of id
order. A full rebuild every ``ORRERY_SCHEDULER_RESYNC_S`` seconds heals anything else (GPU
health changes, label edits).

The cycle's own decisions are *assumed* into the snapshot at once; if the cycle's transaction
rolls back, the cache is dropped and rebuilt.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db.models import Max, Q, QuerySet

from clusters.choices import ClusterState, GpuHealth, NodeState
from clusters.models import Cluster, GpuDevice, GpuModel, MigInstance, Node, NodeEvent
from clusters.selectors import reconfiguring_gpus
from foundation.performance import collector_paused
from scheduling.choices import JobState
from scheduling.engine.framework import (
    ANY_MODEL,
    NEVER,
    NO_GPU,
    UNKNOWN_SLICE,
    WHOLE,
    JobView,
    NodeChoice,
    Shape,
    Status,
)
from scheduling.engine.queue import PendingQueue
from scheduling.engine.snapshot import LimitBook, QuotaBook, SharedGpu, Snapshot
from scheduling.engine.telemetry import load_telemetry
from scheduling.models import Allocation, Job, JobAttempt, JobEvent, Queue, QueueQuota

SCHEDULABLE_CLUSTERS = {ClusterState.READY, ClusterState.DEGRADED}
NODE_MASKS_BYTES = 20_000_000
REREAD_WINDOW = 500  # events re-read each sync, for rows committed out of id order
# An active allocation: node id, GPU id or None, cpu, memory, MIG instance id or None, shared MiB.
HeldRow = tuple[int, int | None, int, int, int | None, int]
RATIO_ALPHA = 0.05  # how fast a queue's learned run-time/time-limit ratio follows new ends


@dataclass
class Run:
    """What the scheduler knows of a job holding resources, for backfill's timeline (when its
    GPUs come free) and for preemption (what preempting it would cost, whether it may be)."""

    queue: int
    model: int
    priority: int
    start: float  # epoch seconds it started (or was placed, until it starts)
    limit: float  # its time limit in seconds (NEVER: none)
    preemptible: bool = True
    checkpoint: float = 0.0  # epoch seconds of its last checkpoint (0: none)
    draining_until: float | None = None  # preempted: when its grace period ends
    rows: tuple[tuple[int, int], ...] = ()  # (snapshot row, GPUs held there)

    @property
    def gpus(self) -> int:
        return sum(g for _, g in self.rows)

    def lost_work(self, now: float) -> float:
        """GPU-seconds run since its last checkpoint (or its start): what preempting it loses."""
        return self.gpus * max(now - max(self.start, self.checkpoint), 0.0)


@dataclass
class Held:
    """What the cache counted for one allocation row of an active job. ``counted`` says whether
    a held GPU was taken out of the free mask (a held GPU that is unhealthy never was in it);
    it follows health changes, so a release gives back exactly what was taken."""

    row: int
    gpu: int  # GPU index; -1 for the node-level row
    cpu: int
    memory: int
    counted: bool = True
    node_id: int = 0
    gpu_id: int | None = None
    instance: int = 0  # a MIG instance of GPU ``gpu`` (its id), 0: none
    share_mb: int = 0  # a fraction of the shareable GPU ``gpu`` (MiB), 0: none

    @property
    def whole_gpu(self) -> bool:
        return self.gpu >= 0 and not self.instance and not self.share_mb


class SchedulerCache:
    def __init__(self) -> None:
        self.snap: Snapshot | None = None
        self.queue = PendingQueue()
        self.held: dict[int, list[Held]] = {}  # job id → what it holds
        self.job_queue: dict[int, tuple[int, int]] = {}  # job id → (queue id, model row)
        # job id → (queue, owner, array, GPUs): what it counts for in ``snap.limits``
        self.limit_counted: dict[int, tuple[int, int, int, int]] = {}
        self.job_cursor = 0
        self.node_cursor = 0
        self.built_at = 0.0
        self.telemetry_read = 0.0
        # class shape → ((reason, message), when finished, jobs, jobs told so far)
        self.explained: dict[Shape, tuple[tuple[str, str], float, int, int]] = {}
        # class shape → (snapshot, its version, Status, effects): a verdict holds while the
        # snapshot, the reservations ahead of it and the running jobs do (decide.py)
        self.verdicts: dict[Shape, tuple[Snapshot, tuple[int, int, int], Status, list[Any]]] = {}
        # (snapshot, what it rested on, Decided, until when) of the last cycle in which every
        # class kept its verdict and nothing was placed: returned whole while nothing changes
        # (decide.py)
        self.idle_cycle: tuple[Snapshot, tuple[Any, ...], Any, float] | None = None
        self.seen_events: set[int] = set()  # event ids already applied, within the re-read window
        self.seen_node_events: set[int] = set()
        self.usable_clusters: set[int] = set()
        self.placed_by_us: set[uuid.UUID] = set()  # attempts this process placed, until their events are read
        self.runs: dict[int, Run] = {}  # job id → what it holds and until when (jobs holding GPUs)
        self.runs_version = 0  # bumped by every change of ``runs`` (backfill's timeline follows it)
        self.ratios: dict[int, float] = {}  # queue id → learned run time / time limit of its jobs
        # Kept between cycles by backfill and preemption (scheduling/engine/cycle/backfill.py):
        self.nominated: dict[int, Any] = {}  # preemptor job id → the GPUs its victims free
        self.claims: dict[int, tuple[int, int, int]] = {}  # lender job id → (queue, model, GPUs)
        self.estimated: dict[int, tuple[float, str, bool]] = {}  # job id → estimate written
        self.carry: dict[Any, Any] = {}  # plugins' data kept between cycles (backfill's timelines)
        # class shape → (profile, mask, len(snap.changed) when checked): the filters that depend
        # only on what a node is, kept between cycles for one snapshot (decide.node_mask)
        self._node_masks: tuple[Snapshot | None, dict[Shape, tuple[Any, np.ndarray, int]]] = (None, {})

    def node_masks(self, snap: Snapshot) -> dict[Shape, tuple[Any, np.ndarray, int]]:
        """The kept node masks of this snapshot: a new snapshot starts afresh, and so does a store
        past ``NODE_MASKS_BYTES`` (about 20 MB of masks, whatever the fleet's size)."""
        kept, masks = self._node_masks
        if kept is not snap or len(masks) * len(snap.ready) > NODE_MASKS_BYTES:
            masks = {}
            self._node_masks = (snap, masks)
        return masks

    # --- building ------------------------------------------------------------------------
    def ensure(self) -> Snapshot:
        if self.rebuild_due():
            self.rebuild()
        else:
            self.sync()
            if (
                self.snap is not None
                and time.monotonic() - self.telemetry_read > settings.ORRERY_SCHEDULER_TELEMETRY_S
            ):
                load_telemetry(self.snap, time.time())
                self.telemetry_read = time.monotonic()
        assert self.snap is not None
        return self.snap

    def rebuild_due(self) -> bool:
        """Whether ``ensure`` will rebuild from the database rather than sync."""
        return self.snap is None or time.monotonic() - self.built_at > settings.ORRERY_SCHEDULER_RESYNC_S

    def invalidate(self) -> None:
        self.snap = None

    def rebuild(self) -> None:
        """Read everything afresh, with the cyclic collector paused: at a million pending jobs
        the rows read are millions of small acyclic objects, and the collector walking them
        made the build about a fifth longer (72 s against 54 and 66 s paused, on
        ``benchmarks/scale.py``'s fleet). A cycle pauses it already; other callers did not."""
        with collector_paused():
            self._rebuild()

    def _rebuild(self) -> None:
        # Cursors first: anything appended while we read is re-read by the next sync.
        self.job_cursor = JobEvent.objects.aggregate(m=Max("id"))["m"] or 0
        self.seen_events = set(
            JobEvent.objects.filter(id__gt=max(self.job_cursor - REREAD_WINDOW, 0)).values_list(
                "id", flat=True
            )
        )
        self.placed_by_us = set()
        self.node_cursor = NodeEvent.objects.aggregate(m=Max("id"))["m"] or 0
        self.seen_node_events = set(
            NodeEvent.objects.filter(id__gt=max(self.node_cursor - REREAD_WINDOW, 0)).values_list(
                "id", flat=True
            )
        )
        clusters = list(Cluster.objects.order_by("pk").values_list("pk", "name", "state"))
        cluster_index = {pk: i for i, (pk, _, _) in enumerate(clusters)}
        usable_clusters = {pk for pk, _, state in clusters if state in SCHEDULABLE_CLUSTERS}
        self.usable_clusters = set(usable_clusters)
        models = list(GpuModel.objects.order_by("pk").values_list("pk", "slug"))
        model_index = {pk: i for i, (pk, _) in enumerate(models)}

        nodes = list(
            Node.objects.order_by("pk").values_list(
                "pk",
                "cluster_id",
                "state",
                "cpu_millicores_allocatable",
                "memory_bytes_allocatable",
                "labels",
                "name",
            )
        )
        n = len(nodes)
        row_of = {pk: i for i, (pk, *_rest) in enumerate(nodes)}
        gpus = _read_gpus(row_of, model_index, n)
        snap = Snapshot(
            node_id=np.array([pk for pk, *_ in nodes], dtype=np.int64),
            cluster=np.array([cluster_index[c] for _, c, *_ in nodes], dtype=np.int32),
            model=gpus.model,
            ready=np.array(
                [s == NodeState.READY and c in usable_clusters for _, c, s, *_ in nodes], dtype=bool
            ),
            gpu_total=gpus.total,
            gpu_free=gpus.total.copy(),
            free_bits=gpus.free_bits,
            cpu_free=np.array([cpu for *_, cpu, _, _, _ in nodes], dtype=np.int64),
            mem_free=np.array([mem for *_, mem, _, _ in nodes], dtype=np.int64),
            cluster_ids=[pk for pk, _, _ in clusters],
            cluster_names=[name for _, name, _ in clusters],
            model_ids=[pk for pk, _ in models],
            model_names=[slug for _, slug in models],
            gpu_ids=gpus.ids,
            groups=gpus.groups,
            labels=[labels or {} for *_, labels, _ in nodes],
            names=[name for *_, name in nodes],
            gpu_mem=gpus.memory,
            mig_profiles=gpus.profiles,
            mig_all=gpus.instances,
            mig_gpus=gpus.mig_gpus,
            sick=gpus.sick,
            shared=gpus.shared,
        )
        gpu_ids = gpus.ids
        for row in gpus.instances:
            snap._recount_mig(row)
        for row in gpus.shared:
            snap._recount_shared(row)
        _read_topology(snap, row_of)
        load_telemetry(snap, time.time())
        self.telemetry_read = time.monotonic()
        snap.quota = self._quota_book(model_index)
        snap.limits = LimitBook(*_queue_limits())
        snap.queue_names = {}
        by_slug = {slug: i for i, slug in enumerate(snap.model_names)}
        for pk, name, project, preference in Queue.objects.values_list(
            "pk", "name", "project__name", "gpu_model_preference"
        ):
            snap.queue_names[pk] = f"{project}/{name}"
            snap.queue_models[pk] = _model_order(preference or [], by_slug, pk, snap.quota)
        self.snap, self.held, self.job_queue, self.limit_counted = snap, {}, {}, {}
        # What active allocations hold.
        held = defaultdict(list)
        for job_id, *row in Allocation.objects.filter(active=True).values_list(*_HELD_FIELDS):
            held[job_id].append(tuple(row))
        gpu_index = {dev: (row, idx) for row, ids in enumerate(gpu_ids) for idx, dev in ids.items()}
        job_info = {
            pk: rest
            for pk, *rest in Job.objects.filter(pk__in=list(held)).values_list(
                "pk", "queue_id", "gpu_model_id", "owner_id", "array_id"
            )
        }
        for job_id, rows in held.items():
            queue_id, model_id, owner, array = job_info.get(job_id, (0, None, 0, None))
            self._count(
                job_id, rows, row_of, gpu_index, queue_id, model_index.get(model_id, -1), owner, array or 0
            )
        self.runs = {}
        self._load_runs(set(held))
        self.queue = PendingQueue()
        # A job waiting on a dependency is not considered until it is released ("dependency met":
        # an event, so the sync below re-reads it).
        self.queue.load(self._views(Job.objects.filter(state=JobState.PENDING, dependency_pending=False)))
        self.built_at = time.monotonic()

    def _learn_owners(self, owners: set[int]) -> None:
        """Usernames of these owners, for the reasons a per-user limit gives; one query, and only
        for owners not known yet."""
        assert self.snap is not None
        names = self.snap.limits.owners
        missing = [o for o in owners if o not in names]
        if missing:
            names.update(get_user_model().objects.filter(pk__in=missing).values_list("pk", "username"))

    def _quota_book(self, model_index: dict[int, int]) -> QuotaBook:
        book = QuotaBook()
        for queue_id, cohort in Queue.objects.values_list("pk", "cohort"):
            if cohort:
                book.cohort_of[queue_id] = cohort
                book.members.setdefault(cohort, []).append(queue_id)
        for queue_id, model_id, gpus, limit in QueueQuota.objects.values_list(
            "queue_id", "gpu_model_id", "gpus", "borrowing_limit"
        ):
            book.limited.add(queue_id)
            book.nominal[(queue_id, model_index[model_id])] = gpus
            book.borrowing_limit[(queue_id, model_index[model_id])] = limit
        return book

    def _count(
        self,
        job_id: int,
        rows: list[HeldRow],
        row_of: dict[int, int],
        gpu_index: dict[int, tuple[int, int]],
        queue_id: int,
        model: int,
        owner: int,
        array: int,
    ) -> None:
        snap = self.snap
        assert snap is not None
        counted = []
        gpus = 0
        for node_id, gpu_id, cpu, memory, instance, share_mb in rows:
            if gpu_id is not None:
                row, index = gpu_index.get(gpu_id, (row_of.get(node_id), -1))
                if row is None or index < 0:
                    continue
                gpus += 1
                if instance:
                    snap.take_instances(row, (instance,))
                    counted.append(Held(row, index, 0, 0, node_id=node_id, gpu_id=gpu_id, instance=instance))
                    continue
                if share_mb and index in snap.shared.get(row, {}):
                    snap.take_share(row, index, share_mb)
                    counted.append(Held(row, index, 0, 0, node_id=node_id, gpu_id=gpu_id, share_mb=share_mb))
                    continue
                free = bool(snap.free_bits[row] >> np.uint64(index) & np.uint64(1))
                if free:
                    snap.take(row, (index,), 0, 0)
                # an unhealthy GPU still held was never in the free count: nothing to take
                counted.append(Held(row, index, 0, 0, counted=free, node_id=node_id, gpu_id=gpu_id))
            else:
                row = row_of.get(node_id)
                if row is None:
                    continue
                snap.take(row, (), cpu, memory)
                counted.append(Held(row, -1, cpu, memory, node_id=node_id))
        self.held[job_id] = counted
        self.job_queue[job_id] = (queue_id, model)
        if gpus and model >= 0:
            snap.quota.add(queue_id, model, gpus)
        self._count_limits(job_id, queue_id, owner, array, gpus)

    def _count_limits(self, job_id: int, queue_id: int, owner: int, array: int, gpus: int) -> None:
        """Count a job holding resources against its owner's limits in its queue and its array's
        throttle; ``_release`` gives back exactly this."""
        assert self.snap is not None
        self.snap.limits.add(queue_id, owner, array, gpus)
        self.limit_counted[job_id] = (queue_id, owner, array, gpus)

    def _load_runs(self, job_ids: set[int]) -> None:
        """(Re)read what backfill and preemption need of jobs holding resources."""
        if not job_ids:
            return
        changed = False
        preempting = {
            job_id: (asked.timestamp() + (grace or 0))
            for job_id, asked, grace in JobAttempt.objects.filter(
                job_id__in=job_ids, active=True, stop_requested_at__isnull=False
            ).values_list("job_id", "stop_requested_at", "stop_grace_s")
        }
        placed = dict(
            JobAttempt.objects.filter(job_id__in=job_ids, active=True).values_list("job_id", "created_at")
        )
        for (
            pk,
            queue_id,
            _model_id,
            priority,
            limit,
            preemptible,
            checkpoint,
            started,
            state,
        ) in Job.objects.filter(pk__in=job_ids).values_list(
            "pk",
            "queue_id",
            "gpu_model_id",
            "priority",
            "time_limit_s",
            "preemptible",
            "checkpointed_at",
            "started_at",
            "state",
        ):
            counted = self.held.get(pk)
            if counted is None:
                changed |= self.runs.pop(pk, None) is not None
                continue
            at = placed.get(pk) or started
            if started is not None and at is not None and started > at:
                at = started
            run = Run(
                queue=queue_id,
                model=self.job_queue.get(pk, (0, -1))[1],
                priority=priority,
                start=at.timestamp() if at else time.time(),
                limit=float(limit) if limit else NEVER,
                preemptible=preemptible,
                checkpoint=checkpoint.timestamp() if checkpoint else 0.0,
                draining_until=preempting.get(pk) if state == JobState.PREEMPTED else None,
                rows=_rows_of(counted),
            )
            if self.runs.get(pk) != run:
                self.runs[pk] = run
                changed = True
        if changed:
            self.runs_version += 1  # backfill's timeline and kept verdicts follow it

    def note_end(self, job_id: int, at: float) -> None:
        """A job ended on its own (succeeded, failed, timed out): learn from its run time how much
        of their time limit its queue's jobs use, for predicted start times."""
        run = self.runs.get(job_id)
        if run is None or run.limit == NEVER or run.limit <= 0:
            return
        used = min(max((at - run.start) / run.limit, 0.0), 1.0)
        old = self.ratios.get(run.queue)
        self.ratios[run.queue] = used if old is None else old + RATIO_ALPHA * (used - old)

    def _release(self, job_id: int) -> None:
        snap = self.snap
        assert snap is not None
        counted = self.held.pop(job_id, [])
        queue_id, model = self.job_queue.pop(job_id, (0, -1))
        if self.runs.pop(job_id, None) is not None:
            self.runs_version += 1
        gpus = 0
        for h in counted:
            if h.instance:
                snap.give_instances(h.row, (h.instance,))
                gpus += 1
            elif h.share_mb:
                if h.gpu in snap.shared.get(h.row, {}):
                    snap.give_share(h.row, h.gpu, h.share_mb)
                gpus += 1
            elif h.gpu >= 0:
                if h.counted:
                    snap.give(h.row, (h.gpu,), 0, 0)
                gpus += 1
            else:
                snap.give(h.row, (), h.cpu, h.memory)
        if gpus and model >= 0:
            snap.quota.add(queue_id, model, -gpus)
        limited = self.limit_counted.pop(job_id, None)
        if limited is not None:
            snap.limits.add(*limited, sign=-1)

    # --- keeping current ----------------------------------------------------------------------
    def sync(self) -> None:
        snap = self.snap
        assert snap is not None
        if _queue_limits() != (snap.limits.max_jobs, snap.limits.max_gpus):
            # A queue's per-user limits changed: pending jobs group into classes by them (one
            # class per owner where a queue limits users), so they are read again from scratch.
            self.rebuild()
            return
        low = max(self.job_cursor - REREAD_WINDOW, 0)
        events = [
            (event, job, to_state, attempt)
            for event, job, to_state, attempt in JobEvent.objects.filter(id__gt=low).values_list(
                "id", "job_id", "to_state", "attempt_id"
            )
            if event not in self.seen_events
        ]
        if events:
            self.job_cursor = max(self.job_cursor, max(e[0] for e in events))
            self.seen_events = {e for e in self.seen_events if e > low} | {e[0] for e in events}
            # The placements this process committed are already counted (assumed): skip just
            # those events — by attempt, so a later placement of the same job elsewhere counts.
            ours = self.placed_by_us
            changed = {
                job
                for _, job, to_state, attempt in events
                if not (to_state == JobState.SCHEDULED and attempt in ours)
            }
            self.placed_by_us = ours - {e[3] for e in events}
            if changed:
                self.refresh_jobs(changed)
        # Node events: the same window, for rows committed out of id order. Applying one again
        # is harmless: it re-reads the node.
        low = max(self.node_cursor - REREAD_WINDOW, 0)
        node_events = [
            (e, n)
            for e, n in NodeEvent.objects.filter(id__gt=low).values_list("id", "node_id")
            if e not in self.seen_node_events
        ]
        usable = set(Cluster.objects.filter(state__in=SCHEDULABLE_CLUSTERS).values_list("pk", flat=True))
        ids = {n for _, n in node_events}
        if usable != self.usable_clusters:
            # A cluster changed state: its nodes' readiness follows. They are read from the
            # database, not from the snapshot, so a node that joined without an event of its own
            # (bulk onboarding while the cluster was off) is found and the snapshot rebuilt.
            turned = usable ^ self.usable_clusters
            ids |= set(Node.objects.filter(cluster_id__in=turned).values_list("pk", flat=True))
            self.usable_clusters = usable
        if node_events:
            self.node_cursor = max(self.node_cursor, max(e for e, _ in node_events))
            self.seen_node_events = {e for e in self.seen_node_events if e > low} | {
                e for e, _ in node_events
            }
        if ids:
            for pk, state, cluster_id in Node.objects.filter(pk__in=ids).values_list(
                "pk", "state", "cluster_id"
            ):
                row = snap.row_of.get(pk)
                if row is None:
                    self.invalidate()  # a node the snapshot has never seen: start over
                    self.rebuild()
                    return
                ready = state == NodeState.READY and cluster_id in usable
                if bool(snap.ready[row]) != ready:
                    snap.set_ready(row, ready)
            if node_events:
                self._refresh_gpu_health({n for _, n in node_events})

    def _refresh_gpu_health(self, node_ids: set[int]) -> None:
        """Healthy GPUs of these nodes, from the database: a GPU turning unhealthy leaves the free
        mask (if it is held, it stays held until its job ends); one turning healthy joins it.
        A GPU in MIG mode is never whole-free: its health reaches its instances; a shareable
        one's reaches its fractions. A GPU whose MIG layout an operator changed counts as
        unhealthy until its node reports the new layout (``reconfiguring_gpus``)."""
        snap = self.snap
        assert snap is not None
        healthy: dict[int, set[int]] = {snap.row_of[n]: set() for n in node_ids if n in snap.row_of}
        sick: dict[int, set[int]] = {row: set() for row in healthy}
        for node_id, index, health in GpuDevice.objects.filter(node_id__in=list(node_ids)).values_list(
            "node_id", "index", "health"
        ):
            row = snap.row_of.get(node_id)
            if row is None or index >= 64:
                continue
            (healthy if health == GpuHealth.HEALTHY else sick)[row].add(index)
        for node_id, index in reconfiguring_gpus(node_ids):  # a MIG layout on its way: not placed on
            row = snap.row_of.get(node_id)
            if row in healthy:
                healthy[row].discard(index)
                sick[row].add(index)
        held_by_row: dict[int, list[Held]] = defaultdict(list)
        for counted in self.held.values():
            for h in counted:
                if h.gpu >= 0 and not h.instance and h.row in healthy:
                    held_by_row[h.row].append(h)
        for row, indices in healthy.items():
            snap.set_sick(row, sick[row])
            whole = indices - snap.mig_gpus.get(row, set())
            held = held_by_row.get(row, [])
            for h in held:  # a held GPU is never free; it counts while healthy
                h.counted = h.gpu in whole
            bits = 0
            for i in whole - {h.gpu for h in held}:
                bits |= 1 << i
            if int(snap.free_bits[row]) != bits or int(snap.gpu_total[row]) != len(whole):
                snap.free_bits[row] = np.uint64(bits)
                snap.gpu_free[row] = bin(bits).count("1")
                snap.gpu_total[row] = len(whole)
                snap.changed.append(row)

    def refresh_jobs(self, job_ids: set[int]) -> None:
        """Bring the cache in line with the database for these jobs: pending or not, holding
        what. Idempotent, and independent of the order the jobs are visited in.

        Two passes: first every job whose holding changed gives back what it was counted for,
        then every job not counted is counted as it holds now. One pass would be wrong when a
        sync sees both a release of job X and another worker's placement of job Y on X's GPU:
        counting Y first finds the GPU still held by X and takes nothing, then X's release frees
        it, and a GPU that Y holds looks free."""
        snap = self.snap
        assert snap is not None
        jobs = {j.pk: j for j in Job.objects.filter(pk__in=job_ids)}
        active = defaultdict(list)
        for job_id, *row in Allocation.objects.filter(job_id__in=job_ids, active=True).values_list(
            *_HELD_FIELDS
        ):
            active[job_id].append(tuple(row))
        for job_id, job in jobs.items():
            if job.state in _ENDED_ON_ITS_OWN and job.finished_at is not None:
                self.note_end(job_id, job.finished_at.timestamp())
        for job_id in job_ids:
            counted = self.held.get(job_id)
            # Which rows, not how many: a job requeued and placed again by another process holds
            # as many GPUs as before, elsewhere.
            held_now = {(n, g, i or 0, mb) for n, g, _, _, i, mb in active.get(job_id, [])}
            if counted is not None and _holding(counted) != held_now:
                self._release(job_id)
        gpu_index = None
        for job_id in job_ids:
            job = jobs.get(job_id)
            held_now = active.get(job_id, [])
            if job_id not in self.held and held_now:
                if gpu_index is None:
                    gpu_index = {
                        dev: (row, idx) for row, ids in enumerate(snap.gpu_ids) for idx, dev in ids.items()
                    }
                model = snap.model_index.get(job.gpu_model_id, -1) if job and job.gpu_model_id else -1
                owner, array = (job.owner_id, job.array_id or 0) if job else (0, 0)
                self._count(
                    job_id, held_now, snap.row_of, gpu_index, job.queue_id if job else 0, model, owner, array
                )
            if job is not None and job.state == JobState.PENDING and not job.dependency_pending:
                self.queue.upsert(self._view(job))
            else:
                self.queue.remove(job_id)
        self._load_runs({j for j in job_ids if j in self.held})
        self._learn_owners({j.owner_id for j in jobs.values() if snap.limits.limits_users(j.queue_id)})

    def assume(
        self,
        job: JobView,
        choices: Iterable[NodeChoice],
        queue_id: int,
        now: float | None = None,
    ) -> None:
        """Count a decision of this cycle before it is committed (Kubernetes' AssumePod)."""
        snap = self.snap
        assert snap is not None
        counted = []
        for choice in choices:
            row, indices = choice.row, choice.gpu_indices
            node_id = int(snap.node_id[row])
            ids = snap.gpu_ids[row]
            counted.append(Held(row, -1, job.cpu, job.memory, node_id=node_id))
            if choice.instances:
                snap.take(row, (), job.cpu, job.memory)
                snap.take_instances(row, choice.instances)
                counted += [
                    Held(row, i, 0, 0, node_id=node_id, gpu_id=ids.get(i), instance=inst)
                    for i, inst in zip(indices, choice.instances, strict=True)
                ]
            elif choice.share_mb:
                snap.take(row, (), job.cpu, job.memory)
                snap.take_share(row, indices[0], choice.share_mb)
                counted.append(
                    Held(
                        row,
                        indices[0],
                        0,
                        0,
                        node_id=node_id,
                        gpu_id=ids.get(indices[0]),
                        share_mb=choice.share_mb,
                    )
                )
            else:
                snap.take(row, indices, job.cpu, job.memory)
                counted += [Held(row, i, 0, 0, node_id=node_id, gpu_id=ids.get(i)) for i in indices]
        self.held[job.id] = counted
        self.job_queue[job.id] = (queue_id, job.model)
        if job.total_gpus and job.model >= 0:
            snap.quota.add(queue_id, job.model, job.total_gpus)
        self._count_limits(job.id, queue_id, job.owner, job.array, job.total_gpus)
        self.runs[job.id] = Run(
            queue=queue_id,
            model=job.model,
            priority=job.priority,
            start=time.time() if now is None else now,
            limit=job.time_limit,
            preemptible=job.preemptible,
            rows=_rows_of(counted),
        )
        self.runs_version += 1
        self.nominated.pop(job.id, None)
        self.claims.pop(job.id, None)
        self.queue.remove(job.id)

    def forget_lost(self, job: JobView) -> None:
        """A placement that lost its compare-and-set (the job was cancelled or held meanwhile):
        give back what was assumed; the job's new state arrives with its event."""
        self._release(job.id)

    def forget(self, job: JobView) -> None:
        """Undo ``assume`` for a decision that will not be committed; the job waits again."""
        self._release(job.id)
        self.queue.upsert(job)

    # --- pending jobs -------------------------------------------------------------------------
    def _views(self, jobs: QuerySet[Job]) -> list[JobView]:
        views = [self._view_from_row(row) for row in jobs.values_list(*_VIEW_FIELDS)]
        self._learn_owners({v.owner for v in views if v.per_user})
        return views

    def _view(self, job: Job) -> JobView:
        return self._view_from_row(tuple(getattr(job, f) for f in _VIEW_FIELDS))

    def _view_from_row(self, row: tuple[Any, ...]) -> JobView:
        snap = self.snap
        assert snap is not None
        (
            pk,
            queue_id,
            project_id,
            priority,
            submitted,
            nodes,
            gpus,
            model_id,
            cpu,
            memory,
            placement,
            attempts,
            version,
            time_limit,
            preemptible,
            owner,
            array,
            throttle,
            gpu_slice,
            share_mb,
            share,
        ) = row
        placement = placement or {}
        clusters = (
            tuple(
                sorted(
                    snap.cluster_index[c]
                    for c in _cluster_pks(placement.get("clusters") or [], snap)
                    if c in snap.cluster_index
                )
            )
            if placement.get("clusters")
            else ()
        )
        if placement.get("clusters") and not clusters:
            clusters = (-1,)  # asked for clusters that do not exist (any more): fits nowhere
        model, models = (snap.model_index.get(model_id, NO_GPU) if model_id else NO_GPU), ()
        wanted = placement.get("gpuModels")
        if gpus and isinstance(wanted, list):  # any model: in the spec's order, else the queue's
            by_slug = {slug: i for i, slug in enumerate(snap.model_names)}
            models = (
                tuple(by_slug[m] for m in wanted if m in by_slug)
                if wanted
                else snap.queue_models.get(queue_id) or tuple(range(len(snap.model_names)))
            )
            model = ANY_MODEL if models else NO_GPU
        return JobView(
            id=pk,
            queue_id=queue_id,
            project_id=project_id,
            priority=priority,
            submitted_at=submitted.timestamp(),
            nodes=nodes,
            gpus=gpus,
            model=model,
            models=models,
            time_limit=float(time_limit) if time_limit else NEVER,
            preemptible=preemptible,
            cpu=cpu,
            memory=memory,
            clusters=clusters,
            selector=tuple(sorted((placement.get("nodeSelector") or {}).items())),
            attempts=attempts,
            version=version,
            owner=owner,
            per_user=snap.limits.limits_users(queue_id),
            array=array or 0,
            throttle=throttle if array and throttle else 0,
            slice=snap.profile_index.get(gpu_slice, UNKNOWN_SLICE) if gpu_slice and gpus else WHOLE,
            share_mb=share_mb or 0,
            share_milli=math.ceil(share * 1000) if share else 0,
            topology=str(placement.get("topology") or "") if nodes > 1 else "",
        )


@dataclass
class _Gpus:
    """The fleet's GPUs as the snapshot holds them (``_read_gpus``)."""

    model: np.ndarray
    total: np.ndarray
    free_bits: np.ndarray
    memory: np.ndarray
    ids: list[dict[int, int]]
    groups: list[dict[int, str]]
    profiles: list[str]
    instances: dict[int, list[tuple[int, int, int]]]
    mig_gpus: dict[int, set[int]]
    sick: dict[int, set[int]]
    shared: dict[int, dict[int, SharedGpu]]


def _read_gpus(row_of: dict[int, int], model_index: dict[int, int], n: int) -> _Gpus:
    """Every GPU and MIG instance, in two reads: whole GPUs into the free mask, GPUs in MIG mode
    as their instances, shareable GPUs also as fractions."""
    gpus = _Gpus(
        model=np.full(n, -1, dtype=np.int32),
        total=np.zeros(n, dtype=np.int32),
        free_bits=np.zeros(n, dtype=np.uint64),
        memory=np.zeros(n, dtype=np.int32),
        ids=[{} for _ in range(n)],
        groups=[{} for _ in range(n)],
        profiles=[],
        instances={},
        mig_gpus={},
        sick={},
        shared={},
    )
    parents: dict[int, tuple[int, int]] = {}  # GPU id in MIG mode → (row, index)
    changing = reconfiguring_gpus()  # kept out until their new MIG layout is reported
    for (
        device_id,
        node_id,
        index,
        model_id,
        health,
        group,
        mig,
        shareable,
        memory_mb,
    ) in GpuDevice.objects.values_list(
        "pk",
        "node_id",
        "index",
        "model_id",
        "health",
        "topology_group",
        "mig_enabled",
        "shareable",
        "memory_mb",
    ):
        row = row_of.get(node_id)
        if row is None or index >= 64:
            continue
        gpus.ids[row][index] = device_id
        if group:
            gpus.groups[row][index] = group
        if gpus.model[row] < 0 or index == 0:
            gpus.model[row] = model_index[model_id]
        gpus.memory[row] = max(int(gpus.memory[row]), memory_mb)
        healthy = health == GpuHealth.HEALTHY and (node_id, index) not in changing
        if not healthy and (mig or shareable):
            gpus.sick.setdefault(row, set()).add(index)
        if mig:
            gpus.mig_gpus.setdefault(row, set()).add(index)
            parents[device_id] = (row, index)
            continue
        if shareable:
            gpus.shared.setdefault(row, {})[index] = SharedGpu(memory_mb, healthy=healthy)
        if healthy:
            gpus.total[row] += 1
            gpus.free_bits[row] |= np.uint64(1 << index)
    if parents:
        found = [
            (inst, parents[gpu_id], profile)
            for inst, gpu_id, profile in MigInstance.objects.values_list("pk", "gpu_id", "profile")
            if gpu_id in parents
        ]
        gpus.profiles = sorted({profile for *_, profile in found})
        index_of = {p: i for i, p in enumerate(gpus.profiles)}
        for inst, (row, gpu), profile in found:
            gpus.instances.setdefault(row, []).append((inst, index_of[profile], gpu))
    return gpus


def _read_topology(snap: Snapshot, row_of: dict[int, int]) -> None:
    """Each node's block for topology-aware gangs: its switch, else its rack (labels
    ``topology.orrery.io/switch`` and ``…/rack`` stand in for empty fields)."""
    names: dict[str, int] = {}
    for pk, switch, rack, labels in Node.objects.values_list("pk", "switch", "rack", "labels"):
        labels = labels or {}
        name = (
            f"switch {switch or labels.get(SWITCH_LABEL, '')}"
            if switch or labels.get(SWITCH_LABEL)
            else f"rack {rack or labels.get(RACK_LABEL, '')}"
            if rack or labels.get(RACK_LABEL)
            else ""
        )
        row = row_of.get(pk)
        if name and row is not None:
            snap.block[row] = names.setdefault(name, len(names))
    snap.block_names = list(names)


SWITCH_LABEL = "topology.orrery.io/switch"
RACK_LABEL = "topology.orrery.io/rack"


def _rows_of(counted: list[Held]) -> tuple[tuple[int, int], ...]:
    """(row, GPUs held there) of one job, for backfill's timeline."""
    gpus: dict[int, int] = {}
    for h in counted:
        gpus[h.row] = gpus.get(h.row, 0) + (1 if h.whole_gpu and h.counted else 0)
    return tuple(gpus.items())


_ENDED_ON_ITS_OWN = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.TIMEOUT})


def _holding(counted: list[Held]) -> set[tuple[int, int | None, int, int]]:
    return {(h.node_id, h.gpu_id if h.gpu >= 0 else None, h.instance, h.share_mb) for h in counted}


_HELD_FIELDS = (
    "job_id",
    "node_id",
    "gpu_id",
    "cpu_millicores",
    "memory_bytes",
    "mig_instance_id",
    "gpu_memory_mb",
)


_VIEW_FIELDS = (
    "pk",
    "queue_id",
    "project_id",
    "priority",
    "submitted_at",
    "nodes",
    "gpus_per_node",
    "gpu_model_id",
    "cpu_millicores_per_node",
    "memory_bytes_per_node",
    "placement",
    "attempt_count",
    "version",
    "time_limit_s",
    "preemptible",
    "owner_id",
    "array_id",
    "array_throttle",
    "gpu_slice",
    "gpu_memory_mb",
    "gpu_share",
)


def _queue_limits() -> tuple[dict[int, int], dict[int, int]]:
    """Per queue that has them: running jobs per user, GPUs per user (a small read, every sync:
    an operator's new limit holds from the next cycle)."""
    max_jobs, max_gpus = {}, {}
    for pk, jobs, gpus in Queue.objects.filter(
        Q(max_running_jobs_per_user__isnull=False) | Q(max_gpus_per_user__isnull=False)
    ).values_list("pk", "max_running_jobs_per_user", "max_gpus_per_user"):
        if jobs is not None:
            max_jobs[pk] = jobs
        if gpus is not None:
            max_gpus[pk] = gpus
    return max_jobs, max_gpus


def _model_order(
    preference: list[str], by_slug: dict[str, int], queue_id: int, quota: QuotaBook
) -> tuple[int, ...]:
    """The models an any-model job of a queue tries, best first: the queue's preference, then
    the models it has quota for, then every other (a queue with quota rows takes only those)."""
    order = [by_slug[m] for m in preference if m in by_slug]
    with_quota = sorted(m for q, m in quota.nominal if q == queue_id)
    order += [m for m in with_quota if m not in order]
    if queue_id not in quota.limited:
        order += [m for m in range(len(by_slug)) if m not in order]
    return tuple(order)


def _cluster_pks(names: list[str], snap: Snapshot) -> list[int]:
    by_name = dict(zip(snap.cluster_names, snap.cluster_ids, strict=True))
    return [by_name[n] for n in names if n in by_name]


_cache: SchedulerCache | None = None
_cache_lock = threading.Lock()


def scheduler_cache() -> SchedulerCache:
    """The process's scheduler cache, created on first use; every cycle of the process shares it."""
    global _cache
    with _cache_lock:
        if _cache is None:
            _cache = SchedulerCache()
        return _cache
