"""Lent quota comes back before new borrowing: a waiting job within its queue's nominal quota
claims it, and no other queue of the cohort borrows that part while it waits."""

from __future__ import annotations

from scheduling.choices import PendingReason
from tests.scheduling.snapshots import node, snapshot
from tests.scheduling.worlds import COHORT, NEVER_PREEMPT, NOW, QUEUES, view, world_of


def lender_and_borrower():
    """Queue 1 has 8 GPUs of nominal quota and uses none; queue 2 has 2 and runs 8 — it borrows
    6 of queue 1's. Two 8-GPU nodes, one of them free."""
    world = world_of(snapshot(node(), node()), [], [], {q: NEVER_PREEMPT for q in QUEUES})
    book = world.snap.quota
    book.cohort_of, book.members = dict(COHORT), {"c": [1, 2]}
    book.limited |= {1, 2}
    book.nominal |= {(1, 0): 8, (2, 0): 2}
    book.borrowing_limit |= {(1, 0): None, (2, 0): None}
    world.start(view(1000, 8, queue=2), NOW - 100, rows=[0])
    return world


def reasons(decided) -> dict[int, str]:
    return {b.cls.head.id: b.status.reason for b in decided.blocked}


def test_a_lender_within_its_quota_claims_it_back_from_new_borrowing():
    world = lender_and_borrower()
    world.submit(view(1, 8, queue=1), view(2, 2, queue=2))  # the cohort has 2 GPUs of quota left
    decided = world.decide()
    assert decided.placements == []
    assert reasons(decided) == {1: PendingReason.QUOTA_EXCEEDED, 2: PendingReason.QUOTA_EXCEEDED}
    assert world.cache.claims == {1: (1, 0, 8)}
    world.submit(view(3, 1, queue=2))  # the next cycle: still no borrowing
    decided = world.decide(now=NOW + 10)
    assert decided.placements == [] and reasons(decided)[3] == PendingReason.QUOTA_EXCEEDED
    world.cache.queue.remove(1)  # the lender's job is cancelled: its claim goes with it
    placed = world.decide(now=NOW + 20).placements
    assert sorted(p.job.id for p in placed) == [2] and world.cache.claims == {}


def test_without_a_claim_the_borrower_takes_the_lent_quota():
    world = lender_and_borrower()
    world.submit(view(2, 2, queue=2))
    assert [p.job.id for p in world.decide().placements] == [2]


def test_a_claim_holds_back_only_borrowing_of_its_model():
    world = lender_and_borrower()
    world.snap.quota.nominal[(2, 0)] = 10  # queue 2 runs within its own quota, 2 GPUs of it left
    world.submit(view(1, 4, queue=1, nodes=2), view(2, 2, queue=2))  # job 1: no 2 nodes with 4 free
    decided = world.decide()
    assert world.cache.claims == {1: (1, 0, 8)}
    assert [p.job.id for p in decided.placements] == [2], "queue 2 takes its own quota, not lent quota"
    world = lender_and_borrower()
    world.snap.quota.nominal[(1, 1)] = 8
    world.submit(view(1, 8, queue=1, model=1), view(2, 2, queue=2))  # no such GPUs: it waits, claiming
    decided = world.decide()
    assert world.cache.claims == {1: (1, 1, 8)}
    assert [p.job.id for p in decided.placements] == [2], "a claim of another model holds nothing back"
