"""Backfill: a blocked job's reservation, the jobs that may run ahead of it, and its replay."""

from __future__ import annotations

from scheduling.choices import PendingReason
from scheduling.engine.plugins.backfill import Backfill
from scheduling.engine.policies import DEFAULT_PROFILE, build_profile
from scheduling.engine.registry import REGISTRY
from tests.scheduling.snapshots import node, snapshot
from tests.scheduling.worlds import NEVER_PREEMPT, NOW, QUEUES, view, world_of

RULES = {q: NEVER_PREEMPT for q in QUEUES}


def half_busy():
    """One 8-GPU node, 4 GPUs held until +600 s; an 8-GPU job at the head of the queue."""
    world = world_of(snapshot(node(gpus=8)), [(view(1000, 4, limit=600), NOW)], [], RULES)
    world.submit(view(1, 8, priority=1, limit=1200))
    return world


def test_a_short_job_runs_ahead_on_a_reserved_node_and_a_long_one_waits():
    world = half_busy()
    world.submit(view(2, 2, limit=300), view(3, 2, limit=3600))
    decided = world.decide()
    assert [p.job.id for p in decided.placements] == [2], "it ends before the reservation starts"
    assert decided.reservations[1] == ((0,), 8, NOW + 600)
    assert decided.estimates[1] == (NOW + 600, "c0: n0", True)
    assert (decided.reserved, decided.backfilled) == (len(decided.reservations), 1)
    long = next(b for b in decided.blocked if b.cls.head.id == 3)
    assert long.status.reason == PendingReason.RESOURCES
    assert "1 are reserved for jobs ahead of it" in long.status.message


def test_a_job_that_outlives_the_reservation_takes_only_the_gpus_it_leaves_over():
    world = world_of(snapshot(node(gpus=8)), [(view(1000, 4, limit=600), NOW)], [], RULES)
    world.submit(view(1, 6, priority=1, limit=1200))  # at +600 s: 8 free, 6 reserved, 2 left over
    world.submit(*(view(i, 1) for i in (2, 3, 4)))  # no time limit: they outlive the reservation
    decided = world.decide()
    assert decided.reservations[1] == ((0,), 6, NOW + 600)
    assert sorted(p.job.id for p in decided.placements) == [2, 3]


def test_without_a_reservation_ahead_small_jobs_fill_the_node():
    world = world_of(snapshot(node(gpus=8)), [(view(1000, 4), NOW)], [], RULES)  # no time limit
    world.submit(view(1, 8, priority=1), view(2, 2), view(3, 2))
    decided = world.decide()
    assert decided.reservations == {} and 1 not in decided.estimates, "it would never start"
    assert sorted(p.job.id for p in decided.placements) == [2, 3]


def test_an_unchanged_cycle_replays_its_reservations_and_estimates():
    calls = []

    class Counted(Backfill):
        def post_filter(self, state, snap, job):
            calls.append(job.id)
            return super().post_filter(state, snap, job)

    profile = build_profile(DEFAULT_PROFILE, REGISTRY | {"backfill": Counted})
    world = world_of(snapshot(node(gpus=8)), [(view(1000, 8, limit=600), NOW)], [], RULES)
    world.submit(view(1, 8, priority=1, limit=1200), view(2, 4, limit=300))
    first = world.decide(profile)
    assert sorted(calls) == [1, 2] and not first.placements
    assert first.reservations == {1: ((0,), 8, NOW + 600), 2: ((0,), 4, NOW + 1800)}
    calls.clear()
    again = world.decide(profile)
    assert calls == [], "nothing changed: the verdicts and their reservations are replayed"
    assert (again.reservations, again.estimates) == (first.reservations, first.estimates)
    assert [b.status for b in again.blocked] == [b.status for b in first.blocked]
    world.stop(1000)  # the running job ends: the verdicts no longer hold
    third = world.decide(profile, now=NOW + 600)
    assert [p.job.id for p in third.placements] == [1] and calls == [2]
