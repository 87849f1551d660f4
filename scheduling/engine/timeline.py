"""When GPUs come free: the timeline behind backfill's reservations and predicted start times.

Every job holding GPUs releases them at its end — its start plus its time limit for a
reservation (a promise: no job runs past its limit), or its expected end for a prediction (the
part of their limit its queue's jobs actually use, learned as they end) — and a preempted job at
the end of its grace period. A ``Timeline`` keeps those releases as three arrays sorted by
(row, time), so "the earliest time each node has 8 free GPUs" is a grouped cumulative sum and one
``np.unique``, whatever the fleet's size: no loop over nodes in Python.

Jobs given a start on the timeline in this cycle (``claim``) hold their GPUs from now until
their own end. That is pessimistic before their start — another job could use those GPUs in
between — which only makes later estimates later; the rows they touch are few and are merged
in Python.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduling.engine.framework import NEVER, JobView
from scheduling.engine.snapshot import Snapshot


@dataclass(frozen=True)
class Slot:
    """Where and when a job can start: ``rows`` of one cluster, each with its GPUs free at ``start``."""

    start: float
    cluster: int
    rows: tuple[int, ...]


class Timeline:
    def __init__(self, snap: Snapshot, ends: list[tuple[float, tuple[tuple[int, int], ...]]], now: float):
        """``ends``: for each job holding GPUs, when it releases them and (row, GPUs) it holds."""
        self.snap, self.now = snap, now
        count = sum(len(rows) for _, rows in ends)
        row = np.empty(count, dtype=np.int64)
        at = np.empty(count, dtype=np.float64)
        gpus = np.empty(count, dtype=np.int64)
        k = 0
        for end, rows in ends:
            for r, g in rows:
                row[k], at[k], gpus[k] = r, end, g
                k += 1
        keep = gpus > 0
        row, at, gpus = row[keep], np.maximum(at[keep], now), gpus[keep]
        order = np.lexsort((at, row))
        self.row, self.at, self.gpus = row[order], at[order], gpus[order]
        self.held = np.zeros(len(snap), dtype=np.int64)  # GPUs claimed by jobs given a start
        self.extra: dict[int, list[tuple[float, int]]] = defaultdict(list)  # their releases

    def fresh(self, now: float) -> Timeline:
        """The same releases, no claims yet: a cycle's own copy (the arrays are shared, unchanged)."""
        copy = object.__new__(Timeline)
        copy.snap, copy.now = self.snap, now
        copy.row, copy.at, copy.gpus = self.row, np.maximum(self.at, now), self.gpus
        copy.held = np.zeros(len(self.snap), dtype=np.int64)
        copy.extra = defaultdict(list)
        return copy

    def released_by(self, row: int, when: float) -> int:
        """GPUs of ``row`` released at or before ``when`` (running jobs' and claimed jobs' ends)."""
        lo, hi = np.searchsorted(self.row, [row, row + 1])
        base = int(self.gpus[lo:hi][self.at[lo:hi] <= when].sum())
        return base + sum(g for t, g in self.extra.get(row, ()) if t <= when)

    def earliest(self, job: JobView, candidates: np.ndarray) -> Slot | None:
        """The earliest time ``job`` fits on rows where ``candidates`` (a mask over all rows) is
        True, and those rows (one for a single-node job, ``job.nodes`` of one cluster for a
        gang); None if it never does (more GPUs than any node has, or jobs without limits)."""
        snap, need = self.snap, job.gpus
        avail = snap.gpu_free.astype(np.int64) - self.held
        t_row = np.full(len(snap), NEVER)
        t_row[candidates & (avail >= need)] = self.now
        waiting = candidates[self.row] & (avail[self.row] < need)
        rows, at, gpus = self.row[waiting], self.at[waiting], self.gpus[waiting]
        if len(rows):
            total = np.cumsum(gpus)
            first = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
            size = np.diff(np.r_[first, len(rows)])
            cum = total - np.repeat(total[first] - gpus[first], size)
            hit = np.flatnonzero(avail[rows] + cum >= need)
            if len(hit):
                found, at_first = np.unique(rows[hit], return_index=True)
                t_row[found] = at[hit[at_first]]
        for row in self.extra:  # rows with claimed jobs: merge their releases exactly
            if candidates[row] and avail[row] < need:
                t_row[row] = self._row_time(row, int(avail[row]), need)
        return self._choose(job, t_row)

    def _row_time(self, row: int, avail: int, need: int) -> float:
        lo, hi = np.searchsorted(self.row, [row, row + 1])
        steps = sorted(
            [*zip(self.at[lo:hi].tolist(), self.gpus[lo:hi].tolist(), strict=True), *self.extra[row]]
        )
        for when, gpus in steps:
            avail += gpus
            if avail >= need:
                return max(when, self.now)
        return NEVER

    def _choose(self, job: JobView, t_row: np.ndarray) -> Slot | None:
        snap = self.snap
        if not len(t_row):  # a fleet with no nodes yet (a cluster onboarding, or all removed)
            return None
        if job.nodes == 1:
            row = int(np.argmin(t_row))
            if t_row[row] == NEVER:
                return None
            return Slot(float(t_row[row]), int(snap.cluster[row]), (row,))
        found = lowest_in_one_cluster(snap, t_row, job.nodes, np.max)
        if found is None:
            return None
        start, rows = found
        return Slot(start, int(snap.cluster[rows[0]]), rows)

    def claim(self, slot: Slot, gpus: int, end: float, sign: int = 1) -> None:
        """A job given ``slot``: its GPUs are taken from now until ``end`` (``sign=-1``: given
        back, when the job's turn comes)."""
        for row in slot.rows:
            self.held[row] += sign * gpus
            if end < NEVER:
                if sign > 0:
                    self.extra[row].append((end, gpus))
                else:
                    self.extra[row].remove((end, gpus))

    def move(self, rows: tuple[tuple[int, int], ...], old_end: float, new_end: float) -> None:
        """A running job's GPUs now come free at ``new_end`` instead of ``old_end`` (it was
        preempted: it stops at the end of its grace period)."""
        for row, gpus in rows:
            if gpus:
                if old_end < NEVER:
                    self.extra[row].append((max(old_end, self.now), -gpus))
                self.extra[row].append((max(new_end, self.now), gpus))


def lowest_in_one_cluster(
    snap: Snapshot, value: np.ndarray, n: int, combine: Callable[[np.ndarray], Any]
) -> tuple[float, tuple[int, ...]] | None:
    """The ``n`` rows of one cluster with the lowest finite ``value`` (a vector over all rows),
    in the cluster where ``combine`` of their values is lowest: a gang's earliest start (the max
    of its nodes' times), or its cheapest preemption (the sum of its nodes' costs)."""
    finite = np.flatnonzero(value < NEVER)
    clusters = snap.cluster[finite]
    best: tuple[float, tuple[int, ...]] | None = None
    for cluster in np.unique(clusters):
        rows = finite[clusters == cluster]
        if len(rows) < n:
            continue
        chosen = rows[np.argsort(value[rows], kind="stable")[:n]]
        total = float(combine(value[chosen]))
        if best is None or total < best[0]:
            best = (total, tuple(int(r) for r in chosen))
    return best


def build_timeline(
    snap: Snapshot,
    runs: dict,
    now: float,
    end_of: Callable[[object], float],
) -> Timeline:
    """The timeline of ``runs`` (job id → ``cache.Run``) with ends given by ``end_of(run)``."""
    return Timeline(snap, [(end_of(run), run.rows) for run in runs.values()], now)
