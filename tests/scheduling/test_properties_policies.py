"""Property-based checks of backfill's reservations, preemption, quota claims and any-model
requests over random fleets, running jobs and workloads — in memory, the decision phase the cycle
runs, without the database (``tests/scheduling/worlds.py``).

Recording subclasses of the quota and preemption plugins take the place of the registry's, to see
the cycle's state at the moment a placement is counted or victims are chosen; they change nothing.
Each property says which part of a failing example's world broke it; the example itself is
printed as the fleet, quotas, running and waiting jobs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Any

import numpy as np
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from scheduling.choices import PreemptWithinQueue, ReclaimWithinCohort
from scheduling.engine.cycle.decide import Decided
from scheduling.engine.framework import ANY_MODEL, NEVER, JobView, NodeChoice
from scheduling.engine.plugins.preemption import Preemption
from scheduling.engine.plugins.quota import Quota
from scheduling.engine.policies import DEFAULT_PROFILE, Profile, build_profile
from scheduling.engine.registry import REGISTRY
from scheduling.engine.snapshot import QuotaBook
from tests.scheduling.snapshots import node, snapshot
from tests.scheduling.worlds import (
    COHORT,
    NEVER_PREEMPT,
    NOW,
    PROFILE,
    QUEUES,
    World,
    free_at,
    view,
    world_of,
)

LIMITS = [60.0, 300.0, 1800.0, NEVER]


def examples(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def worlds(
    draw: Any,
    *,
    preempting: bool = True,
    quota: bool = True,
    any_model: bool = True,
    lending: bool = False,
    mixed: bool = False,
    contended: bool = False,
) -> World:
    """A random world. ``lending``: both cohort queues have quota of every model, and most running
    jobs are queue 2's — it borrows what queue 1 lent. ``mixed``: as many nodes of each model;
    otherwise mostly one, so that jobs meet on the same nodes. ``contended``: a full fleet, and
    waiting jobs of the running jobs' queues, at higher priorities."""
    a_model = st.sampled_from([0, 1] if mixed else [0, 0, 0, 1])
    fleet = draw(
        st.lists(
            st.builds(
                lambda cluster, model, gpus: node(cluster=cluster, model=model, gpus=gpus),
                st.integers(0, 1),
                a_model,
                st.sampled_from([4, 8]),
            ),
            min_size=1,
            max_size=5,
        )
    )
    snap = snapshot(*fleet)
    book = snap.quota
    book.cohort_of = dict(COHORT)
    book.members = {"c": [1, 2]}
    if quota:
        for queue in (1, 2):
            for model in (0, 1):
                nominal = draw(st.integers(0, 12) if lending else st.none() | st.integers(0, 12))
                if nominal is not None:
                    book.limited.add(queue)
                    book.nominal[(queue, model)] = nominal
                    book.borrowing_limit[(queue, model)] = draw(st.none() | st.integers(0, 8))
    gpus = st.sampled_from([1, 2, 3, 4, 6, 8])
    nodes = st.sampled_from([1, 1, 2])
    runs = st.tuples(
        st.sampled_from([1, 2, 2, 2] if lending else [1, 2] if contended else [1, 2, 3]),  # queue
        st.integers(-1, 0 if contended else 1),  # priority
        st.integers(0, 3000),  # seconds it has run
        st.sampled_from(LIMITS),
        st.sampled_from([True, True, False]),  # preemptible
    )
    running = [
        (
            view(
                1000 + i,
                g,
                queue=q,
                priority=p,
                limit=lim,
                nodes=n,
                model=m,
                preemptible=pre,
                submitted=NOW - age,
            ),
            NOW - age,
        )
        for i, ((q, p, age, lim, pre), g, n, m) in enumerate(
            draw(st.lists(st.tuples(runs, gpus, nodes, a_model), max_size=8))
        )
    ]
    models = st.sampled_from([(), (), (), (0,), (1,), (0, 1), (1, 0)]) if any_model else st.just(())
    pending = [
        view(i + 1, g, queue=q, priority=p, limit=limit, nodes=n, model=m, models=ms)
        for i, (q, p, g, n, m, ms, limit) in enumerate(
            draw(
                st.lists(
                    st.tuples(
                        st.integers(1, 2 if contended or lending else 3),
                        st.integers(0 if contended else -1, 3),
                        gpus,
                        nodes,
                        a_model,
                        models,
                        st.sampled_from(LIMITS),
                    ),
                    min_size=1,
                    max_size=12,
                )
            )
        )
    ]
    rules = st.tuples(
        st.sampled_from([PreemptWithinQueue.LOWER_PRIORITY] * 3 + [PreemptWithinQueue.NEVER]),
        st.sampled_from(list(ReclaimWithinCohort.values)),
        st.sampled_from([0, 30, 60]),
    )
    policies = {q: draw(rules) if preempting else NEVER_PREEMPT for q in QUEUES}
    world = world_of(snap, running, pending, policies)
    for row in range(len(snap)):  # some nodes are filled up with small jobs: a busy fleet
        if not (contended or draw(st.booleans())):
            continue
        while snap.gpu_free[row]:
            (q, p, age, lim, pre), g = draw(runs), draw(st.sampled_from([1, 2, 4]))
            filler = view(
                2000 + len(world.running),
                min(g, int(snap.gpu_free[row])),
                queue=q,
                priority=p,
                limit=lim,
                model=int(snap.model[row]),
                preemptible=pre,
                submitted=NOW - age,
            )
            world.cache.assume(
                filler, [NodeChoice(row, snap.choose_gpus(row, filler.gpus))], q, now=NOW - age
            )
            world.running[filler.id] = filler
    for job_id, checkpointed, draining in draw(
        st.lists(st.tuples(st.sampled_from(sorted(world.running) or [0]), st.booleans(), st.booleans()))
    ):
        run = world.cache.runs.get(job_id)
        if run is None:
            continue
        if checkpointed:
            run.checkpoint = NOW - 30
        if draining:
            run.draining_until = NOW + 20
            world.draining.add(job_id)
    world.told = world.describe()
    return world


@st.composite
def backfill_worlds(draw: Any) -> World:
    """Backfill's own scene: a few nodes busy with jobs ending at different times, big jobs at the
    head of the queue that must wait for them, and a stream of small ones behind."""
    snap = snapshot(*(node(gpus=g) for g in draw(st.lists(st.sampled_from([4, 8]), min_size=1, max_size=3))))
    limits = st.sampled_from([60.0, 300.0, 900.0, 1800.0, NEVER])
    running = [
        (view(1000 + i, g, limit=lim, submitted=NOW - age), NOW - age)
        for i, (g, lim, age) in enumerate(
            draw(st.lists(st.tuples(st.integers(1, 4), limits, st.integers(0, 50)), min_size=1, max_size=8))
        )
    ]
    big = draw(
        st.lists(st.tuples(st.integers(3, 8), st.sampled_from([1, 1, 2]), limits), min_size=1, max_size=2)
    )
    small = draw(st.lists(st.tuples(st.integers(1, 3), limits), min_size=1, max_size=10))
    pending = [view(i + 1, g, priority=2, nodes=n, limit=lim) for i, (g, n, lim) in enumerate(big)]
    pending += [view(len(big) + i + 1, g, limit=lim) for i, (g, lim) in enumerate(small)]
    world = world_of(snap, running, pending, {q: NEVER_PREEMPT for q in QUEUES})
    world.told = world.describe()
    return world


# --- recording plugins: what the cycle saw when it counted a placement or chose victims -----------


class RecordingQuota(Quota):
    """Keeps, for each placement, the quota used, the open claims, the free GPUs and backfill's
    per-node arrays as they were just before it was counted."""

    def __init__(self) -> None:
        self.placed: list[tuple[JobView, dict, dict, np.ndarray, Any]] = []

    def reserve(self, state, snap, placement):
        cycle = state.data.get("backfill")
        book = None if cycle is None else (cycle.book.start.copy(), cycle.book.slack.copy())
        self.placed.append(
            (placement.job, dict(snap.quota.used), dict(state.data["claims"]), snap.gpu_free.copy(), book)
        )
        return super().reserve(state, snap, placement)


class RecordingPreemption(Preemption):
    """Keeps each decision with the preemptor as tried, and the quota used and free GPUs it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.chosen: list[tuple[Any, JobView, dict, np.ndarray]] = []

    def post_filter(self, state, snap, job):
        used, free = dict(snap.quota.used), snap.gpu_free.copy()
        before = len(state.data.get("preemptions", []))
        status = super().post_filter(state, snap, job)
        decisions = state.data.get("preemptions", [])
        if len(decisions) > before:
            self.chosen.append((decisions[-1], job, used, free))
        return status


def recording_profile() -> tuple[Profile, RecordingQuota, RecordingPreemption]:
    quota, preemption = RecordingQuota(), RecordingPreemption()
    registry = REGISTRY | {"quota": lambda: quota, "preemption": lambda: preemption}
    return build_profile(DEFAULT_PROFILE, registry), quota, preemption


# --- 1. preemption respects priorities ------------------------------------------------------------


@examples(400)
@given(world=st.one_of(worlds(), worlds(lending=True), worlds(contended=True)))
def test_no_job_is_preempted_for_one_of_lower_or_equal_priority(world):
    note(world.told)
    profile, _, preemption = recording_profile()
    decided = world.decide(profile)
    book = world.snap.quota
    assert [c[0] for c in preemption.chosen] == decided.preemptions
    seen: set[int] = set()
    event(f"preemptions: {min(len(decided.preemptions), 3)}")
    for decision, preemptor, used, _ in preemption.chosen:
        event(f"reason: {decision.reason}")
        within, reclaim, _ = world.policies[preemptor.queue_id]
        assert decision.preemptor == preemptor.id and decision.victims
        for victim in decision.victims:
            # A victim may have been placed earlier in this same cycle (a borrower placed before
            # the lender's job was tried): preempted before it reached its cluster, it loses nothing.
            run, original = world.cache.runs[victim], world.running.get(victim)
            assert victim not in seen, "a job is preempted once"
            seen.add(victim)
            assert run.preemptible and (original is None or original.preemptible), (
                "a non-preemptible job was preempted"
            )
            assert victim not in world.draining, "a job already draining was preempted again"
            assert run.model == preemptor.model
            if run.queue == preemptor.queue_id:
                assert within == PreemptWithinQueue.LOWER_PRIORITY
                assert run.priority < preemptor.priority, "preempted for a job of its queue not above it"
            else:
                assert reclaim != ReclaimWithinCohort.NEVER
                assert COHORT.get(run.queue) == COHORT.get(preemptor.queue_id) is not None
                assert run.priority <= preemptor.priority, "preempted for a job of lower priority"
                if reclaim == ReclaimWithinCohort.LOWER_PRIORITY:
                    assert run.priority < preemptor.priority
                key = (run.queue, run.model)
                assert used.get(key, 0) > book.nominal.get(key, 0), "reclaimed from a queue not borrowing"
                own = (preemptor.queue_id, preemptor.model)
                assert used.get(own, 0) + preemptor.total_gpus <= book.nominal.get(own, 0), (
                    "reclaimed by a queue beyond its nominal quota"
                )
        same_queue = all(world.cache.runs[v].queue == preemptor.queue_id for v in decision.victims)
        assert decision.reason == ("within_queue" if same_queue else "reclaim")
        assert f"preempted by job {preemptor.id} " in decision.message


# --- 2. reservations hold ----------------------------------------------------------------------------


def reservations_hold(world: World, decided: Decided) -> None:
    """At every reservation's start, on each of its rows, the GPUs free then — every job holding
    GPUs, those placed by the cycle included, released at its time limit — cover the reservations
    that hold GPUs there at that moment."""
    limit_of = {j: v.time_limit for j, v in world.pending.items()}
    for job_id, (rows, gpus, start) in decided.reservations.items():
        assert start >= NOW and gpus == world.pending[job_id].gpus
        assert len(rows) == world.pending[job_id].nodes == len(set(rows))
        for row in rows:
            holding = sum(
                g
                for other, (other_rows, g, s) in decided.reservations.items()
                if row in other_rows and s <= start < s + limit_of[other]
            )
            assert free_at(world, row, start) >= holding, (
                f"job {job_id}'s reservation on row {row} at {start - NOW:+.0f} s was overtaken"
            )


@examples(400)
@given(world=st.one_of(worlds(preempting=False), backfill_worlds()))
def test_a_reservation_is_never_overtaken_by_a_job_that_would_delay_it(world):
    note(world.told)
    decided = world.decide(PROFILE)
    event(f"reservations: {min(len(decided.reservations), 3)}")
    event(f"backfilled: {min(decided.backfilled, 2)}")
    reservations_hold(world, decided)


# --- 3. gangs are preempted whole, and the preemptor fits where its victims were ---------------------


@examples(400)
@given(world=st.one_of(worlds(quota=False), worlds(lending=True), worlds(contended=True)))
def test_a_preempted_gang_goes_whole_and_its_preemptor_fits_in_what_it_frees(world):
    note(world.told)
    profile, _, preemption = recording_profile()
    world.decide(profile)
    snap, cache = world.snap, world.cache
    for decision, preemptor, _, free in preemption.chosen:
        nomination = cache.nominated[preemptor.id]
        assert set(nomination.victims) == set(decision.victims)
        assert len(nomination.rows) == preemptor.nodes == len(set(nomination.rows))
        assert {int(snap.cluster[r]) for r in nomination.rows} == {nomination.cluster}
        freed: dict[int, int] = defaultdict(int)
        for victim in decision.victims:
            run = cache.runs[victim]
            assert run.draining_until is not None, "a victim drains"
            for row, gpus in run.rows:  # every node of the victim, gang or not, comes free
                freed[row] += gpus
        for row in nomination.rows:
            assert snap.model[row] == preemptor.model and snap.ready[row]
            assert free[row] + freed[row] >= preemptor.gpus, "the preemptor does not fit in what it frees"
        assert nomination.start == max(cache.runs[v].draining_until for v in decision.victims)
    gangs = sum(len(cache.runs[v].rows) > 1 for c in preemption.chosen for v in c[0].victims)
    event(f"preemptions: {min(len(preemption.chosen), 2)}, gangs among the victims: {min(gangs, 1)}")


# --- 4. lent quota comes back before new borrowing ---------------------------------------------------


@examples(400)
@given(
    world=worlds(preempting=False, lending=True),
    later=st.lists(st.tuples(st.integers(1, 2), st.sampled_from([1, 2, 4, 8])), max_size=4),
)
def test_lent_quota_is_reclaimed_before_new_borrowing(world, later):
    note(world.told)
    log: list[tuple[str, JobView, dict]] = []

    class Logged(Quota):
        def reserve(self, state, snap, placement):
            log.append(("placed", placement.job, dict(snap.quota.used)))
            return super().reserve(state, snap, placement)

        def post_filter(self, state, snap, job):
            log.append(("blocked", job, dict(snap.quota.used)))
            return super().post_filter(state, snap, job)

    profile = build_profile(DEFAULT_PROFILE, REGISTRY | {"quota": Logged})
    world.decide(profile)
    world.submit(*(view(500 + i, g, queue=q) for i, (q, g) in enumerate(later)))  # arrive between cycles
    log.append(("cycle", None, {}))
    world.decide(profile, now=NOW + 10)
    book = world.snap.quota
    claims: dict[int, tuple[int, int, int]] = {}  # lender job → (queue, model, GPUs)
    for what, job, used in log:
        if what == "cycle":
            claims = {j: c for j, c in claims.items() if j in world.cache.queue.jobs}
            continue
        if not job.total_gpus or job.model < 0 or job.queue_id not in book.limited:
            continue
        key = (job.queue_id, job.model)
        within = used.get(key, 0) + job.total_gpus <= book.nominal.get(key, 0)
        claimed = sum(g for q, m, g in claims.values() if q != job.queue_id and m == job.model)
        if what == "blocked":
            if within and job.queue_id in COHORT:
                claims[job.id] = (job.queue_id, job.model, job.total_gpus)
            elif claimed and job.total_gpus <= headroom(book, used, job) < job.total_gpus + claimed:
                event("borrowing refused: the quota is claimed back")
            continue
        claims.pop(job.id, None)
        if within or job.queue_id not in COHORT:
            continue
        members = [q for q in book.members["c"] if q in book.limited]
        cohort_free = sum(book.nominal.get((q, job.model), 0) - used.get((q, job.model), 0) for q in members)
        event(f"borrowed with {'a claim' if claimed else 'no claim'} open")
        assert cohort_free - job.total_gpus >= claimed, (
            f"job {job.id} (queue {job.queue_id}) borrowed {job.total_gpus} GPUs of claimed quota: {claims}"
        )


def headroom(book: QuotaBook, used: dict, job: JobView) -> int:
    """What ``job``'s queue could take of its model with ``used`` held, claims left aside."""
    return replace(book, used=used).headroom(job.queue_id, job.model)


# --- 5. any-model jobs --------------------------------------------------------------------------------


@examples(300)
@given(world=worlds(preempting=False, mixed=True))
def test_any_model_placements_take_the_first_accepted_model_that_fits(world):
    note(world.told)
    profile, quota, _ = recording_profile()
    decided = world.decide(profile)
    snap = world.snap
    seen = {job.id: (job, used, claims, free, book) for job, used, claims, free, book in quota.placed}
    for placement in decided.placements:
        asked = world.pending[placement.job.id]
        chosen = placement.job.model
        assert chosen >= 0, "a placement names a concrete model"
        assert all(snap.model[c.row] == chosen for c in placement.nodes)
        if asked.model != ANY_MODEL:
            assert chosen == asked.model
            continue
        assert chosen in asked.models, "an any-model job got a model it does not accept"
        event(f"any-model placed on its choice #{asked.models.index(chosen) + 1}")
        _, used, claims, free, book = seen[asked.id]
        for better in asked.models[: asked.models.index(chosen)]:
            assert not fits(world, asked.as_model(better), used, claims, free, book), (
                f"job {asked.id} took model {chosen} while its preferred model {better} fitted"
            )


def fits(world: World, job: JobView, used: dict, claims: dict, free: np.ndarray, book: Any) -> bool:
    """Whether ``job`` (one model) could be placed given the cycle's state at that moment: its
    quota (borrowing only what no lender claimed back), and ``job.nodes`` nodes of one cluster with
    its GPUs free that no reservation ahead of it holds."""
    snap, quota = world.snap, world.snap.quota
    if job.queue_id in quota.limited:
        key = (job.queue_id, job.model)
        room = headroom(quota, used, job)
        if used.get(key, 0) + job.total_gpus > quota.nominal.get(key, 0):
            room -= sum(
                g for q, m, g in claims.values() if q != job.queue_id and m == job.model and q in COHORT
            )
        if room < job.total_gpus:
            return False
    ok = snap.ready & (snap.model == job.model) & (free >= job.gpus)
    if book is not None:
        start, slack = book
        ok &= (start >= NOW + job.time_limit) | (slack >= job.gpus)
    return any(np.count_nonzero(ok & (snap.cluster == c)) >= job.nodes for c in range(len(snap.cluster_ids)))
