"""One contract, two buffers: the in-process one of the embedded default and the Redis one."""

from __future__ import annotations

import threading

import pytest
from django.conf import settings

from clusters.ingest.buffer import MemoryBuffer, RedisBuffer


@pytest.fixture(params=["memory", "redis"])
def buffer(request):
    if request.param == "memory":
        yield MemoryBuffer()
        return
    assert settings.REDIS_URL, "make test runs with Redis"
    redis_buffer = RedisBuffer(settings.REDIS_URL, prefix=f"{settings.ORRERY_REDIS_PREFIX}contract:")
    redis_buffer.clear()
    yield redis_buffer
    redis_buffer.clear()


def rec(node: int, seq: int, boot: str = "b1", **extra) -> dict:
    return {"n": node, "c": 1, "b": boot, "q": seq, "t": 1000.0 + seq, "av": "1", "g": [], **extra}


def test_latest_report_wins_and_is_taken_once(buffer):
    assert buffer.put([rec(1, 1), rec(2, 1)]) == (2, 0)
    gpus = [
        [0, "", "h100", 0, 0, 40.0, 300.0, 50.0, "healthy", None],
        [1, "", "h100", 0, 0, 60.0, 100.0, 50.0, "unhealthy", 79],
    ]
    assert buffer.put([rec(1, 2, cpu=0.5, g=gpus)]) == (1, 0)
    taken = sorted(buffer.take_dirty(), key=lambda r: r["n"])
    assert [(r["n"], r["q"]) for r in taken] == [(1, 2), (2, 1)]
    # the aggregator gets the slim summary; the full record stays readable with latest()
    assert (taken[0]["k"], taken[0]["u"], taken[0]["p"], taken[0]["bad"]) == (2, 100.0, 400.0, [[1, 79]])
    assert len(taken[0]["fp"]) == 32 and taken[0]["fp"] != taken[1]["fp"]
    assert buffer.latest([1])[1]["cpu"] == 0.5
    assert buffer.take_dirty() == []


@pytest.mark.parametrize("seq", [5, 4, 0], ids=["replay", "older", "zero"])
def test_stale_and_replayed_reports_are_refused_and_counted(buffer, seq):
    buffer.put([rec(1, 5)])
    buffer.take_dirty()
    assert buffer.put([rec(1, seq)]) == (0, 1)
    assert buffer.take_dirty() == []
    assert buffer.latest([1])[1]["q"] == 5
    assert buffer.counters() == {"accepted": 1, "stale": 1}


def test_a_new_boot_starts_counting_again(buffer):
    buffer.put([rec(1, 900, boot="old")])
    assert buffer.put([rec(1, 1, boot="new")]) == (1, 0)
    assert buffer.latest([1])[1]["b"] == "new"


def test_restore_hands_nodes_out_again(buffer):
    buffer.put([rec(1, 1), rec(2, 1)])
    taken = buffer.take_dirty()
    buffer.restore(r["n"] for r in taken)
    assert sorted(r["n"] for r in buffer.take_dirty()) == [1, 2]


def test_reports_during_a_take_are_not_lost(buffer):
    buffer.put([rec(1, 1)])
    first = buffer.take_dirty()
    buffer.put([rec(1, 2)])
    second = buffer.take_dirty()
    assert [r["q"] for r in first] == [1] and [r["q"] for r in second] == [2]


def test_latest_of_all_and_of_some(buffer):
    buffer.put([rec(n, 1) for n in range(1, 6)])
    assert set(buffer.latest()) == {1, 2, 3, 4, 5}
    assert set(buffer.latest([2, 4, 99])) == {2, 4}


def test_clear_forgets_everything(buffer):
    buffer.put([rec(1, 1)])
    buffer.clear()
    assert buffer.latest() == {} and buffer.take_dirty() == []
    assert buffer.put([rec(1, 1)]) == (1, 0)


def test_concurrent_writers_and_takers_lose_nothing(buffer):
    """Writers send increasing seqs for 50 nodes while a taker drains: every node's final
    record must be its last seq, seen either in a take or still dirty."""
    last_seen: dict[int, int] = {}
    stop = threading.Event()

    def taker():
        while not stop.is_set():
            for r in buffer.take_dirty():
                last_seen[r["n"]] = max(last_seen.get(r["n"], 0), r["q"])

    def writer(nodes):
        for seq in range(1, 41):
            buffer.put([rec(n, seq) for n in nodes])

    threads = [threading.Thread(target=writer, args=(range(i, 50, 5),)) for i in range(5)]
    drain = threading.Thread(target=taker)
    drain.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    drain.join()
    for r in buffer.take_dirty():
        last_seen[r["n"]] = max(last_seen.get(r["n"], 0), r["q"])
    assert last_seen == dict.fromkeys(range(50), 40)
