"""The workload replayer: the real decide phase in virtual time (no database), and the policy
figures it reports — starvation without backfill, a reservation that bounds a gang's wait,
reclaiming lent quota within a grace period."""

from __future__ import annotations

from scheduling.engine.replay import (
    Fleet,
    Replay,
    TraceJob,
    policy_profile,
    policy_queues,
    synthetic_trace,
)


def profile(policy: str):
    return policy_profile(policy)


def queues(policy: str, quota: dict[int, int], ids=(1, 2)):
    return policy_queues(policy, quota, ids)


def reclaim_case(policy: str) -> float | None:
    fleet = Fleet(clusters=("sim-a",), nodes=8, models=("h100-80g",))
    replay = Replay(fleet, profile(policy), queues(policy, {0: 32}))
    borrower = [TraceJob(i, float(i), 2, 1, 8, 0, 6 * 3600.0, 8 * 3600.0) for i in range(1, 9)]
    lender = [TraceJob(100 + i, 600.0, 1, 1, 8, 0, 3600.0, 7200.0) for i in range(4)]
    replay.watch_reclaim(1, 0, 32, since=600.0)
    replay.run([*borrower, *lender], until=3 * 3600.0)
    return replay.reclaimed.get((1, 0))


def test_a_lender_gets_its_quota_back_within_one_grace_period_and_one_cycle():
    assert reclaim_case("backfill_preemption") <= 30 + 1.0


def test_without_preemption_the_lender_waits_for_the_borrowers_to_end():
    assert reclaim_case("backfill") is None  # not within the three hours replayed


def stress_case(policy: str) -> Replay:
    """A 64-GPU gang of higher priority arrives into a fleet kept full of 1-GPU jobs."""
    fleet = Fleet(nodes=8, models=("h100-80g",))
    replay = Replay(fleet, profile(policy), queues(policy, {}, ids=(1,)))
    stream = synthetic_trace(fleet, hours=4, load=1.2, seed=3, queues=(1,), any_model=0, urgent=0)
    small = [TraceJob(j.id, j.submit, 1, 1, 1, 0, j.runtime, j.limit) for j in stream]
    backlog = [TraceJob(10**5 + i, 0.0, 1, 1, 1, 0, 1800.0 + 60 * i, 3600.0 + 60 * i) for i in range(160)]
    gang = TraceJob(10**6, 1800.0, 1, 8, 8, 0, 3600.0, 7200.0, priority=10)
    replay.run([*backlog, *small, gang], until=4 * 3600.0)
    return replay


def test_fifo_starves_the_gang_and_backfill_bounds_its_wait_by_its_reservation():
    fifo = stress_case("fifo").wait_of(10**6)
    backfill = stress_case("backfill").wait_of(10**6)
    assert backfill is not None
    # the backlog's limits end by 1800 + 160 × 60 + 3600 s at the latest: the reservation's bound
    assert backfill <= 160 * 60 + 3600
    assert fifo is None or fifo > backfill


def test_preemption_starts_the_gang_after_one_grace_period():
    replay = stress_case("backfill_preemption")
    assert replay.wait_of(10**6) <= 30 + 1.0
    assert replay.preemptions >= 1


def test_a_synthetic_replay_finishes_every_job_and_reports_its_figures():
    fleet = Fleet(nodes=8)
    replay = Replay(fleet, profile("backfill"), queues("backfill", {0: 16, 1: 16}))
    figures = replay.run(synthetic_trace(fleet, hours=1, seed=5, load=1.1))
    assert figures["unstarted"] == 0
    assert 0.1 < figures["utilisation"] <= 1.0
    assert all(life.done is not None for life in replay.lives.values())
    assert figures["start_error_median"] is None or figures["start_error_median"] >= 0


def test_any_model_jobs_run_on_a_model_they_accept():
    fleet = Fleet(nodes=4)
    replay = Replay(fleet, profile("backfill"), queues("backfill", {}))
    trace = [j for j in synthetic_trace(fleet, hours=1, seed=9, any_model=1.0) if j.nodes == 1]
    replay.run(trace)
    assert all(life.first_start is not None for life in replay.lives.values())
