"""Job dependencies: every kind against every way a target ends (before and after submission),
arrays, singleton, visibility, the cancel cascade, holds, the scheduler's cache, and the races
between two targets ending and between a submission and its target ending."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, transaction

from scheduling.choices import DependencyState, EventKind, JobState, PendingReason
from scheduling.engine.cache import SchedulerCache
from scheduling.models import Job, JobDependency, JobEvent
from scheduling.services import dependencies
from scheduling.services.jobs import JobRequest, hold_job, release_job, submit_job, submit_jobs
from scheduling.services.transitions import transition_job
from scheduling.spec import SpecError
from tests.factories import make_job, make_project, make_queue

S = JobState
OUTCOMES = [S.SUCCEEDED, S.FAILED, S.TIMEOUT, S.CANCELLED]
MET = {
    "afterok": {S.SUCCEEDED},
    "afterany": set(OUTCOMES),
    "afternotok": {S.FAILED, S.TIMEOUT, S.CANCELLED},
}
CASES = [(kind, outcome, outcome in MET[kind]) for kind in MET for outcome in OUTCOMES]
CASE_IDS = [f"{kind}-{outcome}-{'met' if met else 'never'}" for kind, outcome, met in CASES]


def submit(actor, queue, *dependency: tuple[str, str], name: str = "after") -> Job:
    request = JobRequest(name=name, queue=queue, command="true", dependency=dependency)
    job, _ = submit_job(request, actor=actor)
    job.refresh_from_db()
    return job


def end(job: Job, outcome: str) -> None:
    """Run the job to ``outcome`` (through RUNNING, so any end state is reachable)."""
    if job.state == S.PENDING and outcome != S.CANCELLED:
        Job.objects.filter(pk=job.pk).update(state=S.RUNNING)
    transition_job(job.pk, outcome)


def edges(job: Job) -> list[tuple[int, str, str]]:
    return list(JobDependency.objects.filter(job=job).values_list("target_id", "kind", "state"))


@pytest.mark.django_db
@pytest.mark.parametrize("kind, outcome, met", CASES, ids=CASE_IDS)
def test_a_dependent_waits_then_runs_or_is_cancelled_as_its_target_ends(alice, queue, kind, outcome, met):
    target = make_job(alice, queue, state=S.RUNNING)
    dependent = submit(alice, queue, (kind, str(target.pk)))
    assert (dependent.state, dependent.reason, dependent.dependency_pending) == (
        S.PENDING,
        PendingReason.DEPENDENCY,
        True,
    )
    assert dependent.reason_message == f"waits for {target.pk} ({kind})"

    end(target, outcome)

    dependent.refresh_from_db()
    if met:
        assert (dependent.state, dependent.reason, dependent.dependency_pending) == (
            S.PENDING,
            PendingReason.NONE,
            False,
        )
        assert JobEvent.objects.filter(job=dependent, kind=EventKind.NOTE, message="dependency met").exists()
        assert edges(dependent) == [(target.pk, kind, DependencyState.MET)]
    else:
        assert dependent.state == S.CANCELLED
        event = JobEvent.objects.filter(job=dependent).latest("id")
        assert (event.to_state, event.reason) == (S.CANCELLED, PendingReason.DEPENDENCY_NEVER)
        assert edges(dependent) == [(target.pk, kind, DependencyState.NEVER)]


@pytest.mark.django_db
@pytest.mark.parametrize("kind, outcome, met", CASES, ids=CASE_IDS)
def test_a_target_ended_before_submission_is_judged_at_once(alice, queue, kind, outcome, met):
    target = make_job(alice, queue, state=outcome)
    if met:
        dependent = submit(alice, queue, (kind, str(target.pk)))
        assert (dependent.reason, dependent.dependency_pending) == (PendingReason.NONE, False)
        assert edges(dependent) == [(target.pk, kind, DependencyState.MET)]
        return
    before = Job.objects.count()
    with pytest.raises(SpecError) as refused:
        submit(alice, queue, (kind, str(target.pk)))
    assert refused.value.errors == [
        ("spec.dependency", f"job {target.pk} already ended {outcome}; {kind} can never be met")
    ]
    assert Job.objects.count() == before  # the submission wrote nothing


@pytest.mark.django_db
def test_every_edge_must_be_met_and_one_never_dooms_the_job(alice, queue):
    a, b, c = (make_job(alice, queue, state=S.RUNNING) for _ in range(3))
    both = submit(alice, queue, ("afterok", str(a.pk)), ("afterany", str(b.pk)))
    mixed = submit(alice, queue, ("afterok", str(a.pk)), ("afterok", str(c.pk)))
    assert both.reason_message == f"waits for {a.pk} (afterok), {b.pk} (afterany)"
    end(a, S.SUCCEEDED)
    both.refresh_from_db()
    mixed.refresh_from_db()
    assert (both.dependency_pending, mixed.dependency_pending) == (True, True)
    end(b, S.FAILED)
    end(c, S.TIMEOUT)
    both.refresh_from_db()
    mixed.refresh_from_db()
    assert (both.state, both.dependency_pending) == (S.PENDING, False)
    assert mixed.state == S.CANCELLED


@pytest.mark.django_db
def test_a_cancelled_dependent_cancels_its_own_dependents(alice, queue):
    first = make_job(alice, queue, state=S.RUNNING)
    second = submit(alice, queue, ("afterok", str(first.pk)))
    third = submit(alice, queue, ("afterok", str(second.pk)))
    fourth = submit(alice, queue, ("afterany", str(second.pk)))
    end(first, S.FAILED)
    states = dict(Job.objects.filter(pk__in=[second.pk, third.pk, fourth.pk]).values_list("pk", "state"))
    # afterany is met by a cancel: the fourth job is released, not cancelled
    assert states == {second.pk: S.CANCELLED, third.pk: S.CANCELLED, fourth.pk: S.PENDING}
    assert not Job.objects.get(pk=fourth.pk).dependency_pending


def make_array(owner, queue, size: int, state: str = S.PENDING) -> list[Job]:
    members = [make_job(owner, queue, state=state, array_index=i) for i in range(size)]
    Job.objects.filter(pk__in=[m.pk for m in members]).update(array_id=members[0].pk)
    for m in members:
        m.refresh_from_db()
    return members


@pytest.mark.django_db
def test_an_array_id_names_every_member_and_a_member_ref_one(alice, queue):
    members = make_array(alice, queue, 3, state=S.RUNNING)
    array_id = members[0].pk
    whole = submit(alice, queue, ("afterok", str(array_id)))
    one = submit(alice, queue, ("afterok", f"{array_id}_1"))
    by_pk = submit(alice, queue, ("afterany", str(members[2].pk)))  # not an array id: that job
    assert {t for t, _, _ in edges(whole)} == {m.pk for m in members}
    assert [t for t, _, _ in edges(one)] == [members[1].pk]
    assert [t for t, _, _ in edges(by_pk)] == [members[2].pk]

    end(members[1], S.SUCCEEDED)
    one.refresh_from_db()
    whole.refresh_from_db()
    assert (one.dependency_pending, whole.dependency_pending) == (False, True)
    end(members[0], S.SUCCEEDED)
    end(members[2], S.FAILED)
    whole.refresh_from_db()
    assert whole.state == S.CANCELLED


@pytest.mark.django_db
def test_an_array_with_a_failed_member_is_refused_naming_the_member(alice, queue):
    members = make_array(alice, queue, 3, state=S.SUCCEEDED)
    Job.objects.filter(pk=members[2].pk).update(state=S.FAILED)
    never = f"job {members[0].pk}_2 already ended FAILED; afterok can never be met"
    with pytest.raises(SpecError, match=never):
        submit(alice, queue, ("afterok", str(members[0].pk)))


@pytest.mark.django_db
def test_singleton_waits_for_the_owners_earlier_unended_jobs_of_that_name(alice, bob, queue, vision):
    vision.members.add(bob)
    running = make_job(alice, queue, state=S.RUNNING, name="train")
    pending = make_job(alice, queue, state=S.PENDING, name="train")
    make_job(alice, queue, state=S.SUCCEEDED, name="train")
    make_job(alice, queue, state=S.RUNNING, name="eval")
    make_job(bob, queue, state=S.RUNNING, name="train")
    job = submit(alice, queue, ("singleton", ""), name="train")
    assert sorted(edges(job)) == [(running.pk, "afterany", "waiting"), (pending.pk, "afterany", "waiting")]
    assert job.reason_message == "waits for earlier jobs named train (singleton)"
    end(running, S.FAILED)
    end(pending, S.CANCELLED)
    job.refresh_from_db()
    assert (job.state, job.dependency_pending) == (S.PENDING, False)


@pytest.mark.django_db
def test_singleton_with_no_earlier_job_does_not_wait(alice, queue):
    job = submit(alice, queue, ("singleton", ""), name="alone")
    assert (job.dependency_pending, edges(job)) == (False, [])


@pytest.mark.django_db
@pytest.mark.parametrize("staff", [False, True], ids=["member", "operator"])
def test_jobs_the_submitter_cannot_see_do_not_exist_for_it(alice, bob, operator, queue, staff):
    other = make_queue(make_project("secret", members=(bob,)))
    hidden = make_job(bob, other, state=S.FAILED)
    submitter = operator if staff else alice
    if staff:  # an operator sees every job, so learns how it ended
        with pytest.raises(SpecError, match=f"job {hidden.pk} already ended FAILED"):
            submit(submitter, queue, ("afterok", str(hidden.pk)))
        return
    for ref in (str(hidden.pk), "999999999", f"{hidden.pk}_0"):
        with pytest.raises(SpecError) as refused:
            submit(submitter, queue, ("afterok", ref))
        assert refused.value.errors == [("spec.dependency", f"no job {ref} you can see")]


@pytest.mark.django_db
def test_every_problem_is_listed_at_once_with_the_job_name_in_a_batch(alice, queue):
    failed = make_job(alice, queue, state=S.FAILED)
    requests = [
        JobRequest(name=f"j{i}", queue=queue, command="true", dependency=(("afterok", ref),))
        for i, ref in enumerate([str(failed.pk), "888888888"])
    ]
    with pytest.raises(SpecError) as refused:
        submit_jobs(requests, actor=alice, batch=True)
    assert refused.value.errors == [
        ("spec.dependency", f"j0: job {failed.pk} already ended FAILED; afterok can never be met"),
        ("spec.dependency", "j1: no job 888888888 you can see"),
    ]


@pytest.mark.django_db
def test_the_members_of_a_dependent_array_wait_together_and_share_a_problem(alice, queue):
    running, failed = make_job(alice, queue, state=S.RUNNING), make_job(alice, queue, state=S.FAILED)

    def members(ref):
        return [
            JobRequest(name=f"sweep-{i}", queue=queue, command="true", dependency=(("afterok", ref),))
            for i in range(3)
        ]

    jobs, _ = submit_jobs(members(str(running.pk)), actor=alice, batch=True)
    assert [j.reason_message for j in jobs] == [f"waits for {running.pk} (afterok)"] * 3
    assert Job.objects.filter(dependency_pending=True).count() == 3
    with pytest.raises(SpecError) as refused:
        submit_jobs(members(str(failed.pk)), actor=alice, batch=True)
    never = f"sweep-0: job {failed.pk} already ended FAILED; afterok can never be met"
    assert refused.value.errors == [("spec.dependency", never)]


@pytest.mark.django_db
def test_edges_are_bounded_per_submission(alice, queue, monkeypatch):
    monkeypatch.setattr(dependencies, "MAX_EDGES", 2)
    array_id = make_array(alice, queue, 3, state=S.RUNNING)[0].pk
    with pytest.raises(SpecError, match="makes more than 2 dependency edges"):
        submit(alice, queue, ("afterok", str(array_id)))
    assert not JobDependency.objects.exists()


@pytest.mark.django_db
def test_a_held_dependent_released_keeps_waiting(alice, queue):
    target = make_job(alice, queue, state=S.RUNNING)
    job = submit(alice, queue, ("afterok", str(target.pk)))
    hold_job(job, actor=alice)
    job = release_job(job, actor=alice)
    assert (job.state, job.reason, job.dependency_pending) == (S.PENDING, PendingReason.DEPENDENCY, True)
    hold_job(job, actor=alice)
    end(target, S.SUCCEEDED)
    job.refresh_from_db()
    assert (job.state, job.reason, job.dependency_pending) == (S.HELD, PendingReason.HELD, False)
    job = release_job(job, actor=alice)
    assert (job.state, job.reason) == (S.PENDING, PendingReason.NONE)


@pytest.mark.django_db
def test_the_scheduler_cache_considers_a_dependent_only_once_released(alice, queue, node):
    target = make_job(alice, queue, state=S.RUNNING, gpus=0)
    free = submit(alice, queue)
    job = submit(alice, queue, ("afterany", str(target.pk)))
    cache = SchedulerCache()
    cache.ensure()
    assert (free.pk in cache.queue.jobs, job.pk in cache.queue.jobs) == (True, False)
    hold_job(job, actor=alice)
    release_job(job, actor=alice)
    cache.sync()
    assert job.pk not in cache.queue.jobs
    end(target, S.CANCELLED)  # the "dependency met" event is how the cache learns of it
    cache.sync()
    assert job.pk in cache.queue.jobs


@pytest.mark.django_db(transaction=True)
def test_two_targets_ending_concurrently_release_the_dependent(alice, queue):
    """The first target's transaction marks its edge met and holds, uncommitted, while the second
    ends the other target. Unless the second waits for the first to commit before judging, each
    sees the other's edge still waiting and the job waits for ever."""
    if connection.vendor != "postgresql":
        pytest.skip("row-level locking race needs PostgreSQL")
    a, b = make_job(alice, queue, state=S.RUNNING), make_job(alice, queue, state=S.RUNNING)
    job = submit(alice, queue, ("afterok", str(a.pk)), ("afterok", str(b.pk)))
    first_resolved = threading.Event()

    def end_first():
        try:
            with transaction.atomic():
                transition_job(a.pk, S.SUCCEEDED)
                first_resolved.set()
                time.sleep(0.3)  # the second ending reads the edges now, before we commit
        finally:
            connection.close()

    def end_second():
        try:
            first_resolved.wait(5)
            transition_job(b.pk, S.SUCCEEDED)
        finally:
            connection.close()

    threads = [threading.Thread(target=end_first), threading.Thread(target=end_second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    job.refresh_from_db()
    assert (job.state, job.dependency_pending, job.reason) == (S.PENDING, False, PendingReason.NONE)


@pytest.mark.django_db(transaction=True)
def test_a_submission_racing_its_target_ending_never_leaves_an_edge_waiting(alice, queue):
    """The target fails in an open transaction while a job naming it is submitted: the submission
    must wait for that commit and refuse, not write a waiting edge that no one will ever judge."""
    if connection.vendor != "postgresql":
        pytest.skip("row-level locking race needs PostgreSQL")
    target = make_job(alice, queue, state=S.RUNNING)
    moved = threading.Event()
    outcome: dict[str, object] = {}

    def fail_target():
        try:
            with transaction.atomic():
                transition_job(target.pk, S.FAILED)
                moved.set()
                time.sleep(0.3)
        finally:
            connection.close()

    def submit_dependent():
        try:
            moved.wait(5)
            outcome["job"] = submit(alice, queue, ("afterok", str(target.pk)))
        except SpecError as exc:
            outcome["refused"] = exc.errors
        finally:
            connection.close()

    threads = [threading.Thread(target=fail_target), threading.Thread(target=submit_dependent)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert outcome == {
        "refused": [("spec.dependency", f"job {target.pk} already ended FAILED; afterok can never be met")]
    }
    assert not JobDependency.objects.exists()
