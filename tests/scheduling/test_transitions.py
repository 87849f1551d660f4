"""The job state machine: every (from, to) pair, compare-and-set races, events and live events."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.layers import get_channel_layer
from django.db import connection, transaction

from scheduling.choices import ACTIVE_STATES, TERMINAL_STATES, AttemptState, JobState, PendingReason
from scheduling.models import Allocation, Job, JobAttempt, JobEvent
from scheduling.services.allocations import NodePlacement, bind_job
from scheduling.services.transitions import (
    TRANSITIONS,
    InvalidTransition,
    TransitionConflict,
    allowed_sources,
    transition_job,
    transition_jobs,
)
from tests.factories import make_job

STATES = list(JobState.values)
PAIRS = [(a, b) for a in STATES for b in STATES]


@pytest.mark.django_db
@pytest.mark.parametrize("current, to", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_every_pair_of_states(alice, queue, current, to):
    job = make_job(alice, queue, state=current)
    events_before = JobEvent.objects.filter(job=job).count()
    if to in TRANSITIONS[current]:
        moved = transition_job(job.pk, to, actor=alice)
        assert moved.state == to
        assert moved.version == 1
        event = JobEvent.objects.filter(job=job).latest("id")
        assert (event.from_state, event.to_state, event.actor_id) == (current, to, alice.pk)
    else:
        with pytest.raises(InvalidTransition):
            transition_job(job.pk, to, actor=alice)
        job.refresh_from_db()
        assert (job.state, job.version) == (current, 0)
        assert JobEvent.objects.filter(job=job).count() == events_before


def test_terminal_states_have_no_way_out():
    for state in TERMINAL_STATES:
        assert TRANSITIONS[state] == frozenset()
        assert all(state not in allowed_sources(to) for to in STATES)


@pytest.mark.django_db
def test_only_from_narrows_the_table(alice, queue):
    job = make_job(alice, queue, state=JobState.RUNNING)
    with pytest.raises(InvalidTransition, match="RUNNING cannot become HELD"):
        transition_job(job.pk, JobState.HELD, only_from=[JobState.PENDING])
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING


@pytest.mark.django_db
def test_error_names_a_final_state(alice, queue):
    job = make_job(alice, queue, state=JobState.SUCCEEDED)
    with pytest.raises(InvalidTransition, match="SUCCEEDED is a final state"):
        transition_job(job.pk, JobState.PENDING)


@pytest.mark.django_db
def test_pending_reason_is_set_and_cleared(alice, queue):
    job = make_job(alice, queue, state=JobState.PENDING)
    held = transition_job(job.pk, JobState.HELD, reason=PendingReason.HELD, message="by alice")
    assert (held.reason, held.reason_message) == (PendingReason.HELD, "by alice")
    back = transition_job(job.pk, JobState.PENDING)
    assert back.reason == PendingReason.NONE
    cancelled = transition_job(job.pk, JobState.CANCELLED)
    assert (cancelled.reason, cancelled.finished_at is not None) == ("", True)


@pytest.mark.django_db
@pytest.mark.parametrize("end", sorted(TERMINAL_STATES | {JobState.PENDING}))
def test_leaving_the_active_states_ends_the_attempt_and_frees_gpus(alice, queue, node, end):
    job = make_job(alice, queue, gpus=2)
    attempt = bind_job(job, [NodePlacement(node, [0, 1])])
    transition_job(job.pk, JobState.RUNNING)
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.RUNNING
    assert Allocation.objects.filter(attempt=attempt, active=True).count() == 3  # 2 GPUs + node row

    transition_job(job.pk, end, exit_code=0 if end == JobState.SUCCEEDED else None)
    attempt.refresh_from_db()
    assert not attempt.active and attempt.finished_at is not None
    assert attempt.state == {JobState.PENDING: AttemptState.REQUEUED}.get(end, end.lower())
    assert not Allocation.objects.filter(attempt=attempt, active=True).exists()


@pytest.mark.django_db
def test_many_jobs_moved_at_once_keep_words_of_their_own(alice, queue, node):
    """``transition_jobs`` with ``messages``: each job's reason, event and ended attempt say its
    own words (cut as a single move cuts them); a job without any gets the common ``message``."""
    jobs = [make_job(alice, queue, gpus=1) for _ in range(3)]
    attempts = [bind_job(job, [NodePlacement(node, [i])]) for i, job in enumerate(jobs)]
    said = {jobs[0].pk: "x" * 600, jobs[1].pk: "lost its node"}
    moved = transition_jobs(
        [j.pk for j in jobs], JobState.PENDING, only_from=JobState.SCHEDULED, message="common", messages=said
    )
    assert sorted(moved) == sorted(j.pk for j in jobs)
    for job, attempt, words in zip(jobs, attempts, ["x" * 600, "lost its node", "common"], strict=True):
        job.refresh_from_db()
        attempt.refresh_from_db()
        assert job.reason_message == words[:512]
        assert JobEvent.objects.filter(job=job).latest("pk").message == words
        assert (attempt.active, attempt.reason) == (False, words[:255])


@pytest.mark.django_db
def test_a_requeued_job_gets_a_new_attempt_on_the_same_gpus(alice, queue, node):
    job = make_job(alice, queue, gpus=1)
    first = bind_job(job, [NodePlacement(node, [0])])
    transition_job(job.pk, JobState.PENDING, reason=PendingReason.REQUEUED)
    second = bind_job(Job.objects.get(pk=job.pk), [NodePlacement(node, [0])])
    assert (first.number, second.number) == (1, 2)
    assert list(JobAttempt.objects.filter(job=job, active=True)) == [second]


@pytest.mark.django_db(transaction=True)
def test_a_racing_writer_wins_and_the_loser_changes_nothing(alice, queue):
    """A holds the row and moves PENDING → CANCELLED; B read PENDING before A committed and tries
    PENDING → HELD. B's compare-and-set must find zero rows and refuse."""
    if connection.vendor != "postgresql":
        pytest.skip("row-level locking race needs PostgreSQL")
    job = make_job(alice, queue)
    a_updated, b_done = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def writer_a():
        with transaction.atomic():
            Job.objects.filter(pk=job.pk).update(state=JobState.CANCELLED, version=7)
            a_updated.set()
            time.sleep(0.5)  # B reads the old committed row, then blocks on our row lock
        connection.close()

    def writer_b():
        a_updated.wait()
        try:
            transition_job(job.pk, JobState.HELD)
            outcome["b"] = "moved"
        except (TransitionConflict, InvalidTransition) as exc:
            outcome["b"] = type(exc).__name__
        finally:
            b_done.set()
            connection.close()

    threads = [threading.Thread(target=writer_a), threading.Thread(target=writer_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert outcome["b"] == "TransitionConflict"
    job.refresh_from_db()
    assert (job.state, job.version) == (JobState.CANCELLED, 7)
    assert not JobEvent.objects.filter(job=job, to_state=JobState.HELD).exists()


@pytest.mark.django_db(transaction=True)
def test_concurrent_end_states_exactly_one_wins(alice, queue, node):
    job = make_job(alice, queue, gpus=1)
    bind_job(job, [NodePlacement(node, [0])])
    transition_job(job.pk, JobState.RUNNING)
    ends = [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT] * 2
    results: list[str] = []
    barrier = threading.Barrier(len(ends))

    def finish(state):
        barrier.wait()
        try:
            transition_job(job.pk, state)
            results.append("won")
        except (TransitionConflict, InvalidTransition):
            results.append("lost")
        finally:
            connection.close()

    threads = [threading.Thread(target=finish, args=(s,)) for s in ends]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results.count("won") == 1, results
    assert JobEvent.objects.filter(job=job, from_state=JobState.RUNNING).count() == 1


@pytest.mark.django_db(transaction=True)
def test_live_event_is_published_after_commit_only(alice, queue):
    job = make_job(alice, queue)

    def rolled_back():
        with pytest.raises(RuntimeError), transaction.atomic():
            transition_job(job.pk, JobState.HELD)
            raise RuntimeError("roll back")

    async def scenario():
        layer = get_channel_layer()
        channel = await layer.new_channel()
        await layer.group_add(f"job.{job.pk}", channel)

        async def receive(timeout: float):
            try:
                return await asyncio.wait_for(layer.receive(channel), timeout)
            except TimeoutError:
                return None

        await sync_to_async(rolled_back)()
        assert await receive(0.5) is None
        await sync_to_async(transition_job)(job.pk, JobState.HELD)
        return await receive(5.0)

    message = async_to_sync(scenario)()
    assert Job.objects.get(pk=job.pk).state == JobState.HELD
    assert message is not None
    assert message["event"] == "JobStateChanged"
    assert (message["data"]["from_state"], message["data"]["to_state"]) == ("PENDING", "HELD")


def test_active_states_have_an_attempt_state():
    from scheduling.choices import ATTEMPT_STATE_FOR

    assert set(ACTIVE_STATES) <= set(ATTEMPT_STATE_FOR)
