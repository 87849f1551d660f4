"""Per-user limits (``user_limits``) and array throttles (``array_throttle``): in memory through the
decision phase, then end to end through cycles against the database (the issue's scenario, a limit
set while the scheduler runs, counts rebuilt from the database)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduling.choices import EventKind, JobState, PendingReason
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import run_cycle
from scheduling.engine.framework import NO_GPU, JobView
from scheduling.models import Job, JobEvent, Queue
from scheduling.services.jobs import cancel_job
from scheduling.services.transitions import transition_job
from tests.factories import make_job, make_project, make_queue
from tests.scheduling.snapshots import node, snapshot
from tests.scheduling.worlds import NEVER_PREEMPT, NOW, QUEUES, WITHIN_QUEUE, World, first_fit, view, world_of

ALICE, BOB = 1, 2
R = PendingReason


def job(
    job_id: int, gpus: int = 1, *, owner: int = ALICE, array: int = 0, throttle: int = 0, **fields
) -> JobView:
    """A job of queue 1 (limited per user in these worlds) unless ``queue`` says otherwise."""
    v = view(job_id, gpus, **fields)
    return replace(v, owner=owner, per_user=v.queue_id == 1, array=array, throttle=throttle)


def cpu_job(job_id: int, *, owner: int = ALICE) -> JobView:
    return job(job_id, 0, owner=owner, model=NO_GPU)


def limited(
    *nodes: dict, max_jobs: int | None = None, max_gpus: int | None = None, policies: dict | None = None
) -> World:
    """Queue 1 ("vision/default") limits each user to ``max_jobs`` running jobs and ``max_gpus``
    GPUs; the other queues limit nobody. Two 8-GPU nodes unless ``nodes`` says otherwise."""
    world = world_of(
        snapshot(*(nodes or (node(), node()))), [], [], policies or {q: NEVER_PREEMPT for q in QUEUES}
    )
    book = world.snap.limits
    if max_jobs is not None:
        book.max_jobs[1] = max_jobs
    if max_gpus is not None:
        book.max_gpus[1] = max_gpus
    book.owners |= {ALICE: "alice", BOB: "bob"}
    world.snap.queue_names |= {1: "vision/default", 3: "nlp/default"}
    return world


def waiting(decided) -> dict[int, tuple[str, str]]:
    """The head of each blocked class → (reason, message)."""
    return {b.cls.head.id: (b.status.reason, b.status.message) for b in decided.blocked}


def placed(decided) -> list[int]:
    return sorted(p.job.id for p in decided.placements)


@dataclass
class Case:
    max_jobs: int | None = None
    max_gpus: int | None = None
    running: list[JobView] = field(default_factory=list)
    pending: list[JobView] = field(default_factory=list)
    placed: list[int] = field(default_factory=list)
    waiting: dict[int, tuple[str, str]] = field(default_factory=dict)
    nodes: int = 2


CASES = {
    "the-issue-both-limits-1-one-of-three-runs": Case(
        max_jobs=1,
        max_gpus=1,
        pending=[job(1), job(2), job(3)],
        placed=[1],
        waiting={2: (R.MAX_JOBS_PER_USER, "alice has 1/1 running jobs in vision/default")},
    ),
    "jobs-placed-earlier-in-the-cycle-count": Case(
        max_jobs=2,
        pending=[job(i) for i in range(1, 6)],
        placed=[1, 2],
        waiting={3: (R.MAX_JOBS_PER_USER, "alice has 2/2 running jobs in vision/default")},
    ),
    "running-jobs-count": Case(
        max_jobs=2,
        running=[job(100)],
        pending=[job(1), job(2)],
        placed=[1],
        waiting={2: (R.MAX_JOBS_PER_USER, "alice has 2/2 running jobs in vision/default")},
    ),
    "a-cpu-only-job-runs-and-counts": Case(
        max_jobs=1,
        running=[cpu_job(100)],
        pending=[job(1)],
        waiting={1: (R.MAX_JOBS_PER_USER, "alice has 1/1 running jobs in vision/default")},
    ),
    "limits-are-per-user-bob-is-unaffected-by-alice": Case(
        max_jobs=1,
        running=[job(100)],
        pending=[job(1), job(2), job(3, owner=BOB), job(4, owner=BOB)],
        placed=[3],
        waiting={
            1: (R.MAX_JOBS_PER_USER, "alice has 1/1 running jobs in vision/default"),
            4: (R.MAX_JOBS_PER_USER, "bob has 1/1 running jobs in vision/default"),
        },
    ),
    "bob's-running-jobs-do-not-count-for-alice": Case(
        max_jobs=1, max_gpus=4, running=[job(100, 4, owner=BOB)], pending=[job(1, 4)], placed=[1]
    ),
    "jobs-of-another-queue-do-not-count": Case(
        max_jobs=1, running=[job(100, queue=3)], pending=[job(1), job(2, queue=3)], placed=[1, 2]
    ),
    "a-queue-without-limits-limits-nobody": Case(
        pending=[job(i, queue=3) for i in range(1, 5)], placed=[1, 2, 3, 4]
    ),
    "a-limit-of-0-runs-nothing": Case(
        max_jobs=0,
        pending=[job(1)],
        waiting={1: (R.MAX_JOBS_PER_USER, "alice has 0/0 running jobs in vision/default")},
    ),
    "gpu-limit-with-multi-gpu-jobs": Case(
        max_gpus=8,
        running=[job(100, 4)],
        pending=[job(1, 4), job(2, 4)],
        placed=[1],
        waiting={2: (R.MAX_GPUS_PER_USER, "alice holds 8/8 GPUs in vision/default; this job needs 4")},
    ),
    "gpu-limit-lets-a-smaller-job-past-a-bigger-one": Case(
        max_gpus=8,
        running=[job(100, 4)],
        pending=[job(1, 8), job(2, 2)],
        placed=[2],
        waiting={1: (R.MAX_GPUS_PER_USER, "alice holds 4/8 GPUs in vision/default; this job needs 8")},
    ),
    "gpu-limit-counts-a-gang-whole": Case(
        max_gpus=16,
        nodes=4,
        pending=[job(1, 8, nodes=2), job(2, 8, nodes=2)],
        placed=[1],
        waiting={2: (R.MAX_GPUS_PER_USER, "alice holds 16/16 GPUs in vision/default; this job needs 16")},
    ),
    "a-gang-larger-than-the-limit-says-it-never-fits": Case(
        max_gpus=8,
        pending=[job(1, 8, nodes=2)],
        waiting={
            1: (
                R.MAX_GPUS_PER_USER,
                "alice holds 0/8 GPUs in vision/default; this job needs 16, more than the queue allows "
                "one user",
            )
        },
    ),
    "a-gpu-limit-does-not-hold-cpu-only-jobs": Case(
        max_gpus=1, running=[job(100, 1)], pending=[cpu_job(1)], placed=[1]
    ),
    "both-limits-the-first-reached-is-said": Case(
        max_jobs=3,
        max_gpus=4,
        running=[job(100, 2)],
        pending=[job(1, 2), job(2, 2)],
        placed=[1],
        waiting={2: (R.MAX_GPUS_PER_USER, "alice holds 4/4 GPUs in vision/default; this job needs 2")},
    ),
    "array-throttle-3-of-10-members-run": Case(
        pending=[job(i, queue=3, array=74, throttle=3) for i in range(1, 11)],
        placed=[1, 2, 3],
        waiting={4: (R.ARRAY_TASK_LIMIT, "array 74 runs 3/3 tasks (throttle)")},
    ),
    "array-members-running-count": Case(
        running=[job(100 + i, queue=3, array=74, throttle=3) for i in range(2)],
        pending=[job(i, queue=3, array=74, throttle=3) for i in range(1, 4)],
        placed=[1],
        waiting={2: (R.ARRAY_TASK_LIMIT, "array 74 runs 3/3 tasks (throttle)")},
    ),
    "arrays-are-throttled-each-on-its-own": Case(
        pending=[job(i, queue=3, array=74, throttle=1) for i in range(1, 4)]
        + [job(i, queue=3, array=75, throttle=2) for i in range(4, 7)],
        placed=[1, 4, 5],
        waiting={
            2: (R.ARRAY_TASK_LIMIT, "array 74 runs 1/1 tasks (throttle)"),
            6: (R.ARRAY_TASK_LIMIT, "array 75 runs 2/2 tasks (throttle)"),
        },
    ),
    "an-array-without-throttle-runs-as-capacity-allows": Case(
        pending=[job(i, queue=3, array=74) for i in range(1, 11)], placed=list(range(1, 11))
    ),
    "a-throttled-array-in-a-limited-queue-meets-both": Case(
        max_jobs=2,
        pending=[job(i, array=74, throttle=3) for i in range(1, 5)],
        placed=[1, 2],
        waiting={3: (R.MAX_JOBS_PER_USER, "alice has 2/2 running jobs in vision/default")},
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_limits_hold_jobs_back_with_a_reason(case):
    world = limited(*(node() for _ in range(case.nodes)), max_jobs=case.max_jobs, max_gpus=case.max_gpus)
    for v in case.running:
        world.start(v, NOW - 60, rows=None if v.gpus else [0])
    world.submit(*case.pending)
    decided = world.decide()
    assert placed(decided) == case.placed
    assert waiting(decided) == case.waiting
    assert decided.preemptions == [] and not decided.reservations


def test_a_limit_is_released_when_a_job_ends():
    world = limited(max_jobs=1, max_gpus=1)
    world.submit(job(1), job(2), job(3))
    assert placed(world.decide()) == [1]
    assert placed(world.decide(now=NOW + 10)) == [], "nothing changed: the same verdict"
    world.stop(1)
    assert placed(world.decide(now=NOW + 20)) == [2]
    assert world.snap.limits.jobs == {(1, ALICE): 1} and world.snap.limits.gpus == {(1, ALICE): 1}
    world.stop(2)
    assert placed(world.decide(now=NOW + 30)) == [3]


def test_counts_follow_placements_and_releases_exactly():
    world = limited(node(), node(), node(), max_jobs=5)
    world.submit(job(1, 2), job(2, 8, nodes=2, owner=BOB), job(3, 1, array=74, throttle=2))
    world.decide()
    book = world.snap.limits
    assert (book.jobs, book.gpus, book.members) == (
        {(1, ALICE): 2, (1, BOB): 1},
        {(1, ALICE): 3, (1, BOB): 16},
        {74: 1},
    )
    world.stop(1, 2, 3)
    assert (book.jobs, book.gpus, book.members) == ({}, {}, {}), "nothing is left over once all ended"


@pytest.mark.parametrize("limit", [1, 2], ids=["at-her-limit", "within-her-limit"])
def test_a_limited_job_preempts_nobody(limit):
    """Alice's high-priority job would preempt bob's low-priority one — unless her limit holds it."""
    world = limited(max_jobs=limit, policies={1: WITHIN_QUEUE})
    world.start(job(100, 8), NOW - 60, rows=[0])
    world.start(job(101, 8, owner=BOB), NOW - 30, rows=[1])  # less work lost: the cheaper victim
    world.submit(job(1, 8, priority=10))
    decided = world.decide()
    if limit == 1:
        assert decided.preemptions == [] and decided.estimates == {}
        assert waiting(decided)[1][0] == R.MAX_JOBS_PER_USER
    else:
        assert [d.victims for d in decided.preemptions] == [(101,)], "the control: it does preempt"


@pytest.mark.parametrize("limit", [1, 2], ids=["at-her-limit", "within-her-limit"])
def test_a_limited_job_reserves_nothing_and_others_fill_the_gap(limit):
    """Bob's job without a time limit (queue 3) may start now only if no reservation is ahead of
    it; alice's 8-GPU job would hold one — unless her limit keeps her waiting anyway."""
    world = limited(node(), max_jobs=limit)
    world.start(job(100, 4, queue=3, owner=BOB, limit=600), NOW - 60)
    world.start(cpu_job(101), NOW - 60, rows=[0])
    world.submit(job(1, 8, priority=10, limit=3600), job(2, 4, queue=3, owner=BOB))
    decided = world.decide()
    if limit == 1:
        assert placed(decided) == [2] and decided.reservations == {} and 1 not in decided.estimates
    else:
        assert placed(decided) == [] and 1 in decided.reservations, "the control: it reserves"


@pytest.mark.parametrize("limit", [1, 2], ids=["at-her-limit", "within-her-limit"])
def test_a_limited_job_claims_no_lent_quota(limit):
    """Queue 1 lent quota to queue 2; alice's job within queue 1's quota would claim it back and
    stop queue 2 borrowing — unless her limit keeps her waiting anyway."""
    world = limited(max_jobs=limit)
    quota = world.snap.quota
    quota.cohort_of, quota.members = {1: "c", 2: "c"}, {"c": [1, 2]}
    quota.limited |= {1, 2}
    quota.nominal |= {(1, 0): 8, (2, 0): 2}
    quota.borrowing_limit |= {(1, 0): None, (2, 0): None}
    world.start(job(1000, 8, queue=2, owner=BOB), NOW - 100, rows=[0])
    world.start(cpu_job(101), NOW - 60, rows=[1])
    world.submit(job(1, 8), job(2, 2, queue=2, owner=BOB))
    decided = world.decide()
    if limit == 1:
        assert world.cache.claims == {} and placed(decided) == [2]
    else:
        assert world.cache.claims == {1: (1, 0, 8)} and placed(decided) == [], "the control: it claims"


# --- the invariant over random worlds ---------------------------------------------------------

limits_strategy = st.dictionaries(
    st.integers(1, 3), st.tuples(st.none() | st.integers(0, 3), st.none() | st.integers(0, 12))
)
jobs_strategy = st.lists(
    st.tuples(
        st.integers(1, 3),  # queue
        st.integers(1, 3),  # owner
        st.sampled_from([0, 1, 2, 4, 8]),  # GPUs per node
        st.sampled_from([1, 1, 2]),  # nodes
        st.sampled_from([(0, 0), (0, 0), (74, 2), (75, 1), (76, 0)]),  # array, throttle
        st.booleans(),  # running already
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(limits=limits_strategy, jobs=jobs_strategy)
def test_no_cycle_takes_an_owner_or_an_array_past_its_limits(limits, jobs):
    world = world_of(snapshot(*(node(cluster=i % 2) for i in range(4))), [], [], {})
    book = world.snap.limits
    for queue, (most_jobs, most_gpus) in limits.items():
        if most_jobs is not None:
            book.max_jobs[queue] = most_jobs
        if most_gpus is not None:
            book.max_gpus[queue] = most_gpus
    views = [
        JobView(
            id=i + 1,
            queue_id=q,
            project_id=q,
            priority=0,
            submitted_at=float(i),
            nodes=n,
            gpus=g,
            model=0 if g else NO_GPU,
            cpu=0,
            memory=0,
            owner=owner,
            per_user=book.limits_users(q),
            array=array,
            throttle=throttle,
        )
        for i, (q, owner, g, n, (array, throttle), _) in enumerate(jobs)
    ]
    for v, (*_, running) in zip(views, jobs, strict=True):
        rows = first_fit(world.snap, v) if v.gpus else [0]
        if running and rows is not None:
            world.start(v, NOW - 60, rows=rows)
        elif not running:
            world.submit(v)
    before_jobs, before_gpus, before_members = Counter(book.jobs), Counter(book.gpus), Counter(book.members)

    decided = world.decide()

    jobs_added, gpus_added, members_added = Counter(), Counter(), Counter()
    for p in decided.placements:
        v = p.job
        jobs_added[(v.queue_id, v.owner)] += 1
        gpus_added[(v.queue_id, v.owner)] += v.total_gpus
        if v.array:
            members_added[v.array] += 1
    for key, n in jobs_added.items():
        most = book.max_jobs.get(key[0])
        assert most is None or before_jobs[key] + n <= most, f"{key} runs past {most} jobs"
    for key, gpus in gpus_added.items():
        most = book.max_gpus.get(key[0])
        assert most is None or not gpus or before_gpus[key] + gpus <= most, f"{key} holds past {most} GPUs"
    for array, n in members_added.items():
        throttle = next(v.throttle for v in views if v.array == array)
        assert not throttle or before_members[array] + n <= throttle, f"array {array} past its throttle"
    # The book is what the cache counted for every job holding resources, nothing else.
    recount_jobs, recount_gpus = Counter(), Counter()
    for queue, owner, _, gpus in world.cache.limit_counted.values():
        recount_jobs[(queue, owner)] += 1
        recount_gpus[(queue, owner)] += gpus
    assert book.jobs == dict(recount_jobs)
    assert book.gpus == {k: g for k, g in recount_gpus.items() if g}
    for b in decided.blocked:
        if b.status.reason in (R.MAX_JOBS_PER_USER, R.MAX_GPUS_PER_USER, R.ARRAY_TASK_LIMIT):
            assert b.cls.head.id not in decided.estimates, "a job held by a limit holds no reservation"


# --- through cycles, against the database -----------------------------------------------------


def submit(owner, queue, **fields) -> Job:
    """A pending job as submission leaves it: the row and its 'submitted' event."""
    job = make_job(owner, queue, **fields)
    JobEvent.objects.create(job=job, kind=EventKind.SUBMITTED, to_state=JobState.PENDING)
    return job


def states(jobs: list[Job]) -> list[str]:
    return [Job.objects.get(pk=j.pk).state for j in jobs]


@pytest.mark.django_db
def test_the_issue_three_one_gpu_jobs_with_both_limits_1_run_one_at_a_time(alice, queue, fleet):
    Queue.objects.filter(pk=queue.pk).update(max_running_jobs_per_user=1, max_gpus_per_user=1)
    jobs = [make_job(alice, queue, gpus=1) for _ in range(3)]
    cache = SchedulerCache()
    assert run_cycle(cache).placed == 1
    assert states(jobs) == [JobState.SCHEDULED, JobState.PENDING, JobState.PENDING]
    for waiting_job in jobs[1:]:
        waiting_job.refresh_from_db()
        assert (waiting_job.reason, waiting_job.reason_message) == (
            R.MAX_JOBS_PER_USER,
            "alice has 1/1 running jobs in vision/default",
        )
    assert run_cycle(cache).placed == 0
    transition_job(jobs[0].pk, JobState.RUNNING)
    transition_job(jobs[0].pk, JobState.SUCCEEDED)
    snap = cache.snap
    assert run_cycle(cache).placed == 1, "the limit is released when the job ends"
    assert cache.snap is snap, "kept current from events, not rebuilt"
    assert states(jobs)[1:] == [JobState.SCHEDULED, JobState.PENDING]


@pytest.mark.django_db
def test_a_limit_set_while_the_scheduler_runs_holds_from_the_next_cycle(alice, bob, queue, fleet):
    cache = SchedulerCache()
    first = make_job(alice, queue, gpus=2)
    assert run_cycle(cache).placed == 1
    Queue.objects.filter(pk=queue.pk).update(max_gpus_per_user=4)
    more = [submit(alice, queue, gpus=2), submit(alice, queue, gpus=2), submit(bob, queue, gpus=2)]
    assert run_cycle(cache).placed == 2
    assert states([first, *more]) == [
        JobState.SCHEDULED,
        JobState.SCHEDULED,
        JobState.PENDING,
        JobState.SCHEDULED,
    ]
    held = Job.objects.get(pk=more[1].pk)
    assert (held.reason, held.reason_message) == (
        R.MAX_GPUS_PER_USER,
        "alice holds 4/4 GPUs in vision/default; this job needs 2",
    )
    Queue.objects.filter(pk=queue.pk).update(max_gpus_per_user=None)
    assert run_cycle(cache).placed == 1, "a limit lifted lets the job go"


@pytest.mark.django_db
def test_an_array_throttle_keeps_3_of_10_members_active(alice, queue, fleet):
    members = [
        make_job(alice, queue, gpus=1, array_id=74, array_index=i, array_throttle=3) for i in range(10)
    ]
    cache = SchedulerCache()
    assert run_cycle(cache).placed == 3
    assert Counter(states(members)) == {JobState.SCHEDULED: 3, JobState.PENDING: 7}
    told = Job.objects.filter(pk__in=[m.pk for m in members], state=JobState.PENDING)
    assert set(told.values_list("reason", "reason_message")) == {
        (R.ARRAY_TASK_LIMIT, "array 74 runs 3/3 tasks (throttle)")
    }
    cancel_job(Job.objects.get(pk=members[0].pk), actor=alice)
    assert run_cycle(cache).placed == 1, "one member ended: one more starts"


@pytest.mark.django_db
def test_counts_rebuilt_from_the_database_equal_those_kept_incrementally(alice, bob, queue, fleet):
    other = make_queue(make_project("nlp", members=(bob,)), max_running_jobs_per_user=1)
    Queue.objects.filter(pk=queue.pk).update(max_running_jobs_per_user=2)
    for _ in range(3):
        make_job(alice, queue, gpus=2)
        make_job(bob, queue, gpus=1, array_id=90, array_throttle=2)
        make_job(bob, other, gpus=4, nodes=1)
    cache = SchedulerCache()
    run_cycle(cache)
    kept = cache.snap.limits
    fresh = SchedulerCache()
    fresh.ensure()
    rebuilt = fresh.snap.limits
    assert (
        kept.jobs == rebuilt.jobs == {(queue.pk, alice.pk): 2, (queue.pk, bob.pk): 2, (other.pk, bob.pk): 1}
    )
    assert kept.gpus == rebuilt.gpus and kept.members == rebuilt.members == {90: 2}
    assert rebuilt.owners == {alice.pk: "alice", bob.pk: "bob"}


@pytest.mark.django_db
def test_jobs_of_a_queue_without_limits_share_one_class_across_owners(alice, bob, queue):
    """Owners split classes only where a queue limits users: elsewhere one class, one mask."""
    make_job(alice, queue, gpus=1)
    make_job(bob, queue, gpus=1)
    cache = SchedulerCache()
    cache.ensure()
    assert len(cache.queue.classes) == 1
    Queue.objects.filter(pk=queue.pk).update(max_running_jobs_per_user=5)
    cache.ensure()
    assert len(cache.queue.classes) == 2
    assert {v.per_user for v in cache.queue.jobs.values()} == {True}
