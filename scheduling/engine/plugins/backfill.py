"""Backfill with reservations, and predicted start times — Slurm's backfill, done columnar.

When a job cannot start now (``post_filter``), the first ``depth`` such jobs of the cycle, in
queue order, each get a **reservation**: the earliest time and nodes where they fit, from the
timeline of when running jobs end (their time limits: a promise, since no job outlives its
limit). Every job after them in the cycle may start now only where it does not delay a
reservation (``filter``): on nodes without one, or if it ends before the reservation starts, or
on GPUs the reservation leaves over. So a big job no longer starves behind a stream of small
ones, and small ones still fill the gaps in front of it.

The first ``estimates`` blocked jobs also get a **predicted start**: the same search on a second
timeline where jobs end when they are expected to (the share of their limit their queue's jobs
have used, learned as they end), written to the job as ``estimated_start_at`` /
``estimated_where`` / ``reserved``.

A preempting job's victims drain for their grace period; the GPUs they free are held for it by
a reservation (``nominated``) until it is placed, so nothing else takes them meanwhile.

Per node the plugin keeps two arrays: ``start`` (the earliest reservation on the node, never
without one) and ``slack`` (GPUs a job that outlives that start may still take without
delaying it); the filter is two comparisons over the rows it is asked about.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scheduling.choices import PendingReason
from scheduling.engine.framework import NEVER, OK, Code, CycleState, JobView, Placement, Status
from scheduling.engine.snapshot import Snapshot
from scheduling.engine.timeline import Slot, Timeline, build_timeline

BIG = 1 << 30
TIMELINES = "backfill.timelines"  # base timelines, kept between cycles while nothing changes


@dataclass
class Reservation:
    job: int
    rows: tuple[int, ...]
    gpus: int  # per row
    start: float
    end: float
    cluster: int


@dataclass
class Book:
    """The reservations of one cycle, and per row the arrays the filter reads."""

    snap: Snapshot
    start: np.ndarray
    slack: np.ndarray
    reserved: np.ndarray
    on_row: dict[int, list[Reservation]] = field(default_factory=dict)
    by_job: dict[int, Reservation] = field(default_factory=dict)
    changed: list[int] = field(default_factory=list)  # rows whose arrays changed, in order
    signature: int = 0  # which reservations exist, in order (for verdicts kept between cycles)

    @classmethod
    def empty(cls, snap: Snapshot, changed: list[int]) -> Book:
        n = len(snap)
        return cls(
            snap,
            np.full(n, NEVER),
            np.full(n, BIG, dtype=np.int64),
            np.zeros(n, dtype=np.int64),
            changed=changed,
        )

    def add(self, reservation: Reservation, timeline: Timeline | None) -> None:
        self.by_job[reservation.job] = reservation
        for row in reservation.rows:
            self.on_row.setdefault(row, []).append(reservation)
            self._recompute(row, timeline)
        self.signature = hash((self.signature, reservation.job, reservation.rows, reservation.start))

    def drop(self, job: int, timeline: Timeline | None) -> Reservation | None:
        reservation = self.by_job.pop(job, None)
        if reservation is None:
            return None
        for row in reservation.rows:
            self.on_row[row] = [r for r in self.on_row[row] if r.job != job]
            self._recompute(row, timeline)
        return reservation

    def _recompute(self, row: int, timeline: Timeline | None) -> None:
        held = self.on_row.get(row) or []
        if not held:
            self.start[row], self.slack[row], self.reserved[row] = NEVER, BIG, 0
        else:
            start = min(r.start for r in held)
            reserved = sum(r.gpus for r in held)
            released = timeline.released_by(row, start) if timeline is not None else 0
            self.start[row], self.reserved[row] = start, reserved
            self.slack[row] = max(int(self.snap.gpu_free[row]) + released - reserved, 0)
        self.changed.append(row)

    def take(self, row: int, gpus: int, end: float, sign: int = 1) -> None:
        """A job placed now on ``row`` until ``end``: it spends slack if it outlives the start."""
        if self.start[row] < end:
            self.slack[row] -= sign * gpus
            self.changed.append(row)


class Backfill:
    """PreFilter + Filter + Reserve + PostFilter: reservations for the first blocked jobs, backfill around
    them, and predicted starts (see the module docstring)."""

    name = "backfill"
    capacity = True

    def __init__(self, depth: int = 16, estimates: int = 200) -> None:
        if not (isinstance(depth, int) and isinstance(estimates, int)) or depth < 0 or estimates < depth:
            raise TypeError("depth and estimates are integers, 0 ≤ depth ≤ estimates")
        self.depth, self.estimates = depth, estimates

    # --- per-cycle state ------------------------------------------------------------------
    def _cycle(self, state: CycleState, snap: Snapshot) -> _Cycle:
        cycle = state.data.get("backfill")
        if cycle is None:
            book = Book.empty(snap, state.data["changed_rows"])
            cycle = state.data["backfill"] = _Cycle(book, state, snap)
            cycle.nominate()
        return cycle

    # --- PreFilter ---------------------------------------------------------------------------
    def pre_filter(self, state: CycleState, snap: Snapshot, job: JobView) -> Status:
        """A preemptor's turn: the GPUs held for it while its victims drain are its own."""
        cycle = self._cycle(state, snap)
        if job.id in cycle.book.by_job and job.id in state.data["nominated"]:
            cycle.release_nomination(job.id)
        return OK

    # --- Filter ------------------------------------------------------------------------------
    def filter(self, state: CycleState, snap: Snapshot, job: JobView, rows: np.ndarray) -> np.ndarray:
        book = self._cycle(state, snap).book
        if not book.by_job:
            return np.ones(len(rows), dtype=bool)
        end = state.data["now"] + job.time_limit
        return (book.start[rows] >= end) | (book.slack[rows] >= job.gpus)

    def explain(self, job: JobView, snap: Snapshot, refused: int) -> str:
        return f"{refused:,} are reserved for jobs ahead of it"

    # --- Reserve -----------------------------------------------------------------------------
    def reserve(self, state: CycleState, snap: Snapshot, placement: Placement) -> Status:
        cycle = self._cycle(state, snap)
        job = placement.job
        if cycle.book.by_job:
            end = state.data["now"] + job.time_limit
            for choice in placement.nodes:
                cycle.book.take(choice.row, job.gpus, end)
            if any(cycle.book.start[c.row] < NEVER for c in placement.nodes):
                cycle.backfilled += 1
        return OK

    def unreserve(self, state: CycleState, snap: Snapshot, placement: Placement) -> None:
        cycle = self._cycle(state, snap)
        job = placement.job
        end = state.data["now"] + job.time_limit
        for choice in placement.nodes:
            cycle.book.take(choice.row, job.gpus, end, sign=-1)

    # --- PostFilter --------------------------------------------------------------------------
    def post_filter(self, state: CycleState, snap: Snapshot, job: JobView) -> Status:
        if not job.gpus or job.model < 0 or state.data.get("blocked_by") == PendingReason.QUOTA_EXCEEDED:
            return OK  # a job waiting for quota, not for GPUs, holds no GPUs back
        cycle = self._cycle(state, snap)
        nomination = state.data["nominated"].get(job.id)
        if nomination is not None:  # a preemptor: its victims' GPUs are held for it, no search
            names = ", ".join(snap.names[r] for r in nomination.rows[:8])
            estimate = (nomination.start, f"{snap.cluster_names[nomination.cluster]}: {names}", True)

            def held(state: CycleState) -> None:  # replayed, as a search's effect is
                if state.data["nominated"].get(job.id) is not nomination:
                    return  # the hold lapsed (``nominate``) or was made anew
                self._cycle(state, snap).hold(job.id, nomination)
                state.data.setdefault("estimates", {})[job.id] = estimate

            held(state)
            state.data.setdefault("effects", []).append(held)
            return Status(Code.UNSCHEDULABLE, "", "its preempted victims' GPUs are held for it")
        if cycle.estimated >= self.estimates:
            return OK
        candidates = state.data["static_mask"](job)
        reserve = cycle.reserved < self.depth
        slot = cycle.limits().earliest(job, candidates) if reserve else None
        guess = cycle.expected().earliest(job, candidates)

        def effect(state: CycleState) -> None:
            self._cycle(state, snap).apply(job, slot, guess)

        effect(state)
        state.data.setdefault("effects", []).append(effect)
        return Status(Code.UNSCHEDULABLE, "", "a reservation holds its start") if slot is not None else OK


class _Cycle:
    """One cycle's reservations, timelines and estimates."""

    def __init__(self, book: Book, state: CycleState, snap: Snapshot) -> None:
        self.book, self.state, self.snap = book, state, snap
        self.now: float = state.data["now"]
        self.estimated = 0
        self.reserved = 0  # reservations made (nominations not counted)
        self.nominations = 0
        self.backfilled = 0
        self._timelines: dict[str, Timeline] = {}
        self._drained: dict[str, int] = {}  # per timeline: preemptions of this cycle already moved
        self.held_for: dict[int, Reservation] = {}  # nominations: GPUs held on the timelines

    def _timeline(self, kind: str) -> Timeline:
        timeline = self._timelines.get(kind)
        if timeline is not None:
            self._follow_drains(kind, timeline)
        if timeline is None:
            carry = self.state.data.setdefault(TIMELINES, {})
            key = (kind, id(self.snap), self.state.data["runs_version"])
            base = carry.get(key)
            if base is None:
                base = build_timeline(
                    self.snap, self.state.data["runs"], self.now, lambda run: self._end_of(kind, run)
                )
                for old in [k for k in carry if k[0] == kind]:
                    del carry[old]
                carry[key] = base
            timeline = self._timelines[kind] = base.fresh(self.now)
            self._drained[kind] = len(self.state.data.get("drained", ()))
            for held in self.held_for.values():
                timeline.claim(Slot(held.start, held.cluster, held.rows), held.gpus, held.end)
        return timeline

    def _end_of(self, kind: str, run: Any) -> float:
        if run.draining_until is not None:
            return run.draining_until
        if kind == "limits" or run.limit == NEVER:
            return run.start + run.limit
        expected = run.start + run.limit * self.state.data["ratios"].get(run.queue, 1.0)
        return expected if expected > self.now else (self.now + run.start + run.limit) / 2

    def _follow_drains(self, kind: str, timeline: Timeline) -> None:
        """Victims preempted since this timeline was made stop at the end of their grace period."""
        drained = self.state.data.get("drained", ())
        for before, now in drained[self._drained.get(kind, 0) :]:
            timeline.move(now.rows, self._end_of(kind, before), self._end_of(kind, now))
        self._drained[kind] = len(drained)

    def release_nomination(self, job_id: int) -> None:
        """The preemptor's turn: give it back the GPUs held for it, in the book and the timelines."""
        self.book.drop(job_id, None)
        held = self.held_for.pop(job_id, None)
        if held is not None:
            for timeline in self._timelines.values():
                timeline.claim(Slot(held.start, held.cluster, held.rows), held.gpus, held.end, sign=-1)

    def limits(self) -> Timeline:
        return self._timeline("limits")

    def expected(self) -> Timeline:
        return self._timeline("expected")

    def expected_duration(self, job: JobView) -> float:
        if job.time_limit == NEVER:
            return NEVER
        return job.time_limit * self.state.data["ratios"].get(job.queue_id, 1.0)

    def nominate(self) -> None:
        """Reservations for preemptors whose victims are still draining."""
        nominated = self.state.data["nominated"]
        for job_id, nomination in list(nominated.items()):
            if nomination.until < self.now:
                del nominated[job_id]
                # GPUs no longer held: kept verdicts that counted on the hold no longer stand
                self.state.data["runs_version_bump"]()
                continue
            self.hold(job_id, nomination)
            self.nominations += 1

    def hold(self, job_id: int, nomination: Any) -> None:
        """Hold a preemptor's GPUs: in the book (jobs after it keep off) and on the timelines
        (nobody else is given them as a reservation)."""
        if job_id in self.book.by_job:
            return
        start = max(nomination.start, self.now)  # it cannot start before this cycle
        end = start + nomination.limit
        reservation = Reservation(job_id, nomination.rows, nomination.gpus, start, end, nomination.cluster)
        self.book.add(reservation, None)
        self.held_for[job_id] = reservation
        for timeline in self._timelines.values():
            timeline.claim(
                Slot(reservation.start, reservation.cluster, reservation.rows), reservation.gpus, end
            )

    def apply(self, job: JobView, slot: Slot | None, guess: Slot | None) -> None:
        """Take the reservation (``slot``) and the estimate (``guess``) a post-filter found; the
        next cycle replays this when the job's class keeps its verdict (nothing changed)."""
        if slot is not None:
            end = slot.start + job.time_limit
            self.limits().claim(slot, job.gpus, end)
            reservation = Reservation(job.id, slot.rows, job.gpus, slot.start, end, slot.cluster)
            self.book.add(reservation, self.limits())
            self.reserved += 1
        if guess is not None:
            self.expected().claim(guess, job.gpus, guess.start + self.expected_duration(job))
        shown = guess or slot
        if shown is None:
            return
        self.estimated += 1
        names = [self.snap.names[r] for r in shown.rows[:8]]
        where = f"{self.snap.cluster_names[shown.cluster]}: {', '.join(names)}"
        if len(shown.rows) > 8:
            where += f" and {len(shown.rows) - 8} more"
        self.state.data.setdefault("estimates", {})[job.id] = (shown.start, where, slot is not None)
