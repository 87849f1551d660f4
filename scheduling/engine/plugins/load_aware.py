"""Load-aware placement: keep new work off hot nodes (hot-spot avoidance, as Koordinator's
load-aware scheduling does for CPU nodes).

Allocation says which GPUs are free; telemetry says how the node is actually doing: a node whose
GPUs run hot throttles their clocks, and one whose shared GPUs are busy or whose memory is
nearly full slows every job on it. The plugin reads the snapshot's exponential averages
(``scheduling.engine.telemetry``) — GPU utilisation, memory in use, the hottest GPU's
temperature — and scores each row by how cool it is.
"""

from __future__ import annotations

import numpy as np

from scheduling.engine.framework import CycleState, JobView
from scheduling.engine.snapshot import Snapshot

NEUTRAL = 0.5  # what a row scores on a term it has no fresh reading of
_CACHE = "load_aware.scores"


class LoadAware:
    """Score: higher on cooler nodes, in [0, 1].

    Three terms, each in [0, 1], higher cooler: ``1 − utilisation/100``, ``1 − memory in use``
    (fraction of the node's GPU memory) and ``1 − temperature/hot_temperature_c``; the score is
    their mean weighted by ``utilisation``, ``memory`` and ``temperature``. A node at or above
    ``hot_temperature_c`` is a hot spot and scores 0 whatever its other terms (its GPUs throttle:
    work placed there runs slower), unless the temperature weight is 0.

    A row whose reading is older than ``stale_after_s`` (or that never reported) scores
    ``NEUTRAL`` on every term, and a fresh reading missing one average scores it on that term: a
    stale reading may be a cool node that has since filled up or a hot one that has since cooled,
    so it is trusted neither way — the row is neither sought nor avoided, and the other scores
    decide. A fleet without telemetry so scores the same everywhere and placements are as
    without the plugin.

    The averages change between cycles, not within one: the fleet's scores are computed once a
    cycle (kept in the cycle state) and each call only picks its rows. Placements of the cycle do
    not show in the readings until the next telemetry arrives.
    """

    name = "load_aware"

    def __init__(
        self,
        utilisation: float = 1.0,
        memory: float = 1.0,
        temperature: float = 1.0,
        hot_temperature_c: float = 85.0,
        stale_after_s: float = 180.0,
    ) -> None:
        weights = (utilisation, memory, temperature)
        if not all(isinstance(w, int | float) and not isinstance(w, bool) and 0 <= w < 1e6 for w in weights):
            raise TypeError("utilisation, memory and temperature are weights: numbers ≥ 0 and < 1e6")
        if not sum(weights):
            raise TypeError("at least one of utilisation, memory and temperature must weigh more than 0")
        for name, value in (("hot_temperature_c", hot_temperature_c), ("stale_after_s", stale_after_s)):
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < 1e6:
                raise TypeError(f"{name} is a number > 0 and < 1e6")
        self.weights = tuple(float(w) for w in weights)
        self.hot = float(hot_temperature_c)
        self.stale_after_s = float(stale_after_s)

    def score(self, state: CycleState, snap: Snapshot, job: JobView, rows: np.ndarray) -> np.ndarray:
        cached = state.data.get(_CACHE)
        if cached is None or cached[0] is not snap:
            cached = (snap, self.fleet_scores(snap, state.data["now"]))
            state.data[_CACHE] = cached
        return cached[1][rows]

    def fleet_scores(self, snap: Snapshot, now: float) -> np.ndarray:
        """Every row's score at ``now`` (epoch seconds)."""
        at = snap.telemetry_at
        fresh = (at > 0) & (now - at <= self.stale_after_s)
        temp = snap.temp.astype(np.float64)
        terms = (
            1.0 - np.clip(snap.util.astype(np.float64) / 100.0, 0.0, 1.0),
            1.0 - np.clip(snap.mem_used.astype(np.float64), 0.0, 1.0),
            1.0 - np.clip(temp / self.hot, 0.0, 1.0),
        )
        total = np.zeros(len(snap))
        for weight, term in zip(self.weights, terms, strict=True):
            if weight:
                total += weight * np.where(fresh & ~np.isnan(term), term, NEUTRAL)
        scores = total / sum(self.weights)
        if self.weights[2]:
            scores[fresh & (temp >= self.hot)] = 0.0  # NaN compares False: unknown is not hot
        return scores
