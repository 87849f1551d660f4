"""GPU-hour budgets: admission reserves (refuse or hold), job ends settle, raising releases held
jobs in order, concurrent admissions never overspend."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from foundation.choices import AuditAction
from foundation.models import AuditEntry
from scheduling.choices import JobState, PendingReason
from scheduling.models import Budget, BudgetCharge, Job, JobAttempt
from scheduling.services import budget_holds, budgets
from scheduling.services.allocations import NodePlacement, bind_job
from scheduling.services.budgets import BudgetExhausted
from scheduling.services.jobs import JobRequest, cancel_job, release_job, requeue_job, submit_jobs
from scheduling.services.transitions import transition_job
from scheduling.spec import SpecError
from tests.factories import gpu_model, make_budget, make_job, make_queue

pytestmark = pytest.mark.django_db
H = 3600


def ask(queue, hours: float, *, gpus: int = 8, nodes: int = 1, limit: int | None = -1) -> JobRequest:
    """A request for ``gpus`` × ``nodes`` GPUs asking ``hours`` GPU-hours in all."""
    seconds = int(hours * H / (gpus * nodes)) if gpus else H
    return JobRequest(
        name="train",
        queue=queue,
        gpu_model=gpu_model("h100") if gpus else None,
        gpus_per_node=gpus,
        nodes=nodes,
        time_limit_s=seconds if limit == -1 else limit,
    )


def submit(user, *requests):
    return submit_jobs(list(requests), actor=user)[0]


def fresh(budget: Budget) -> Budget:
    budget.refresh_from_db()
    return budget


# --- admission ----------------------------------------------------------------------------------


def test_admission_reserves_on_the_project_and_the_queue_budget(alice, vision, queue):
    whole, mine = make_budget(vision, 100), make_budget(vision, 50, queue=queue)
    other = make_budget(vision, 10, queue=make_queue(vision, "other"))
    [job] = submit(alice, ask(queue, 16, gpus=4, nodes=2))
    assert job.state == JobState.PENDING
    assert fresh(whole).reserved_gpu_seconds == fresh(mine).reserved_gpu_seconds == 16 * H
    assert fresh(other).reserved_gpu_seconds == 0
    charges = BudgetCharge.objects.filter(job=job)
    assert sorted(charges.values_list("budget_id", "reserved_gpu_seconds", "settled")) == [
        (whole.pk, 16 * H, False),
        (mine.pk, 16 * H, False),
    ]


def test_refuse_names_the_project_what_is_left_and_what_was_asked(alice, vision, queue):
    budget = make_budget(vision, 1000, used_gpu_seconds=int(987.5 * H))
    with pytest.raises(
        BudgetExhausted, match=r"vision has 12\.5 of 1000 GPU-hours left .* this job asks 64$"
    ):
        submit(alice, ask(queue, 64))
    assert not Job.objects.exists()
    assert fresh(budget).reserved_gpu_seconds == 0


def test_refuse_takes_the_whole_batch(alice, vision, queue):
    budget = make_budget(vision, 20)
    with pytest.raises(BudgetExhausted, match="these 3 jobs ask 24"):
        submit(alice, ask(queue, 8), ask(queue, 8), ask(queue, 8))
    assert not Job.objects.exists() and fresh(budget).reserved_gpu_seconds == 0


def test_hold_accepts_the_job_held_with_the_reason_and_reserves_nothing(alice, vision, queue):
    budget = make_budget(vision, 10, on_overrun="hold")
    [job] = submit(alice, ask(queue, 64))
    job.refresh_from_db()
    assert (job.state, job.reason) == (JobState.HELD, PendingReason.BUDGET_EXHAUSTED)
    assert job.reason_message.startswith("vision has 10 of 10 GPU-hours left this period")
    assert job.reason_message.endswith("this job asks 64")
    assert fresh(budget).reserved_gpu_seconds == 0 and not BudgetCharge.objects.exists()


def test_hold_admits_a_batch_first_fit_in_submission_order(alice, vision, queue):
    budget = make_budget(vision, 20, on_overrun="hold")
    jobs = submit(alice, ask(queue, 16), ask(queue, 8), ask(queue, 4))
    states = [Job.objects.get(pk=j.pk).state for j in jobs]
    assert states == [JobState.PENDING, JobState.HELD, JobState.PENDING]
    assert fresh(budget).reserved_gpu_seconds == 20 * H


def test_the_strictest_budget_wins(alice, vision, queue):
    make_budget(vision, 100, on_overrun="refuse")
    make_budget(vision, 4, queue=queue, on_overrun="hold")
    [job] = submit(alice, ask(queue, 8))
    assert Job.objects.get(pk=job.pk).state == JobState.HELD  # only the queue's (hold) was short
    with pytest.raises(BudgetExhausted, match="vision has 100 of 100"):
        submit(alice, ask(queue, 101))


@pytest.mark.parametrize(
    "gpus, limit, refused", [(8, None, True), (0, None, False), (8, 3600, False)], ids=["gpu", "cpu", "limit"]
)
def test_a_gpu_job_without_a_time_limit_is_refused_where_a_budget_applies(
    alice, vision, queue, gpus, limit, refused
):
    make_budget(vision, 100)
    if refused:
        with pytest.raises(SpecError) as caught:
            submit(alice, ask(queue, 8, gpus=gpus, limit=limit))
        assert caught.value.errors == [
            ("spec.timeLimit", "project vision has a GPU-hour budget; give a time limit")
        ]
    else:
        submit(alice, ask(queue, 8, gpus=gpus, limit=limit))


def test_a_cpu_job_reserves_nothing(alice, vision, queue):
    budget = make_budget(vision, 1)
    submit(alice, ask(queue, 0, gpus=0))
    assert fresh(budget).reserved_gpu_seconds == 0 and not BudgetCharge.objects.exists()


@pytest.mark.parametrize(
    "offset, applies",
    [(-timedelta(microseconds=1), False), (timedelta(0), True), (timedelta(hours=1), False)],
    ids=["before-start", "at-start", "at-end"],
)
def test_a_window_holds_its_start_and_not_its_end(vision, queue, offset, applies):
    start = timezone.now().replace(microsecond=0)
    budget = make_budget(vision, 1, starts_at=start, ends_at=start + timedelta(hours=1))
    assert budgets.applying_to(vision.pk, queue.pk, start + offset).filter(pk=budget.pk).exists() is applies


@pytest.mark.parametrize("days", [(-30, -1), (1, 30)], ids=["ended", "not-yet"])
def test_a_budget_outside_its_window_takes_nothing(alice, vision, queue, days):
    budget = make_budget(vision, 1, days=days)
    submit(alice, ask(queue, 64))
    assert fresh(budget).reserved_gpu_seconds == 0


# --- settling -----------------------------------------------------------------------------------


def run(job: Job, node, minutes: int) -> None:
    """Place and start ``job`` on ``node`` as if it had started ``minutes`` ago."""
    bind_job(job, [NodePlacement(node, list(range(job.gpus_per_node)))])
    transition_job(job.pk, JobState.RUNNING)
    started = timezone.now() - timedelta(minutes=minutes)
    JobAttempt.objects.filter(job=job).update(started_at=started)
    Job.objects.filter(pk=job.pk).update(started_at=started, gpu_seconds=minutes * 60 * job.gpus_per_node)


def test_a_job_that_ends_is_charged_what_it_used(alice, vision, queue, node):
    budget = make_budget(vision, 100)
    [job] = submit(alice, ask(queue, 8, gpus=2))  # 2 GPUs × 4 h
    run(job, node, minutes=30)
    transition_job(job.pk, JobState.SUCCEEDED)
    job.refresh_from_db()
    assert job.gpu_seconds == pytest.approx(3600, abs=10)  # 2 GPUs × 30 min, however it was counted
    charge = BudgetCharge.objects.get(job=job)
    assert (charge.settled, charge.charged_gpu_seconds) == (True, job.gpu_seconds)
    budget = fresh(budget)
    assert (budget.reserved_gpu_seconds, budget.used_gpu_seconds) == (0, job.gpu_seconds)


def test_cancelling_a_waiting_job_frees_its_reservation(alice, vision, queue):
    budget = make_budget(vision, 100)
    [job] = submit(alice, ask(queue, 64))
    cancel_job(job, actor=alice)
    budget = fresh(budget)
    assert (budget.reserved_gpu_seconds, budget.used_gpu_seconds) == (0, 0)
    assert BudgetCharge.objects.get(job=job).settled


def test_settling_twice_charges_once(alice, vision, queue):
    budget = make_budget(vision, 100)
    [job] = submit(alice, ask(queue, 64))
    cancel_job(job, actor=alice)
    budgets.settle([job.pk])
    assert fresh(budget).reserved_gpu_seconds == 0  # never negative, never freed twice


def test_a_requeued_job_keeps_its_reservation(alice, vision, queue, node):
    budget = make_budget(vision, 100)
    [job] = submit(alice, ask(queue, 8, gpus=2))
    run(job, node, minutes=5)
    requeue_job(job, actor=alice)
    assert fresh(budget).reserved_gpu_seconds == 8 * H
    assert not BudgetCharge.objects.get(job=job).settled


# --- raising and releasing ----------------------------------------------------------------------


def test_raising_releases_held_jobs_that_fit_in_submission_order(alice, operator, vision, queue):
    budget = make_budget(vision, 8, on_overrun="hold")
    a, b, c, d = submit(alice, ask(queue, 8), ask(queue, 8), ask(queue, 4), ask(queue, 2))
    assert Job.objects.filter(state=JobState.HELD).count() == 3
    released = budget_holds.raise_budget(budget, 20, actor=operator)  # 12 more: b (8) and c (4)
    assert released == [b.pk, c.pk]
    states = dict(Job.objects.values_list("pk", "state"))
    assert [states[j.pk] for j in (a, b, c, d)] == [JobState.PENDING] * 3 + [JobState.HELD]
    assert "0 of 20 GPU-hours left" in Job.objects.get(pk=d.pk).reason_message
    assert fresh(budget).reserved_gpu_seconds == 20 * H
    entry = AuditEntry.objects.get(action=AuditAction.BUDGET_CHANGE)
    assert (entry.actor_id, entry.details["gpu_hours"]) == (operator.pk, {"from": "8", "to": "20"})
    assert AuditEntry.objects.get(action=AuditAction.JOB_RELEASE).details["ids"] == [b.pk, c.pk]


def test_a_user_release_never_bypasses_the_budget(alice, operator, vision, queue):
    budget = make_budget(vision, 4, on_overrun="hold")
    [job] = submit(alice, ask(queue, 8))
    with pytest.raises(BudgetExhausted, match="vision has 4 of 4"):
        release_job(job, actor=operator)
    assert Job.objects.get(pk=job.pk).state == JobState.HELD
    Budget.objects.filter(pk=budget.pk).update(gpu_hours=8)  # room, without the service's release
    release_job(job, actor=alice)
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING
    assert fresh(budget).reserved_gpu_seconds == 8 * H


def test_a_new_window_releases_held_jobs(alice, vision, queue):
    old = make_budget(vision, 4, on_overrun="hold")
    [job] = submit(alice, ask(queue, 8))
    now = timezone.now()
    Budget.objects.filter(pk=old.pk).update(ends_at=now)
    new = make_budget(vision, 10, starts_at=now, ends_at=now + timedelta(days=30))
    assert budget_holds.release_due() == 1
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING
    assert BudgetCharge.objects.get(job=job).budget_id == new.pk


def test_creating_a_budget_through_the_service_releases_what_fits(alice, operator, vision, queue):
    make_budget(vision, 4, queue=queue, on_overrun="hold", days=(-2, 1))
    [job] = submit(alice, ask(queue, 8))
    Budget.objects.filter(queue=queue).update(ends_at=timezone.now())
    now = timezone.now()
    budget_holds.create_budget(
        project=vision,
        queue=queue,
        starts_at=now,
        ends_at=now + timedelta(days=7),
        gpu_hours=8,
        actor=operator,
    )
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING
    assert AuditEntry.objects.filter(action=AuditAction.BUDGET_CREATE, actor_id=operator.pk).exists()


# --- concurrency --------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_concurrent_admissions_never_overspend(alice, vision, queue):
    """The first admission holds its reservation uncommitted while the second reads and writes:
    a read-then-write would see 8 GPU-hours left in both and reserve 16 of 8."""
    budget = make_budget(vision, 8)
    first, second = (make_job(alice, queue, gpus=8, time_limit_s=H) for _ in range(2))
    reserved = threading.Event()
    outcome: dict[str, str] = {}

    def admit(job, key):
        try:
            with transaction.atomic():
                budgets.reserve([job])
                if key == "first":
                    reserved.set()
                    time.sleep(0.4)  # the second admission runs meanwhile, against this open transaction
            outcome[key] = "admitted"
        except BudgetExhausted:
            outcome[key] = "refused"
        finally:
            connection.close()

    one = threading.Thread(target=admit, args=(first, "first"))
    two = threading.Thread(target=lambda: reserved.wait(5) and admit(second, "second"))
    for t in (one, two):
        t.start()
    for t in (one, two):
        t.join(10)
    assert outcome == {"first": "admitted", "second": "refused"}
    assert fresh(budget).reserved_gpu_seconds == 8 * H
    assert BudgetCharge.objects.filter(budget=budget).count() == 1
