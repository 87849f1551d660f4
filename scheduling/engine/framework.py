"""The scheduling framework: extension points, statuses and per-cycle state.

Shaped like the Kubernetes scheduler framework, but **columnar**: a Filter returns a boolean mask
over snapshot rows and a Score returns a vector, so deciding one job costs a few array
operations over the fleet, not a Python call per node. A plugin gets the cycle state, the
snapshot and the job, and returns a value; it never loops over nodes in Python, never touches
the ORM, an adapter or the scheduler object.

Rows: a plugin is asked about ``rows`` — an index array into the snapshot — and answers for
those rows only, in the same order. The cycle asks about the whole fleet once per equivalence
class and then only about rows that changed.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from scheduling.engine.snapshot import Snapshot


class Code(enum.IntEnum):
    SUCCESS = 0
    UNSCHEDULABLE = 1  # not now: try again when capacity or quota changes
    ERROR = 2
    # Not now, and no room made or held for it would help: a per-user limit or an array's
    # throttle. Post-filters (preemption, backfill's reservations, quota claims) leave it alone.
    UNRESOLVABLE = 3


@dataclass(frozen=True)
class Status:
    code: Code = Code.SUCCESS
    reason: str = ""  # a PendingReason value
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.code == Code.SUCCESS


OK = Status()


# What makes jobs interchangeable to every filter (``JobView.shape``): queue, nodes, GPUs per
# node, model, cpu, memory, allowed clusters, node selector, time limit (backfill compares it
# with reservations), the models an any-model job accepts, and what limits count it against:
# (its owner where its queue limits users, its array where the array is throttled; else 0), and
# how it takes GPUs (MIG profile, shared memory, shared fraction, a gang's topology).
# Jobs of one shape form one class.
Shape = tuple[
    int,
    int,
    int,
    int,
    int,
    int,
    tuple[int, ...],
    tuple[tuple[str, str], ...],
    float,
    tuple[int, ...],
    tuple[int, int],
    tuple[int, int, int, str],
]
NO_GPU = -1  # JobView.model of a job that asks for no GPU
WHOLE = -1  # JobView.slice of a job that takes whole GPUs (or a fraction of a shared one)
UNKNOWN_SLICE = -2  # JobView.slice of a job asking for a MIG profile no GPU of the fleet has
TOPOLOGY_REQUIRED, TOPOLOGY_PREFERRED = "required", "preferred"  # a gang's placement.topology
ANY_MODEL = -2  # JobView.model of a job that takes any of ``models``, in that order
NEVER = float("inf")  # the end of a job without a time limit


@dataclass(frozen=True)
class JobView:
    """What the scheduler knows of a pending job: its shape in snapshot terms."""

    id: int
    queue_id: int
    project_id: int
    priority: int
    submitted_at: float
    nodes: int
    gpus: int  # per node
    model: int  # snapshot model index; NO_GPU, or ANY_MODEL (then ``models`` says which, in order)
    cpu: int  # millicores per node
    memory: int  # bytes per node
    clusters: tuple[int, ...] = ()  # snapshot cluster indices allowed; empty = any
    selector: tuple[tuple[str, str], ...] = ()
    attempts: int = 0
    version: int = 0
    time_limit: float = NEVER  # seconds
    preemptible: bool = True
    models: tuple[int, ...] = ()  # an any-model job's acceptable models, best first
    owner: int = 0  # its owner's user id
    per_user: bool = False  # its queue limits running jobs or GPUs per user (``user_limits``)
    array: int = 0  # the array it is a member of (``Job.array_id``); 0: none
    throttle: int = 0  # at most this many members of ``array`` hold resources at once; 0: no cap
    slice: int = WHOLE  # a MIG profile (index into ``Snapshot.mig_profiles``): ``gpus`` instances of it
    share_mb: int = 0  # one fraction of a shareable GPU per node, by memory (MiB) …
    share_milli: int = 0  # … or by share of the GPU (thousandths)
    topology: str = ""  # a gang's "required" or "preferred" keeping to one switch or rack

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus

    @property
    def shared(self) -> bool:
        """It takes a fraction of a shareable GPU on each node."""
        return bool(self.share_mb or self.share_milli)

    @property
    def fractional(self) -> bool:
        """It takes less than whole GPUs (MIG instances or a shared fraction)."""
        return self.slice != WHOLE or self.shared

    def as_model(self, model: int) -> JobView:
        """This job asking for ``model`` exactly: how an any-model job is tried, one model at a time."""
        return replace(self, model=model, models=())

    def shape(self) -> Shape:
        """Jobs with equal shapes are interchangeable to every filter: one equivalence class."""
        return (
            self.queue_id,
            self.nodes,
            self.gpus,
            self.model,
            self.cpu,
            self.memory,
            self.clusters,
            self.selector,
            self.time_limit,
            self.models,
            # Limits count per owner and per array: jobs of two owners (or arrays) are
            # interchangeable only where no limit tells them apart — classes split only there.
            (self.owner if self.per_user else 0, self.array if self.throttle else 0),
            (self.slice, self.share_mb, self.share_milli, self.topology),
        )


@dataclass(frozen=True)
class NodeChoice:
    """One node of a placement: the GPU indices it takes there. A MIG job's ``instances`` are
    the MIG instance ids (``gpu_indices`` then name their parent GPUs, one per instance); a
    shared-GPU job's ``share_mb`` is the memory it takes of ``gpu_indices[0]``."""

    row: int
    gpu_indices: tuple[int, ...]
    instances: tuple[int, ...] = ()
    share_mb: int = 0


@dataclass(frozen=True)
class Placement:
    """A decision: the job, its cluster and nodes, and the id its attempt will have. The id is
    chosen with the decision, so a cache can recognise the attempt's events whichever connection
    commits it, and whenever (``SchedulerCache.placed_by_us``)."""

    job: JobView
    cluster: int  # snapshot cluster index
    nodes: tuple[NodeChoice, ...]
    attempt: uuid.UUID = field(default_factory=uuid.uuid4)


@dataclass
class CycleState:
    """Scratch space of one cycle, shared by plugins (keyed by plugin name)."""

    epoch: int = 0
    data: dict[Hashable, Any] = field(default_factory=dict)


# --- extension points -----------------------------------------------------------------------


@runtime_checkable
class Plugin(Protocol):
    name: ClassVar[str]


@runtime_checkable
class QueueSortPlugin(Plugin, Protocol):
    def sort_key(self, state: CycleState, snap: Snapshot, job: JobView) -> tuple[Any, ...]:
        """Smaller keys go first."""


@runtime_checkable
class PreFilterPlugin(Plugin, Protocol):
    def pre_filter(self, state: CycleState, snap: Snapshot, job: JobView) -> Status:
        """Admission before looking at nodes (per-user limits, quota, gang feasibility)."""


@runtime_checkable
class FilterPlugin(Plugin, Protocol):
    """A filter whose verdict depends on what is free now (not only on what a node is) sets the
    class attribute ``capacity = True``: backfill leaves such filters out when it asks where a
    job could run once capacity frees up. The others' masks are kept between cycles and asked
    again only for rows in ``snap.changed``, never after a placement within a cycle."""

    def filter(self, state: CycleState, snap: Snapshot, job: JobView, rows: np.ndarray) -> np.ndarray:
        """A boolean mask over ``rows``: True where the node may take the job."""

    def explain(self, job: JobView, snap: Snapshot, refused: int) -> str:
        """Words for ``refused`` nodes that this filter ruled out, e.g. '9,800 lack 8 free h100'."""


@runtime_checkable
class ScorePlugin(Plugin, Protocol):
    def score(self, state: CycleState, snap: Snapshot, job: JobView, rows: np.ndarray) -> np.ndarray:
        """A float vector over ``rows``, higher is better, in [0, 1]; weights are the framework's."""


@runtime_checkable
class ReservePlugin(Plugin, Protocol):
    def reserve(self, state: CycleState, snap: Snapshot, placement: Placement) -> Status: ...

    def unreserve(self, state: CycleState, snap: Snapshot, placement: Placement) -> None: ...


@runtime_checkable
class PostFilterPlugin(Plugin, Protocol):
    def post_filter(self, state: CycleState, snap: Snapshot, job: JobView) -> Status:
        """Called when the job cannot be placed now (its quota or no node fits): preemption and
        backfill's reservations live here; never for a job a pre-filter refused ``UNRESOLVABLE``
        (a limit). OK with no message: nothing to add; a status with a message: words appended
        to the job's pending reason ("would start ≈ 14:20 on sim-b")."""
