"""Energy-aware placement: for equal fit, the node where the work costs the least energy, money
and carbon, and leaves whole nodes idle so they can sleep."""

from __future__ import annotations

import numpy as np

from scheduling.engine.framework import CycleState, JobView
from scheduling.engine.snapshot import Snapshot

NEUTRAL = 0.5  # what a row scores on a term whose fact is unknown
_CACHE = "energy.static"


class Energy:
    """Score: higher where the job's energy is cheaper and cleaner, in [0, 1].

    Four terms, each in [0, 1], weighted by the arguments of the same names (default 1 each):

    * ``performance_per_watt`` — the row's GPU model's relative throughput per watt of TDP
      (``snap.perf_per_watt``) over the fleet's best: work done per joule. The rows one job is
      scored over share its model today (an any-model job is tried one model at a time), so the
      term decides nothing yet; it counts where rows of several models are compared.
    * ``price`` — ``1 − (price − cheapest) / dearest`` over the fleet's clusters' energy price per
      kWh: 1 on the cheapest cluster, lower the dearer.
    * ``carbon`` — the same over the clusters' carbon intensity (g CO₂ per kWh).
    * ``consolidation`` — 1 on a node already partly in use (some of its whole GPUs, MIG
      instances or shared GPUs' memory handed out), 0 on an idle one: fill what is awake and keep
      whole nodes idle, for a cluster with ``power_saving`` to put to sleep.

    An unknown fact (a model without a TDP or throughput, a cluster without a price or carbon
    intensity) scores ``NEUTRAL`` on its term: neither sought nor avoided. The score is the terms'
    weighted mean. The first three facts do not change within a cycle and are computed once a
    cycle for the whole fleet; consolidation follows the cycle's placements.
    """

    name = "energy"

    def __init__(
        self,
        performance_per_watt: float = 1.0,
        price: float = 1.0,
        carbon: float = 1.0,
        consolidation: float = 1.0,
    ) -> None:
        weights = (performance_per_watt, price, carbon, consolidation)
        if not all(isinstance(w, int | float) and not isinstance(w, bool) and 0 <= w < 1e6 for w in weights):
            raise TypeError("performance_per_watt, price, carbon, consolidation are numbers ≥ 0 and < 1e6")
        if not sum(weights):
            raise TypeError("at least one of the weights must be more than 0")
        self.weights = tuple(float(w) for w in weights)
        self.consolidation = float(consolidation)

    def score(self, state: CycleState, snap: Snapshot, job: JobView, rows: np.ndarray) -> np.ndarray:
        cached = state.data.get(_CACHE)
        if cached is None or cached[0] is not snap:
            cached = (snap, self.fleet_facts(snap))
            state.data[_CACHE] = cached
        total = cached[1][rows]
        if self.consolidation:
            total = total + self.consolidation * in_use(snap, rows)
        return total / sum(self.weights)

    def fleet_facts(self, snap: Snapshot) -> np.ndarray:
        """Every row's weighted sum of the three terms that do not change within a cycle."""
        per_watt, price, carbon = self.weights[:3]
        total = np.zeros(len(snap))
        if per_watt:
            ppw = snap.perf_per_watt.astype(np.float64)
            known = ppw > 0  # NaN compares False
            best = ppw[known].max(initial=0.0)
            total += per_watt * np.where(known, ppw / best if best else NEUTRAL, NEUTRAL)
        for weight, column in ((price, snap.price), (carbon, snap.carbon)):
            if weight:
                total += weight * cheaper(column.astype(np.float64))
        return total


def cheaper(values: np.ndarray) -> np.ndarray:
    """``1 − (value − lowest) / highest`` over the known values (≥ 0), ``NEUTRAL`` where unknown:
    1 at the lowest, and a gap that counts by how large it is next to the highest."""
    known = values >= 0  # NaN compares False
    if not known.any():
        return np.full(len(values), NEUTRAL)
    lowest, highest = values[known].min(), values[known].max()
    if not highest:
        return np.where(known, 1.0, NEUTRAL)
    return np.where(known, 1.0 - (values - lowest) / highest, NEUTRAL)


def in_use(snap: Snapshot, rows: np.ndarray) -> np.ndarray:
    """1.0 where some of the row's GPUs are handed out — whole, as MIG instances or as shared
    memory — else 0.0. (CPU-only use is not seen: the snapshot keeps no cpu total.)"""
    used = snap.gpu_free[rows] < snap.gpu_total[rows]
    if snap.mig_profiles:
        used |= (snap.mig_free[rows] < snap.mig_total[rows]).any(axis=1)
    if snap.shared:
        used |= snap.share_free[rows] < snap.share_cap[rows]
    return used.astype(np.float64)
