"""Per-cluster dispatch rate: a burst of placements reaches each cluster at most at its rate (a
token bucket shared through the cache), each cluster's rows in order, none lost, and one
cluster's backlog never holding back another's rows."""

from __future__ import annotations

import threading
import time

import pytest
from django.core.cache import cache
from django.db import connection

from scheduling.dispatch.outbox import drain_outbox
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import run_cycle
from scheduling.models import DispatchOutbox
from tests.factories import make_cluster, make_job, make_node

RATE = 20  # works a second per cluster, for the test
JOBS = 64  # per cluster (eight full nodes): over three seconds at RATE


@pytest.fixture
def burst(alice, queue, settings):
    """Two simulated clusters (rated like a remote one, for the test), and ``JOBS`` placements on
    each: all of sim-a's rows older than sim-b's."""
    settings.ORRERY_DISPATCH_PER_CLUSTER_PER_S = RATE
    settings.ORRERY_DISPATCH_PER_S_BY_KIND = {}
    cache.clear()
    rows = {}
    for name in ("sim-a", "sim-b"):
        cluster = make_cluster(name)
        for i in range(JOBS // 8):
            make_node(cluster, gpus=8, name=f"{name}-{i}")
        jobs = [make_job(alice, queue, gpus=1, spec={"placement": {"clusters": [name]}}) for _ in range(JOBS)]
        assert run_cycle(SchedulerCache()).placed == len(jobs)
        rows[cluster.pk] = list(DispatchOutbox.objects.filter(cluster=cluster).order_by("id"))
        assert len(rows[cluster.pk]) == JOBS
    yield rows
    cache.clear()


def _sent(cluster_id: int) -> list[int]:
    return list(
        DispatchOutbox.objects.filter(cluster_id=cluster_id, state=DispatchOutbox.State.SENT)
        .order_by("id")
        .values_list("pk", flat=True)
    )


def _watch(rows: dict[int, list], drains: int) -> list[tuple[float, dict[int, list[int]]]]:
    """Drain as sweeps would (``drains`` drains side by side, one every 50 ms each) until every
    row is sent or 20 s pass; what was sent after each pass, with when."""
    started, seen = time.monotonic(), []

    def sweep() -> None:
        try:
            pending = DispatchOutbox.objects.filter(state=DispatchOutbox.State.PENDING)
            while time.monotonic() - started < 20 and pending.exists():
                drain_outbox()
                time.sleep(0.05)
        finally:
            connection.close()

    threads = [threading.Thread(target=sweep) for _ in range(drains - 1)]
    for thread in threads:
        thread.start()
    while time.monotonic() - started < 20:
        drain_outbox()
        seen.append((time.monotonic() - started, {c: _sent(c) for c in rows}))
        if all(len(sent) == JOBS for sent in seen[-1][1].values()):
            break
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    return seen


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("drains", [1, 2], ids=["one-worker", "two-workers"])
def test_a_burst_goes_out_at_the_clusters_rate_in_order_and_whole(burst, drains):
    seen = _watch(burst, drains)
    final = seen[-1][1]
    for cluster_id, rows in burst.items():
        assert final[cluster_id] == [r.pk for r in rows]  # nothing lost, nothing left behind
    for at, sent in seen:
        for cluster_id, rows in burst.items():
            ids = [r.pk for r in rows]
            # In order: what a cluster has been sent is always its oldest rows.
            assert sent[cluster_id] == ids[: len(sent[cluster_id])]
            # At its rate: a full bucket (one second's worth) and then RATE a second, never more
            # (one token of slack for the clock read between a drain and this check).
            assert len(sent[cluster_id]) <= RATE + RATE * at + 1, (at, len(sent[cluster_id]))
    # sim-b's rows, all newer than sim-a's, did not wait for sim-a's backlog.
    a, b = burst
    b_started = min(at for at, sent in seen if sent[b])
    assert b_started < min(at for at, sent in seen if len(sent[a]) == JOBS)
    assert seen[-1][0] >= (JOBS - RATE) / RATE * 0.9  # it took the time the rate says, give or take
