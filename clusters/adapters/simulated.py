"""Simulated clusters: thousands of nodes for demos and scale tests, and jobs that run no
command. A job starts the moment it is delivered and ends ``Simulation.duration_s`` after it
started, with ``Simulation.exit_code`` (``spec.sim`` of the job; ``ORRERY_SIM_DEFAULT_DURATION_S``
when it says nothing). Nodes report like any others, through the agent API (a heartbeat traffic
generator drives them in the demo and the benchmarks). A preempted job has no process to drain:
it ends as preempted at the next sync. Nodes "power down" (``SupportsPowerSaving``) at once:
there is no machine to switch off.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import ClassVar

from django.conf import settings

from clusters.adapters.base import Inventory, Phase, RemoteState, Sent, Simulation, Synced, Work
from clusters.adapters.native import registered_inventory
from clusters.choices import ClusterKind
from clusters.models import Cluster

# A stored duration is clamped to this (ten years): one beyond a float's range (10**400 seconds)
# would raise OverflowError on every pass and stop every other job of the cluster from ending.
MAX_DURATION_S = 10 * 366 * 86400


class SimulatedAdapter:
    kind: ClassVar[str] = ClusterKind.SIMULATED
    runs_images: ClassVar[bool] = True  # nothing runs: any image "runs"
    image_label: ClassVar[str | None] = None
    needs_image: ClassVar[bool] = False
    shares_node_network: ClassVar[bool] = False  # nothing listens
    runs_user_code: ClassVar[bool] = False
    pulls_inventory: ClassVar[bool] = False
    inventory_every_s: ClassVar[float] = 10.0
    dispatch_batch: ClassVar[int] = 20_000  # as many as one cycle places
    sync_every_s: ClassVar[float | None] = 1.0

    def inventory(self, cluster: Cluster) -> Inventory:
        return registered_inventory(cluster)

    def dispatch(self, cluster: Cluster, works: Sequence[Work]) -> list[Sent]:
        return [
            Sent(w.attempt_id, phase=Phase.RUNNING, message="started on a simulated cluster") for w in works
        ]

    def sync(self, cluster: Cluster, works: Sequence[Work]) -> Synced:
        """Ends what has run its course; says when the next job ends if before the next pass."""
        now = time.time()
        states, soonest = [], None
        for work in works:
            if work.stop is not None:  # preempted: nothing runs, so nothing to drain
                states.append(
                    RemoteState(work.attempt_id, Phase.PREEMPTED, message="stopped on a simulated cluster")
                )
                continue
            if work.started_at is None:
                continue  # not started yet: its delivery starts it
            sim = work.simulation
            code = 0 if sim is None else sim.exit_code
            end = work.started_at + _duration_s(sim)
            if end > now:
                soonest = end if soonest is None else min(soonest, end)
            elif code:
                states.append(
                    RemoteState(
                        work.attempt_id,
                        Phase.FAILED,
                        exit_code=code,
                        message=f"exit code {code} on a simulated cluster",
                    )
                )
            else:
                states.append(
                    RemoteState(
                        work.attempt_id,
                        Phase.SUCCEEDED,
                        exit_code=0,
                        message="finished on a simulated cluster",
                    )
                )
        return Synced(states=states, again_in_s=None if soonest is None else soonest - time.time())

    def cancel(self, cluster: Cluster, remote_ids: Sequence[str]) -> int:
        return 0  # nothing runs: a cancelled attempt is no longer asked about

    def power_down(self, cluster: Cluster, node: str) -> None:
        """Nothing to switch off (``SupportsPowerSaving``): powering a simulated node down is
        Orrery's own bookkeeping alone, so demos and scale tests can show power saving."""

    def power_up(self, cluster: Cluster, node: str) -> None:
        """Nothing to switch on (``SupportsPowerSaving``)."""


def _duration_s(sim: Simulation | None) -> float:
    """How long the job runs, within ``[0, MAX_DURATION_S]``, whatever was stored: the cluster's
    default when the job says nothing (or something that is not a number)."""
    value = None if sim is None else sim.duration_s
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:  # NaN
        return float(settings.ORRERY_SIM_DEFAULT_DURATION_S)
    # int and float compare exactly, without converting: no OverflowError for 10**400.
    return float(min(max(value, 0), MAX_DURATION_S))
