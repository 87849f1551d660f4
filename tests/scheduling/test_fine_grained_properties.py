"""Property-based checks that fine-grained GPUs are never oversubscribed: over random fleets
(GPUs whole, in MIG mode or shareable, some unhealthy, some memory in use per telemetry) and
random mixes of whole, MIG and shared jobs, decided by the cycle's own decide phase in memory,
with some jobs ending between cycles.

Invariants: no MIG instance is handed out twice, nor one of an unhealthy GPU; a shared GPU never
gives more memory than it has, less what its telemetry says is in use; no GPU is held whole
while any fraction of it is held, nor a GPU in MIG mode whole."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle.decide import decide
from scheduling.engine.framework import WHOLE, JobView
from scheduling.engine.policies import DEFAULT_PROFILE, build_profile
from scheduling.engine.queue import PendingQueue
from scheduling.engine.snapshot import SharedGpu, Snapshot

PROFILE = build_profile(DEFAULT_PROFILE)
PROFILES = ["1g.10gb", "3g.40gb"]
MEMORY = 80_000
LAYOUTS = [["1g.10gb"] * 7, ["3g.40gb", "3g.40gb"], ["3g.40gb", "1g.10gb", "1g.10gb"]]

gpu_strategy = st.tuples(
    st.sampled_from(["whole", "mig", "shared"]),
    st.integers(0, len(LAYOUTS) - 1),
    st.booleans(),  # healthy
    st.sampled_from([0, 0, 30_000, 75_000]),  # memory in use per telemetry (shared GPUs)
)
node_strategy = st.lists(gpu_strategy, min_size=1, max_size=4)
job_strategy = st.tuples(
    st.sampled_from(["whole", "mig", "memory", "share"]),
    st.integers(1, 3),  # GPUs (whole) or instances (MIG)
    st.integers(0, 1),  # MIG profile
    st.sampled_from([5_000, 20_000, 40_000, 80_000]),  # MiB
    st.sampled_from([100, 250, 500, 1000]),  # thousandths
)


def build(nodes: list[list[tuple[str, int, bool, int]]]) -> tuple[Snapshot, dict[int, tuple[int, int]]]:
    """The snapshot of the fleet, and each instance's (row, GPU index)."""
    n = len(nodes)
    free_bits = np.zeros(n, dtype=np.uint64)
    total = np.zeros(n, dtype=np.int32)
    mig_all: dict[int, list[tuple[int, int, int]]] = {}
    mig_gpus: dict[int, set[int]] = {}
    shared: dict[int, dict[int, SharedGpu]] = {}
    sick: dict[int, set[int]] = {}
    owner: dict[int, tuple[int, int]] = {}
    instance = 0
    for row, gpus in enumerate(nodes):
        for index, (kind, layout, healthy, in_use) in enumerate(gpus):
            if not healthy and kind != "whole":
                sick.setdefault(row, set()).add(index)
            if kind == "mig":
                mig_gpus.setdefault(row, set()).add(index)
                for profile in LAYOUTS[layout]:
                    instance += 1
                    mig_all.setdefault(row, []).append((instance, PROFILES.index(profile), index))
                    owner[instance] = (row, index)
                continue
            if kind == "shared":
                shared.setdefault(row, {})[index] = SharedGpu(MEMORY, actual=in_use, healthy=healthy)
            if healthy:
                free_bits[row] |= np.uint64(1 << index)
                total[row] += 1
    snap = Snapshot(
        node_id=np.arange(1, n + 1, dtype=np.int64),
        cluster=np.zeros(n, dtype=np.int32),
        model=np.zeros(n, dtype=np.int32),
        ready=np.ones(n, dtype=bool),
        gpu_total=total,
        gpu_free=total.copy(),
        free_bits=free_bits,
        cpu_free=np.full(n, 64_000, dtype=np.int64),
        mem_free=np.full(n, 2**40, dtype=np.int64),
        cluster_ids=[100],
        cluster_names=["c0"],
        model_ids=[1],
        model_names=["a100-80g"],
        gpu_ids=[{i: 1000 * r + i for i in range(len(g))} for r, g in enumerate(nodes)],
        groups=[{} for _ in nodes],
        labels=[{} for _ in nodes],
        names=[f"n{r}" for r in range(n)],
        gpu_mem=np.full(n, MEMORY, dtype=np.int32),
        mig_profiles=PROFILES,
        mig_all=mig_all,
        mig_gpus=mig_gpus,
        sick=sick,
        shared=shared,
    )
    for row in mig_all:
        snap._recount_mig(row)
    for row in shared:
        snap._recount_shared(row)
    return snap, owner


def views(jobs: list[tuple[str, int, int, int, int]], first_id: int) -> list[JobView]:
    out = []
    for i, (kind, count, profile, mb, milli) in enumerate(jobs):
        out.append(
            JobView(
                id=first_id + i,
                queue_id=1,
                project_id=1,
                priority=0,
                submitted_at=float(first_id + i),
                nodes=1,
                gpus=count if kind in ("whole", "mig") else 1,
                model=0,
                cpu=0,
                memory=0,
                slice=profile if kind == "mig" else WHOLE,
                share_mb=mb if kind == "memory" else 0,
                share_milli=milli if kind == "share" else 0,
            )
        )
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.lists(node_strategy, min_size=1, max_size=5),
    first=st.lists(job_strategy, min_size=1, max_size=25),
    second=st.lists(job_strategy, min_size=0, max_size=25),
    ending=st.sets(st.integers(1, 25)),
)
def test_fine_grained_gpus_are_never_oversubscribed(nodes, first, second, ending):
    snap, owner = build(nodes)
    healthy_bits = snap.free_bits.copy()
    in_use = {(row, i): g.actual for row, gpus in snap.shared.items() for i, g in gpus.items()}
    cache = SchedulerCache()
    cache.snap = snap
    cache.queue = PendingQueue()
    cache.queue.load(views(first, 1))
    queues = {1: (0, 1.0, 1)}
    held: dict[int, list] = {}
    for round_jobs in (None, second):
        if round_jobs is not None:
            for job_id in sorted(ending & set(held)):  # some jobs end: what they held comes back
                cache._release(job_id)
                del held[job_id]
            cache.queue.load(views(round_jobs, 100))
        placements, _ = decide(PROFILE, cache, snap, 1, 10_000, queues=queues, policies={})
        for p in placements:
            held[p.job.id] = list(p.nodes)
            for c in p.nodes:
                wanted = p.job.gpus if not p.job.shared else 1
                assert len(c.gpu_indices) == wanted, "a job got fewer GPUs or instances than it asked"
                assert len(c.instances) == (p.job.gpus if p.job.slice >= 0 else 0)
        instances: Counter[int] = Counter()
        shared_mb: defaultdict[tuple[int, int], int] = defaultdict(int)
        whole: Counter[tuple[int, int]] = Counter()
        for choices in held.values():
            for c in choices:
                for inst in c.instances:
                    instances[inst] += 1
                    row, gpu = owner[inst]
                    assert row == c.row and gpu not in snap.sick.get(row, set()), "an instance of a sick GPU"
                if c.share_mb:
                    shared_mb[(c.row, c.gpu_indices[0])] += c.share_mb
                if not c.instances and not c.share_mb:
                    for i in c.gpu_indices:
                        whole[(c.row, i)] += 1
                        assert int(healthy_bits[c.row]) >> i & 1, "a sick or MIG-mode GPU was given whole"
        assert all(n == 1 for n in instances.values()), "a MIG instance was handed out twice"
        assert all(n == 1 for n in whole.values()), "a GPU was handed out whole twice"
        for (row, i), mb in shared_mb.items():
            assert i in snap.shared.get(row, {}), "a fraction of a GPU that is not shareable"
            assert (row, i) not in whole, "a GPU held whole while a fraction of it is held"
            assert mb <= MEMORY, "a shared GPU gave more memory than it has"
        assert (snap.mig_free >= 0).all() and (snap.gpu_free >= 0).all()
    # A fraction fits what the GPU has free, telemetry included: never more than its memory less
    # what is in use there.
    for choices in held.values():
        for c in choices:
            if c.share_mb:
                assert c.share_mb <= MEMORY - in_use[(c.row, c.gpu_indices[0])], "placed past memory in use"
