"""Preemption as the cycle decides it: which running jobs go, for whom, and what is held meanwhile."""

from __future__ import annotations

import pytest

from scheduling.choices import PreemptWithinQueue, ReclaimWithinCohort
from scheduling.engine.policies import DEFAULT_PROFILE, build_profile
from scheduling.engine.snapshot import Snapshot
from tests.scheduling.snapshots import node, snapshot
from tests.scheduling.worlds import COHORT, NEVER_PREEMPT, NOW, QUEUES, WITHIN_QUEUE, free_at, view, world_of

RULES = {q: WITHIN_QUEUE for q in QUEUES}


def one_node(*running):
    """One 8-GPU node running ``running`` (view, start, checkpoint or None), queue 1 preempting
    lower priorities within itself."""
    world = world_of(snapshot(node(gpus=8)), [], [], RULES)
    for job, start, checkpoint in running:
        world.start(job, start)
        if checkpoint is not None:
            world.cache.runs[job.id].checkpoint = checkpoint
    return world


@pytest.mark.parametrize(
    ("a", "b", "victim"),
    [
        pytest.param((0, NOW - 1000, None), (0, NOW - 100, None), 1001, id="the-newer-loses-less-work"),
        pytest.param((0, NOW - 1000, NOW - 10), (0, NOW - 100, None), 1000, id="a-checkpoint-saves-work"),
        pytest.param((-1, NOW - 100, None), (0, NOW - 100, None), 1000, id="same-work-lower-priority-goes"),
        pytest.param((0, NOW - 1000, NOW - 100), (0, NOW - 500, NOW - 100), 1001, id="same-work-newest-goes"),
    ],
)
def test_the_victim_is_the_job_whose_preemption_loses_least(a, b, victim):
    (pa, sa, ca), (pb, sb, cb) = a, b
    world = one_node((view(1000, 4, priority=pa), sa, ca), (view(1001, 4, priority=pb), sb, cb))
    world.submit(view(1, 4, priority=1))
    (decision,) = world.decide().preemptions
    assert (decision.preemptor, decision.victims, decision.reason) == (1, (victim,), "within_queue")
    assert decision.message == (
        "preempted by job 1 (1, priority 1): a higher-priority job of its queue needs its GPUs"
    )


def test_the_cheapest_jobs_go_until_the_preemptor_fits():
    world = one_node(
        (view(1000, 2), NOW - 10, None), (view(1001, 2), NOW - 20, None), (view(1002, 4), NOW - 1000, None)
    )
    world.submit(view(1, 4, priority=1))
    (decision,) = world.decide().preemptions
    assert sorted(decision.victims) == [1000, 1001]
    world.stop(1000, 1001)
    assert [p.job.id for p in world.decide(now=NOW + 30).placements] == [1]


def test_a_non_preemptible_job_is_never_a_victim():
    cheap = view(1000, 4, priority=-1, preemptible=False)  # started just now: the cheapest by far
    world = one_node((cheap, NOW - 1, None), (view(1001, 4), NOW - 5000, None))
    world.submit(view(1, 4, priority=1))
    assert [d.victims for d in world.decide().preemptions] == [(1001,)]
    world = one_node((cheap, NOW - 1, None), (view(1001, 4, preemptible=False), NOW - 1, None))
    world.submit(view(1, 4, priority=1))
    decided = world.decide()
    assert decided.preemptions == [] and "preempting" not in decided.blocked[0].status.message


@pytest.mark.parametrize("priority", [0, -1], ids=["equal", "lower"])
def test_no_job_is_preempted_for_one_not_above_it_in_its_queue(priority):
    world = one_node((view(1000, 8, priority=0), NOW - 100, None))
    world.submit(view(1, 8, priority=priority))
    assert world.decide().preemptions == []


def test_a_gang_goes_whole_and_its_preemptor_is_nominated_for_what_it_frees():
    world = world_of(snapshot(node(gpus=8), node(gpus=8)), [], [], RULES)
    world.start(view(1000, 4, priority=-1, nodes=2), NOW - 10)  # 4 GPUs on each node; the cheapest
    world.start(view(1001, 4), NOW - 100, rows=[0])
    world.start(view(1002, 4), NOW - 100, rows=[1])
    world.submit(view(1, 4, priority=1))
    (decision,) = world.decide().preemptions
    assert decision.victims == (1000,)
    nomination = world.cache.nominated[1]
    assert (nomination.rows, nomination.gpus, nomination.victims, nomination.start) == (
        (0,),
        4,
        (1000,),
        NOW + 30,
    )
    assert world.cache.runs[1000].draining_until == NOW + 30, "the whole gang drains, both its nodes"
    world.stop(1000)
    assert [int(g) for g in world.snap.gpu_free] == [4, 4]
    assert [(p.job.id, p.nodes[0].row) for p in world.decide(now=NOW + 30).placements] == [(1, 0)]


def test_a_draining_victim_is_not_chosen_twice():
    world = one_node((view(1000, 4, priority=-1), NOW - 100, None), (view(1001, 4, priority=5), NOW, None))
    world.submit(view(1, 4, priority=1))
    assert [d.victims for d in world.decide().preemptions] == [(1000,)]
    world.submit(view(2, 4, priority=3, limit=600))  # the victim still drains; another job wants its GPUs
    decided = world.decide(now=NOW + 10)
    assert decided.preemptions == []
    said = {b.cls.head.id: b.status.message for b in decided.blocked}
    assert "waiting for 1 preempted job(s) to stop" in said[1]
    assert "preempting" not in said[2]


def test_a_job_held_back_by_a_reservation_preempts_nothing():
    """It fits on free GPUs that a reservation ahead of it holds: preempting frees nothing it
    needs (a decision with no victims once stopped the whole cycle with an error)."""
    world = world_of(snapshot(node(gpus=4), node(gpus=4)), [], [], RULES)
    world.start(view(1000, 4, limit=60), NOW, rows=[0])
    world.start(view(1001, 1, priority=-1, limit=60), NOW, rows=[1])
    world.submit(view(1, 4, nodes=2, limit=60), view(2, 1, limit=600))
    decided = world.decide()
    assert decided.preemptions == [] and decided.placements == []
    assert decided.reservations[1] == ((0, 1), 4, NOW + 60)
    assert (
        "reserved for jobs ahead of it"
        in next(b for b in decided.blocked if b.cls.head.id == 2).status.message
    )


def lent(snap: Snapshot, nominal_1: int) -> None:
    """Queues 1 and 2 share a cohort; queue 2 has no quota of its own: all it runs is borrowed."""
    book = snap.quota
    book.cohort_of, book.members = dict(COHORT), {"c": [1, 2]}
    book.limited |= {1, 2}
    book.nominal |= {(1, 0): nominal_1, (2, 0): 0}
    book.borrowing_limit |= {(1, 0): None, (2, 0): None}


@pytest.mark.parametrize(
    ("reclaim", "nominal", "needs", "victim_priority", "preempted"),
    [
        pytest.param(ReclaimWithinCohort.ANY, 8, 8, 0, True, id="any-reclaims-from-an-equal"),
        pytest.param(ReclaimWithinCohort.ANY, 8, 8, 1, False, id="never-from-a-higher"),
        pytest.param(ReclaimWithinCohort.LOWER_PRIORITY, 8, 8, 0, False, id="lower-spares-an-equal"),
        pytest.param(ReclaimWithinCohort.LOWER_PRIORITY, 8, 8, -1, True, id="lower-reclaims-from-a-lower"),
        pytest.param(ReclaimWithinCohort.ANY, 4, 8, -1, False, id="not-beyond-its-own-nominal-quota"),
        pytest.param(ReclaimWithinCohort.NEVER, 8, 8, -1, False, id="never"),
    ],
)
def test_a_queue_reclaims_the_quota_it_lent_only_within_its_nominal_quota(
    reclaim, nominal, needs, victim_priority, preempted
):
    world = world_of(
        snapshot(node(gpus=8)), [], [], {1: (PreemptWithinQueue.NEVER, reclaim, 30), 2: NEVER_PREEMPT}
    )
    lent(world.snap, nominal)
    world.start(view(1000, 8, queue=2, priority=victim_priority), NOW - 100)
    world.submit(view(1, needs, queue=1, priority=0))
    decided = world.decide()
    if not preempted:
        assert decided.preemptions == []
        return
    (decision,) = decided.preemptions
    assert (decision.victims, decision.reason) == ((1000,), "reclaim")
    assert decision.message.endswith("queue 1 reclaims GPU quota it lent")


def test_no_reclaim_from_a_queue_within_its_own_quota():
    world = world_of(
        snapshot(node(gpus=8)), [], [], {1: (PreemptWithinQueue.NEVER, "any", 30), 2: NEVER_PREEMPT}
    )
    lent(world.snap, 8)
    world.snap.quota.nominal[(2, 0)] = 8  # queue 2 runs on its own quota, not on queue 1's
    world.start(view(1000, 8, queue=2, priority=-1), NOW - 100)
    world.submit(view(1, 8, queue=1))
    assert world.decide().preemptions == []


# --- GPUs held for a preemptor while its victims drain ------------------------------------------------
# The GPUs a preemption frees go to the preemptor, not to another job: otherwise the victims
# would lose their work for nothing.


def test_jobs_placed_after_a_preemption_leave_the_preemptor_its_gpus():
    world = world_of(snapshot(node(gpus=8)), [], [], {1: WITHIN_QUEUE, 2: NEVER_PREEMPT, 3: NEVER_PREEMPT})
    world.start(view(1000, 2, priority=-1), NOW - 100)  # no time limit
    world.submit(
        view(1, 8, queue=2, priority=5, model=1),  # blocked first (no such GPUs): the timeline is built
        view(2, 8, priority=3, limit=600),  # preempts job 1000
        view(3, 2, limit=3600),
    )
    world.decide()
    nomination = world.cache.nominated[2]
    assert free_at(world, 0, nomination.start) >= 8


def test_the_preemptor_gets_its_gpus_when_its_victims_have_stopped():
    rules = {1: NEVER_PREEMPT, 2: (PreemptWithinQueue.LOWER_PRIORITY, ReclaimWithinCohort.NEVER, 0)}
    world = world_of(snapshot(node(gpus=4)), [], [], rules)
    world.start(view(1000, 4, queue=2, priority=-1), NOW - 100)
    world.submit(view(2, 4, queue=2, limit=60))
    assert [d.victims for d in world.decide().preemptions] == [(1000,)]
    world.stop(1000)
    world.submit(view(1, 4, queue=1, limit=60, submitted=0.5))  # sorts ahead of the preemptor
    assert [p.job.id for p in world.decide(now=NOW + 1).placements] == [2]


def test_a_preemptor_sees_its_gpus_after_a_job_of_the_same_shape_was_kept_off_them():
    profile = build_profile(DEFAULT_PROFILE | {"args": {"backfill": {"depth": 0, "estimates": 0}}})
    rules = {2: (PreemptWithinQueue.LOWER_PRIORITY, ReclaimWithinCohort.NEVER, 0)}
    world = world_of(snapshot(node(gpus=4)), [], [], rules)
    world.start(view(1000, 4, queue=2, priority=-1), NOW - 100)
    world.submit(view(2, 4, queue=2, limit=60))
    assert [d.victims for d in world.decide(profile).preemptions] == [(1000,)]
    world.stop(1000)
    world.submit(view(1, 4, queue=2, limit=60, models=(0,), submitted=0.5))  # as model 0: job 2's shape
    assert [p.job.id for p in world.decide(profile, now=NOW + 1).placements] == [2]


def test_a_nominated_preemptor_is_not_stuck_behind_a_job_of_its_class():
    world = one_node((view(1000, 4, priority=-1), NOW - 100, None), (view(1001, 4, priority=5), NOW, None))
    world.submit(view(1, 4, priority=1))
    assert [d.victims for d in world.decide().preemptions] == [(1000,)]
    world.submit(view(2, 4, priority=3))  # same shape as job 1, sorts ahead of it
    world.stop(1000)
    assert len(world.decide(now=NOW + 30).placements) == 1


def test_a_cycle_kept_whole_while_victims_drain_ends_when_the_held_gpus_lapse():
    """Cycles that change nothing are kept whole, also while a preemptor's victims drain; but the
    GPUs held for it lapse at a time, which only a cycle that is not kept lets happen."""
    world = one_node((view(1000, 4, priority=-1), NOW - 100, None), (view(1001, 4, priority=5), NOW, None))
    world.submit(view(1, 4, priority=1, limit=600))
    assert [d.victims for d in world.decide().preemptions] == [(1000,)]
    nomination = world.cache.nominated[1]
    world.decide(now=NOW + 1)
    kept = world.decide(now=NOW + 2)
    assert kept.reservations[1] == ((0,), 4, nomination.start)
    assert world.decide(now=nomination.start + 1) is kept  # still held: it lapses later
    later = world.decide(now=nomination.until + 1)
    assert later is not kept and 1 not in world.cache.nominated


def test_a_lapsed_hold_is_not_brought_back_by_a_kept_verdict():
    """A preemptor whose victim never stops loses its hold when it lapses; its class's kept
    verdict must not hold the GPUs for it again, cycle after cycle (it gets a reservation like
    any blocked job instead)."""
    world = one_node((view(1000, 4), NOW - 100, None))
    world.submit(view(1, 8, priority=1, limit=600))
    assert [d.victims for d in world.decide().preemptions] == [(1000,)]
    until = world.cache.nominated[1].until
    for now in (NOW + 31, NOW + 32, until - 1):
        (blocked,) = world.decide(now=now).blocked
        assert "GPUs are held for it" in blocked.status.message
    world.decide(now=until + 1)  # the hold lapses in this cycle
    assert 1 not in world.cache.nominated
    for now in (until + 2, until + 3):
        (blocked,) = world.decide(now=now).blocked
        assert "GPUs are held for it" not in blocked.status.message, blocked.status.message
        assert "a reservation holds its start" in blocked.status.message
