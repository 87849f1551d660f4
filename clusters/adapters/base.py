"""The one interface every kind of cluster answers, and the plain values it speaks.

An adapter makes a cluster do what the scheduler decided and says what the cluster did. It
never touches the scheduling app: it takes ``Work`` (what to run where) and gives back
``Sent`` (what became of a delivery), ``RemoteState`` (what the cluster says about an attempt)
and ``LogChunk`` (output the cluster kept). Turning those into job transitions, outbox
bookkeeping and stored logs is the kind-agnostic side's job (``scheduling/dispatch/``), in one
place for every kind.

The operations, each idempotent:

* ``inventory(cluster)`` refreshes the cluster's nodes and GPUs (pulled from the cluster's own
  API where it has one; native and simulated nodes report themselves through the agent API)
  and says what it saw;
* ``dispatch(cluster, works)`` starts each attempt on the nodes chosen for it and yields a
  ``Sent`` for each as soon as it is known (the dispatcher records them as they come, so a crash
  mid-batch forgets little). The remote job is named after the attempt id, so a delivery
  retried after a crash finds what it already created;
* ``sync(cluster, works)`` reads the cluster's view of the attempts Orrery considers active
  there (``works``), plus the jobs it still runs for attempts Orrery no longer wants
  (``Synced.orphans``: the dispatcher cancels those — cancelling is level-triggered);
* ``cancel(cluster, remote_ids)`` stops jobs on the cluster; returns how many it stopped.

A kind that can ask a running job to stop on its own — a signal, then a grace period before the
cluster kills it, what a preemption needs — also answers ``SupportsSignal``; for any other kind
``signal_or_cancel`` cancels at once.

A kind that can switch idle nodes off and on again answers ``SupportsPowerSaving``
(``power_saving_of``); power-saving recommendations are acted on only there
(``clusters.services.power``).

Adding a kind is one module beside this one, one line in ``registry.py`` and one parameter of
the contract suite (``tests/test_adapters.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from clusters.models import Cluster


class Phase(enum.StrEnum):
    """Where an attempt stands on its cluster, in the cluster-neutral terms adapters use."""

    QUEUED = "queued"  # accepted, waiting in the cluster's own queue
    HELD = "held"  # held in the cluster's own queue
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"

    @property
    def ended(self) -> bool:
        return self in _ENDED


_ENDED = frozenset({Phase.SUCCEEDED, Phase.FAILED, Phase.TIMEOUT, Phase.CANCELLED, Phase.PREEMPTED})


@dataclass(frozen=True)
class Share:
    """One node's part of an attempt: the node and the indices of its GPUs the attempt holds.

    Smaller than whole GPUs: ``mig_profile`` set, the attempt holds MIG instances of that
    profile — ``gpu_indices`` are their parent GPUs (one entry per instance) and ``mig_uuids``
    the instances' UUIDs, what ``CUDA_VISIBLE_DEVICES`` names; ``gpu_memory_mb`` > 0, it holds
    that much of the shared GPU ``gpu_indices[0]`` (and ``gpu_share`` is that as a fraction of
    the GPU's memory)."""

    node_id: int
    node: str
    gpu_indices: tuple[int, ...]
    mig_profile: str = ""
    mig_uuids: tuple[str, ...] = ()
    gpu_memory_mb: int = 0
    gpu_share: float = 0.0


@dataclass(frozen=True)
class Simulation:
    """How a job on a simulated cluster behaves: it runs ``duration_s`` (None: the cluster's
    default) and exits ``exit_code``."""

    duration_s: float | None
    exit_code: int


@dataclass(frozen=True)
class Stop:
    """A preemption of a running attempt: send ``signal`` (a name without ``SIG``: ``TERM``,
    ``USR1``…), then kill it once ``grace_s`` seconds have passed since ``requested_at`` (epoch
    seconds). ``signalled_at`` is when a polled cluster's job was sent the signal (None: not yet)."""

    signal: str
    grace_s: int
    requested_at: float
    signalled_at: float | None = None

    @property
    def deadline(self) -> float:
        return self.requested_at + self.grace_s


@dataclass(frozen=True)
class Work:
    """One attempt as its cluster must run it: where, what, for how long.

    ``shares`` are ordered by node id: the first is a gang's head (rank 0). ``remote_id`` is the cluster's own
    id once dispatched; ``started_at`` (epoch seconds) is set once the attempt runs.
    """

    attempt_id: str
    job_id: int
    number: int
    epoch: int
    script: str
    env: Mapping[str, str]
    shares: tuple[Share, ...]
    time_limit_s: int | None = None
    remote_id: str = ""
    started_at: float | None = None
    simulation: Simulation | None = None
    #: The POSIX account the attempt runs as (``clusters.services.identity``): a name, ""
    #: for the cluster's shared service account, None when the user has no account there.
    run_as: str | None = ""
    #: A container image to run the script in ("" for none); an empty script runs the image's
    #: own command.
    image: str = ""
    #: What the job asked for on each node (0: nothing asked), for limits where a kind sets them.
    cpu_millicores: int = 0
    memory_bytes: int = 0
    #: The names in ``env`` whose values are secret (the job's ``secretEnv``): a kind that can
    #: keep them apart from the job's definition does (Kubernetes: a Secret object).
    secret_names: frozenset[str] = frozenset()
    #: Set when the attempt was preempted: it is to stop (``Stop``), never to start.
    stop: Stop | None = None
    #: The port agreed for the attempt's head (``MASTER_PORT``), chosen when its start is
    #: dispatched; None for a kind that runs no user code.
    master_port: int | None = None

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(s.node for s in self.shares)

    @property
    def gpus_per_node(self) -> int:
        return len(self.shares[0].gpu_indices) if self.shares else 0


@dataclass(frozen=True)
class Sent:
    """What became of one delivery. ``error`` set: not delivered, tried again later. ``phase``
    set: the cluster already moved the attempt (a simulated cluster starts it at once)."""

    attempt_id: str
    remote_id: str = ""
    error: str = ""
    phase: Phase | None = None
    message: str = ""


@dataclass(frozen=True)
class LogChunk:
    """Output of an attempt on one node: ``data`` starts at byte ``offset`` of that stream."""

    attempt_id: str
    node: str
    offset: int
    data: str


@dataclass(frozen=True)
class RemoteState:
    """What a cluster says about one attempt.

    ``message`` explains it in words (an exit, or why the cluster keeps it queued). ``head`` is
    False for a report from a gang member other than the head: its success does not end the job.
    ``started_at`` (epoch seconds) is given by clusters whose own time limits are coarser than
    Orrery's, so the dispatcher enforces the job's limit to the second.
    """

    attempt_id: str
    phase: Phase
    remote_id: str = ""
    exit_code: int | None = None
    message: str = ""
    head: bool = True
    started_at: float | None = None


@dataclass(frozen=True)
class Orphan:
    """A job the cluster still runs under an attempt's name that Orrery did not ask about."""

    attempt_id: str
    remote_id: str


@dataclass(frozen=True)
class Synced:
    """The answer of one ``sync``: states of the attempts asked about, output, orphans, and when
    to ask again if sooner than the periodic pass (a simulated job ending in 300 ms)."""

    states: Sequence[RemoteState] = ()
    output: Sequence[LogChunk] = ()
    orphans: Sequence[Orphan] = ()
    again_in_s: float | None = None


@dataclass(frozen=True)
class Inventory:
    """What one inventory pass saw."""

    nodes: int
    gpus: int
    unknown_gpu_types: tuple[str, ...] = field(default=())


class ClusterAdapter(Protocol):
    """One kind of cluster. Implementations are stateless; every call names its cluster."""

    kind: ClassVar[str]
    #: True when inventory is read from the cluster's own API (periodically); False when nodes
    #: register and report themselves through the agent API.
    pulls_inventory: ClassVar[bool]
    #: How often a pulled inventory is taken (seconds): the periodic task beats faster and each
    #: kind keeps its own pace (a watched cluster's pass reads memory; a polled one asks its API).
    inventory_every_s: ClassVar[float]
    #: How often the cluster is synced (seconds); None when it pushes its reports itself.
    sync_every_s: ClassVar[float | None]
    #: At most this many attempts are handed to one ``dispatch`` call.
    dispatch_batch: ClassVar[int]
    #: Whether a job given as a container image (``spec.image``) can run there.
    runs_images: ClassVar[bool]
    #: When set, only the nodes carrying this label run images (agents that have podman).
    image_label: ClassVar[str | None]
    #: Whether only container images run there: a job given as a bare ``run`` is refused.
    needs_image: ClassVar[bool]
    #: Whether users' code really runs there, under a POSIX account (``Work.run_as``); a kind
    #: that only pretends needs no account.
    runs_user_code: ClassVar[bool]
    #: Whether the attempts on one node share its network (native agents, Slurm): the head of
    #: each gang then needs a port of its own there. False where each attempt has its own
    #: network namespace (a Kubernetes pod): every head listens on the same port.
    shares_node_network: ClassVar[bool]

    def inventory(self, cluster: Cluster) -> Inventory: ...

    def dispatch(self, cluster: Cluster, works: Sequence[Work]) -> Iterable[Sent]: ...

    def sync(self, cluster: Cluster, works: Sequence[Work]) -> Synced: ...

    def cancel(self, cluster: Cluster, remote_ids: Sequence[str]) -> int: ...


class SupportsSignal(Protocol):
    """A kind whose running jobs can be asked to stop on their own (a preemption)."""

    def signal(self, cluster: Cluster, remote_ids: Sequence[str], signal: str, grace_s: int) -> int:
        """Send ``signal`` to every process of each job (its batch shell and what it started),
        or begin a stop that kills them ``grace_s`` seconds later where the cluster decides the
        signal itself (Kubernetes). Returns how many jobs it reached; a job that ended meanwhile
        is logged and the rest go on."""
        ...


class SupportsReadBack(Protocol):
    """A kind that can read back a few of its jobs without reading them all: a cluster that
    rings when a job ends (``agent/ended``) is answered with this rather than a whole sync."""

    def read_back(self, cluster: Cluster, works: Sequence[Work]) -> Synced:
        """States and output of these works' jobs only, found by their remote ids (no orphans:
        the whole sync finds those; a job the cluster does not list is left to it as well).
        ``again_in_s`` is set while one of them has ended but is still being cleaned up there,
        so its final state is not known yet."""
        ...


def signal_or_cancel(
    adapter: ClusterAdapter, cluster: Cluster, remote_ids: Sequence[str], signal: str, grace_s: int
) -> int:
    """Signal jobs where the kind can (``SupportsSignal``); cancel them at once elsewhere."""
    send = getattr(adapter, "signal", None)  # looked up each time, never cached per class
    if callable(send):
        return send(cluster, remote_ids, signal, grace_s)
    return adapter.cancel(cluster, remote_ids)


class SupportsPowerSaving(Protocol):
    """A kind that can power idle nodes down and back up (Slurm's power saving)."""

    def power_down(self, cluster: Cluster, node: str) -> None:
        """Switch the node off (or ask the cluster to). Raises ``AdapterError`` saying why when
        the cluster refuses or cannot be asked; returning means the cluster took the request.
        Idempotent: a node already off stays off."""
        ...

    def power_up(self, cluster: Cluster, node: str) -> None:
        """Switch the node back on; the same contract as ``power_down``."""
        ...


def power_saving_of(adapter: ClusterAdapter) -> SupportsPowerSaving | None:
    """The adapter as ``SupportsPowerSaving`` where its kind can power nodes, else None."""
    if callable(getattr(adapter, "power_down", None)) and callable(getattr(adapter, "power_up", None)):
        return adapter  # type: ignore[return-value]
    return None


class AdapterError(Exception):
    """The cluster could not be reached or refused a request; the pass is tried again later."""
