"""Beat in two copies: the lease decides who sends (real beat processes on PostgreSQL and Redis)."""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request

import pytest
from django.db.models.functions import Now

from foundation.beat import Lease
from foundation.models import BeatLease
from tests.processes import Service, celery_beat_argv, control_plane_env, forget_queues, free_port, wait
from tests.processes import queued_tasks as queued

CYCLE = "scheduling.tasks.scheduling_cycle_task"  # every second in the schedule


@pytest.mark.django_db
def test_a_lease_is_renewed_by_its_holder_and_taken_only_once_its_time_is_up():
    a, b = Lease("sched", "a", ttl_s=60), Lease("sched", "b", ttl_s=60)
    assert a.claim().term == 1
    assert b.claim() is None  # a holds it
    assert a.claim().term == 1  # a renewal keeps the term
    BeatLease.objects.filter(name="sched").update(expires_at=Now())  # a's time is up
    taken = b.claim()
    assert (taken.term, taken.previous) == (2, "a")
    assert a.claim() is None
    b.release()
    assert a.claim().previous == "b"


@pytest.fixture
def beats(tmp_path):
    """Two beat processes on one queue prefix, lease 2 s, each serving its metrics."""
    env = control_plane_env(tmp_path, ORRERY_BEAT_LEASE_S="2")
    started = []
    ports = {free_port() for _ in range(4)}  # two distinct ones, even if the system hands one out twice
    for n in (1, 2):
        port = ports.pop()
        beat_env = {**env, "ORRERY_BEAT_METRICS_PORT": str(port)}
        beat = Service(celery_beat_argv(beat_env, tmp_path), beat_env, tmp_path / f"beat-{n}.log")
        beat.metrics_port = port
        started.append(beat.start())
    try:
        for beat in started:
            wait(lambda beat=beat: "beat: Starting" in beat.log.read_text(), "beat to start", timeout=60)
        yield env, started
    finally:
        for beat in started:
            beat.stop()
        forget_queues(env)


def cycles_sent(env) -> int:
    return queued(env).count(CYCLE)


@pytest.mark.django_db(transaction=True)
def test_two_beats_send_each_entry_once_per_interval(beats):
    env, _ = beats
    wait(lambda: cycles_sent(env) >= 2, "the schedule to be sent", timeout=30)
    before, started = cycles_sent(env), time.monotonic()
    time.sleep(5)
    sent, elapsed = cycles_sent(env) - before, time.monotonic() - started
    # One sender: one cycle a second (a tick may slip on a loaded machine); two would send twice.
    assert elapsed / 2 <= sent <= elapsed + 2, (sent, elapsed)


@pytest.mark.django_db(transaction=True)
def test_the_standby_takes_over_within_the_lease_when_the_holder_is_killed(beats):
    env, started = beats
    lease = BeatLease.objects.filter(name=env["ORRERY_CELERY_QUEUE"])
    holder = wait(lambda: lease.values_list("holder", flat=True).first(), "a beat to take the lease")
    leader = next(b for b in started if f":{b.process.pid}:" in holder)
    standby = next(b for b in started if b is not leader)
    os.kill(leader.process.pid, signal.SIGKILL)
    leader.process.wait()
    killed, before = time.monotonic(), cycles_sent(env)
    wait(lambda: cycles_sent(env) > before, "the standby to send", timeout=30)
    takeover_s = time.monotonic() - killed
    print(f"beat takeover: {takeover_s:.2f} s (lease 2 s)")
    # lease + one standby tick (0.5 s), with room for a loaded machine
    assert takeover_s <= 2 + 0.5 + 3, takeover_s
    assert re.search(rf"took the lease from \S+:{leader.process.pid}:", standby.log.read_text())
    assert f":{standby.process.pid}:" in lease.get().holder
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{standby.metrics_port}/metrics", timeout=5).read()
    assert b"orrery_beat_takeovers_total 1.0" in metrics
    assert b"orrery_beat_leader 1.0" in metrics
