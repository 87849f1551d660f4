"""Waking cycles and drains early: at most one of each waits in the queue, a burst of asks is
one run, and an ask made while one runs queues the next at once (no beat, no fixed pause); a
cycle or drain that found another at work asks again shortly."""

from __future__ import annotations

import threading

import pytest
from django.core.cache import cache
from django.db import connection

from scheduling import wakeup
from scheduling.dispatch import outbox
from scheduling.engine.cycle import lock
from scheduling.models import DispatchOutbox
from scheduling.tasks import dispatch_outbox_task, scheduling_cycle_task
from tests.factories import make_job

pytestmark = pytest.mark.django_db


@pytest.fixture
def sent(settings, monkeypatch) -> list[tuple[str, float]]:
    """The tasks the wake-ups send, with their countdowns (no broker is needed to see them)."""
    settings.REDIS_URL = "redis://wake-ups-only"  # wake-ups are a Celery feature
    cache.clear()
    tasks: list[tuple[str, float]] = []
    monkeypatch.setattr(wakeup, "_send", lambda task, **o: tasks.append((task, o.get("countdown", 0))))
    return tasks


def test_asks_while_a_cycle_waits_are_carried_by_it_and_one_during_it_queues_the_next(
    sent, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        wakeup.request_cycle()
        assert sent == []  # nothing before the commit: the cycle must read what was committed
    assert len(callbacks) == 1
    for _ in range(5):
        wakeup._ask()
    assert sent == [(wakeup.CYCLE_TASK, 0)]  # one cycle for the burst, sent at once
    scheduling_cycle_task()  # it starts, so the next ask is for a cycle after it
    wakeup._ask()
    wakeup._ask()
    assert sent == [(wakeup.CYCLE_TASK, 0)] * 2  # at once again: no second-long pause


def test_a_cycle_that_found_another_at_work_asks_again_shortly(sent):
    with lock._process_lock:  # another cycle of this process holds the lock
        assert scheduling_cycle_task() == 0
    assert sent == [(wakeup.CYCLE_TASK, wakeup.RETRY_S)]
    scheduling_cycle_task()  # that one runs, and asks nothing more
    assert sent == [(wakeup.CYCLE_TASK, wakeup.RETRY_S)]


def test_the_embedded_default_sends_nothing(settings, monkeypatch, django_capture_on_commit_callbacks):
    settings.REDIS_URL = ""
    monkeypatch.setattr(wakeup, "_send", lambda *a, **o: pytest.fail("nothing is sent without a broker"))
    with django_capture_on_commit_callbacks(execute=True):
        wakeup.request_cycle()
        wakeup.ring_dispatch()
    wakeup.cycle_skipped()
    wakeup.ring_dispatch_again()
    wakeup.ring_sync(1, "1")


def test_rings_while_a_drain_waits_are_carried_by_it_and_one_during_it_queues_the_next(sent):
    for _ in range(3):
        wakeup._ring()
    assert sent == [(wakeup.DISPATCH_TASK, 0)]
    dispatch_outbox_task()
    wakeup._ring()
    assert sent == [(wakeup.DISPATCH_TASK, 0)] * 2


def test_a_drain_that_finds_its_cluster_being_delivered_to_looks_again_shortly(sent, alice, queue, fleet):
    from scheduling.engine.cache import SchedulerCache
    from scheduling.engine.cycle import run_cycle

    make_job(alice, queue, gpus=1)
    assert run_cycle(SchedulerCache()).placed == 1
    row = DispatchOutbox.objects.get()
    held, release = threading.Event(), threading.Event()

    def other_drain() -> None:  # its own database session, as another worker's
        try:
            with outbox._delivering(row.cluster_id) as ours:
                assert ours
                held.set()
                release.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=other_drain)
    thread.start()
    try:
        assert held.wait(10)
        sent.clear()  # the cycle's own ring, which still waits
        cache.delete(wakeup._DISPATCH_QUEUED)
        assert outbox.drain_outbox() == 0
        assert DispatchOutbox.objects.get(pk=row.pk).state == DispatchOutbox.State.PENDING
        assert sent == [(wakeup.DISPATCH_TASK, wakeup.RETRY_S)]
    finally:
        release.set()
        thread.join()
    assert outbox.drain_outbox() == 1
    drains = [task for task in sent if task[0] == wakeup.DISPATCH_TASK]
    assert drains == [(wakeup.DISPATCH_TASK, wakeup.RETRY_S)]  # nothing busy: no second look
