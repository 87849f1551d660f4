"""Property-based checks of the decision phase over random fleets and workloads (in memory:
the same code the cycle runs, without the database)."""

from __future__ import annotations

from collections import Counter, defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle.decide import decide
from scheduling.engine.framework import JobView
from scheduling.engine.policies import DEFAULT_PROFILE, build_profile
from scheduling.engine.queue import PendingQueue
from tests.scheduling.snapshots import node, snapshot

PROFILE = build_profile(DEFAULT_PROFILE)

nodes_strategy = st.lists(
    st.builds(
        lambda cluster, model, gpus, used, cpu, ready: node(
            cluster=cluster, model=model, gpus=gpus, free=gpus - min(used, gpus), cpu=cpu, ready=ready
        ),
        cluster=st.integers(0, 1),
        model=st.integers(0, 1),
        gpus=st.sampled_from([0, 4, 8]),
        used=st.integers(0, 8),
        cpu=st.sampled_from([8_000, 64_000]),
        ready=st.booleans(),
    ),
    min_size=1,
    max_size=12,
)
jobs_strategy = st.lists(
    st.tuples(
        st.integers(1, 3),
        st.integers(0, 1),
        st.sampled_from([0, 1, 2, 4, 8]),
        st.sampled_from([1, 1, 1, 2, 3]),
        st.sampled_from([0, 4_000, 32_000]),
        st.integers(-1, 1),
    ),
    min_size=1,
    max_size=40,
)
quota_strategy = st.dictionaries(
    st.tuples(st.integers(1, 3), st.integers(0, 1)), st.integers(0, 16), max_size=6
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=nodes_strategy, jobs=jobs_strategy, quota=quota_strategy, limit=st.none() | st.integers(0, 8))
def test_decisions_keep_every_invariant(nodes, jobs, quota, limit):
    snap = snapshot(*nodes)
    book = snap.quota
    for (queue, model), gpus in quota.items():
        book.limited.add(queue)
        book.nominal[(queue, model)] = gpus
        book.borrowing_limit[(queue, model)] = limit
    book.cohort_of = {1: "c", 2: "c"}
    book.members = {"c": [1, 2]}
    views = [
        JobView(
            id=i + 1,
            queue_id=q,
            project_id=q,
            priority=p,
            submitted_at=float(i),
            nodes=n,
            gpus=g,
            model=m if g else -1,
            cpu=cpu,
            memory=0,
        )
        for i, (q, m, g, n, cpu, p) in enumerate(jobs)
    ]
    cache = SchedulerCache()
    cache.snap = snap
    cache.queue = PendingQueue()
    cache.queue.load(views)
    before_free = snap.free_bits.copy()
    before_cpu = snap.cpu_free.copy()
    queues = {1: (0, 1.0, 1), 2: (0, 1.0, 2), 3: (5, 2.0, 3)}

    placements, _ = decide(PROFILE, cache, snap, 1, 10_000, queues=queues, policies={})

    taken: Counter[tuple[int, int]] = Counter()
    cpu_used: Counter[int] = Counter()
    used: Counter[tuple[int, int]] = Counter()
    for p in placements:
        job = p.job
        rows = [c.row for c in p.nodes]
        assert len(rows) == job.nodes == len(set(rows)), "a gang gets all its nodes, distinct"
        assert {int(snap.cluster[r]) for r in rows} == {p.cluster}, "a gang stays in one cluster"
        for choice in p.nodes:
            assert len(choice.gpu_indices) == job.gpus
            assert snap.ready[choice.row] and (not job.gpus or snap.model[choice.row] == job.model)
            for i in choice.gpu_indices:
                assert int(before_free[choice.row]) >> i & 1, "only a free, healthy GPU is handed out"
                taken[(choice.row, i)] += 1
            cpu_used[choice.row] += job.cpu
        if job.gpus:
            used[(job.queue_id, job.model)] += job.total_gpus
    assert all(n == 1 for n in taken.values()), "no GPU is handed out twice"
    assert all(cpu_used[r] <= before_cpu[r] for r in cpu_used), "no cpu overcommit"
    assert (snap.gpu_free >= 0).all() and (snap.cpu_free >= 0).all()
    for (queue, model), gpus in used.items():
        if queue not in book.limited:
            continue
        nominal = book.nominal.get((queue, model), 0)
        if queue not in book.cohort_of:
            assert gpus <= nominal, f"queue {queue} holds {gpus} of model {model}, quota {nominal}"
        elif (cap := book.borrowing_limit.get((queue, model))) is not None:
            # a model the queue has no quota row for has no borrowing limit either (as in Kueue)
            assert gpus <= nominal + cap, f"queue {queue} borrowed past its limit"
    for model in (0, 1):
        members = [q for q in book.members["c"] if q in book.limited]
        held = sum(used.get((q, model), 0) for q in members)
        assert held <= sum(book.nominal.get((q, model), 0) for q in members), "a cohort went past its quota"
    # Within a class, a job is placed only if every higher-priority (then older) job of it was.
    placed = {p.job.id for p in placements}
    by_shape = defaultdict(list)
    for v in views:
        by_shape[v.shape()].append(v)
    for members in by_shape.values():
        ordered = sorted(members, key=lambda v: (-v.priority, v.submitted_at))
        flags = [v.id in placed for v in ordered]
        assert flags == sorted(flags, reverse=True), "a lower-priority job jumped the queue within its class"
