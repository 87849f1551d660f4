"""Job services: submission with idempotency keys, hold/release/cancel/requeue, binding."""

from __future__ import annotations

import pytest
from django.db import IntegrityError
from django.utils import timezone

from clusters.choices import NodeState
from clusters.services.nodes import drain_node
from foundation.sql import COPY_FROM_ROWS
from scheduling.choices import EventKind, JobState, PendingReason
from scheduling.models import Allocation, Job, JobEvent
from scheduling.services import jobs as jobs_service
from scheduling.services.allocations import NodePlacement, PlacementRefused, bind_job
from scheduling.services.jobs import (
    IdempotencyConflict,
    JobRequest,
    cancel_job,
    explain_pending,
    hold_job,
    release_job,
    requeue_job,
    submit_job,
    submit_jobs,
)
from scheduling.services.transitions import InvalidTransition, transition_job
from tests.factories import gpu_model, make_job, make_node

pytestmark = pytest.mark.django_db


def request(queue, **changes) -> JobRequest:
    fields = {
        "name": "train",
        "queue": queue,
        "gpu_model": gpu_model("h100"),
        "gpus_per_node": 8,
        "command": "python train.py",
    } | changes
    return JobRequest(**fields)


def test_submit_creates_a_pending_job_with_its_history(alice, queue):
    job, created = submit_job(request(queue), actor=alice)
    assert created
    assert (job.state, job.reason, job.project_id, job.owner_id) == (
        JobState.PENDING,
        PendingReason.NONE,
        queue.project_id,
        alice.pk,
    )
    event = JobEvent.objects.get(job=job)
    assert (event.kind, event.to_state, event.actor_id) == (EventKind.SUBMITTED, JobState.PENDING, alice.pk)


def test_same_idempotency_key_returns_the_same_job(alice, queue):
    first, created = submit_job(request(queue), actor=alice, idempotency_key="k1")
    again, created_again = submit_job(request(queue), actor=alice, idempotency_key="k1")
    assert (created, created_again, again.pk) == (True, False, first.pk)
    assert Job.objects.filter(owner=alice).count() == 1


def test_same_key_with_another_request_is_a_conflict(alice, queue):
    first, _ = submit_job(request(queue), actor=alice, idempotency_key="k1")
    with pytest.raises(IdempotencyConflict) as exc:
        submit_job(request(queue, gpus_per_node=4), actor=alice, idempotency_key="k1")
    assert exc.value.job.pk == first.pk
    assert Job.objects.count() == 1


def test_a_digest_is_kept_only_under_a_key_and_secrets_enter_it_keyed(alice, queue, settings):
    """Without an idempotency key no retry is told apart, so no digest is made or stored. Under a
    key, a request's secret environment enters the digest only through a hash keyed with the
    site's secret: the same request has another digest on a site with another key, and secret
    values change it."""
    keyless, _ = submit_job(request(queue), actor=alice)
    keyed, _ = submit_job(request(queue), actor=alice, idempotency_key="k1")
    assert Job.objects.get(pk=keyless.pk).request_digest == ""
    assert Job.objects.get(pk=keyed.pk).request_digest == request(queue).digest() != ""
    plain, secret = request(queue), request(queue, secret_env={"TOKEN": "a"})
    digests = {plain.digest(), secret.digest(), request(queue, secret_env={"TOKEN": "b"}).digest()}
    settings.SECRET_KEY = "another-site-" + "k" * 40
    digests |= {plain.digest(), secret.digest()}
    assert len(digests) == 5


def test_keys_are_per_owner(alice, bob, queue):
    a, _ = submit_job(request(queue), actor=alice, idempotency_key="k1")
    b, created = submit_job(request(queue), actor=bob, idempotency_key="k1")
    assert created and a.pk != b.pk


def test_hold_release_cancel(alice, queue):
    job = make_job(alice, queue)
    assert hold_job(job, actor=alice).state == JobState.HELD
    with pytest.raises(InvalidTransition):
        hold_job(job, actor=alice)
    assert release_job(job, actor=alice).state == JobState.PENDING
    assert cancel_job(job, actor=alice).state == JobState.CANCELLED
    with pytest.raises(InvalidTransition):
        cancel_job(job, actor=alice)
    kinds = list(JobEvent.objects.filter(job=job).values_list("to_state", flat=True))
    assert kinds == [JobState.HELD, JobState.PENDING, JobState.CANCELLED]


def test_requeue_needs_an_active_job_and_frees_its_gpus(alice, queue, node):
    job = make_job(alice, queue, gpus=2)
    with pytest.raises(InvalidTransition):
        requeue_job(job, actor=alice)
    bind_job(job, [NodePlacement(node, [0, 1])])
    transition_job(job.pk, JobState.RUNNING)
    job = requeue_job(job, actor=alice)
    assert (job.state, job.reason) == (JobState.PENDING, PendingReason.REQUEUED)
    assert not Allocation.objects.filter(job=job, active=True).exists()


def test_explain_pending_only_touches_pending_jobs(alice, queue):
    pending, held = make_job(alice, queue), make_job(alice, queue, state=JobState.HELD)
    assert explain_pending(pending.pk, PendingReason.RESOURCES, "0/1 nodes fit")
    assert not explain_pending(held.pk, PendingReason.RESOURCES, "0/1 nodes fit")
    pending.refresh_from_db()
    assert (pending.reason, pending.reason_message) == (PendingReason.RESOURCES, "0/1 nodes fit")


@pytest.mark.parametrize(
    "placement_gpus, why",
    [([0], "needs 2 GPU"), ([0, 9], "has no GPUs")],
    ids=["too-few", "missing-index"],
)
def test_bind_refuses_placements_that_do_not_fit(alice, queue, node, placement_gpus, why):
    job = make_job(alice, queue, gpus=2)
    with pytest.raises(PlacementRefused, match=why):
        bind_job(job, [NodePlacement(node, placement_gpus)])
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING


def test_bind_refuses_another_model(alice, queue):
    a100_node = make_node(gpus=2, model="a100")
    job = make_job(alice, queue, gpus=1, model="h100")
    with pytest.raises(PlacementRefused):
        bind_job(job, [NodePlacement(a100_node, [0])])


def test_the_database_refuses_a_double_booked_gpu(alice, queue, node):
    first, second = make_job(alice, queue, gpus=1), make_job(alice, queue, gpus=1)
    bind_job(first, [NodePlacement(node, [3])])
    with pytest.raises(IntegrityError):
        bind_job(second, [NodePlacement(node, [3])])


def test_draining_node_becomes_drained_when_its_last_job_ends(alice, queue, node, operator):
    job = make_job(alice, queue, gpus=1)
    bind_job(job, [NodePlacement(node, [0])])
    node = drain_node(node, actor=operator)
    assert node.state == NodeState.DRAINING
    transition_job(job.pk, JobState.RUNNING)
    transition_job(job.pk, JobState.SUCCEEDED, exit_code=0)
    node.refresh_from_db()
    assert node.state == NodeState.DRAINED


def test_a_large_batch_is_stored_as_one_job_at_a_time_would_be(alice, queue):
    """Batches of many jobs are written with COPY, a single job with INSERT: the rows, their
    order and their history must not tell which."""
    labels = {"team": "vision", "tab": "a\tb", "quote": 'say "hi"\\', "nested": {"list": [1, None, True]}}
    many = [request(queue, name=f"sweep-{i}", labels=labels, priority=i) for i in range(40)]
    many[1] = request(queue, name="sweep-1", labels=labels, priority=1.0)  # Django's int() makes it 1
    assert len(many) >= COPY_FROM_ROWS  # the batch goes through COPY
    before = timezone.now()
    jobs, created = submit_jobs(many, actor=alice, idempotency_key="big", batch=True)
    single, _ = submit_job(request(queue, name="sweep-0", labels=labels), actor=alice)
    assert created and len(jobs) == 40
    assert [j.pk for j in jobs] == sorted(j.pk for j in jobs) and single.pk > jobs[-1].pk
    stored = {j.pk: j for j in Job.objects.filter(owner=alice)}
    assert [stored[j.pk].name for j in jobs] == [f"sweep-{i}" for i in range(40)]
    assert [stored[j.pk].priority for j in jobs] == list(range(40))
    assert [stored[j.pk].idempotency_key for j in jobs] == [f"big#{i}" for i in range(40)]
    skip = {"id", "name", "priority", "idempotency_key", "request_digest", "submitted_at"}
    columns = [f.attname for f in Job._meta.concrete_fields if f.attname not in skip]
    copied, inserted = stored[jobs[0].pk], stored[single.pk]
    assert {c: getattr(copied, c) for c in columns} == {c: getattr(inserted, c) for c in columns}
    assert copied.labels == labels
    assert before <= copied.submitted_at <= inserted.submitted_at <= timezone.now()
    events = JobEvent.objects.filter(job__owner=alice).order_by("id")
    assert [(e.job_id, e.kind, e.to_state, e.actor_id, e.message) for e in events] == [
        (j.pk, EventKind.SUBMITTED, JobState.PENDING, alice.pk, f"submitted to {queue}")
        for j in [*jobs, single]
    ]
    assert all(before <= e.at <= timezone.now() for e in events)
    assert all(not j._state.adding for j in jobs)


def test_a_concurrent_retry_of_a_large_batch_answers_with_the_first_jobs(alice, queue, monkeypatch):
    """Two retries of one batch racing: the second finds no earlier submission, then the unique
    key refuses its rows (raised through COPY as through INSERT) and it answers with the first's."""
    many = [request(queue, name=f"sweep-{i}") for i in range(40)]
    assert len(many) >= COPY_FROM_ROWS  # the batch goes through COPY
    first, _ = submit_jobs(many, actor=alice, idempotency_key="race", batch=True)
    looked = []
    earlier = jobs_service._earlier_submission

    def not_yet_committed(*args):
        looked.append(args[1])
        return [] if len(looked) == 1 else earlier(*args)

    monkeypatch.setattr(jobs_service, "_earlier_submission", not_yet_committed)
    again, created = submit_jobs(many, actor=alice, idempotency_key="race", batch=True)
    assert (created, [j.pk for j in again], len(looked)) == (False, [j.pk for j in first], 2)
    assert Job.objects.filter(owner=alice).count() == 40
