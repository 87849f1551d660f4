"""A preemption on a real Slurm (scripts/slurm-dev-cluster.sh, as tests/clusters/test_slurm_live.py):
the sync signals the running batch script through slurmrestd (SIGTERM, or the job's own signal),
cancels it once its grace period is over, and the job comes back PENDING ("Preempted") when Slurm
reports its end, then runs again as attempt 2; a job still pending in Slurm is withdrawn at once."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusters.choices import NodeState
from clusters.models import Cluster, Node, PosixAccount
from clusters.services.onboarding import onboard_slurm
from scheduling.choices import AttemptState, JobState, PendingReason
from scheduling.dispatch.outbox import drain_outbox
from scheduling.dispatch.sync import sync_cluster
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import run_cycle
from scheduling.models import Allocation, Job, JobAttempt
from scheduling.selectors import log_tail
from scheduling.services.jobs import cancel_job
from scheduling.services.preemption import Victim, preempt_jobs
from tests.factories import ensure_catalog, make_job
from tests.processes import scancel_tagged, squeue, wait

pytestmark = pytest.mark.django_db
WHO = "preempted by job 77 of bob (priority 50 over 1)"


@pytest.fixture
def hpc(slurm, alice, unix_users) -> Iterator[Cluster]:
    """The dev Slurm onboarded as ``hpc``; alice's work runs there as ``orrt-alice``."""
    ensure_catalog()
    token = Path(slurm["ORRERY_SLURM_TOKEN_FILE"]).read_text().strip()
    cluster, _ = onboard_slurm("hpc", slurm["ORRERY_SLURM_URL"], token, slurm_conf=slurm["SLURM_CONF"])
    Node.objects.filter(cluster=cluster).update(state=NodeState.READY)
    PosixAccount.objects.create(cluster=cluster, user=alice, username="orrt-alice")
    yield cluster
    scancel_tagged(cluster.config["tag"])


def job_on(cluster: Cluster, alice, queue, run: str, **spec) -> Job:
    return make_job(
        alice, queue, gpus=1, model="a100", placement={"clusters": [cluster.name]}, command=run, spec=spec
    )


def output(job: Job) -> str:
    return " ".join(log_tail(job.pk, 50)[0])


def running(cluster: Cluster, job: Job, word: str = "started") -> JobAttempt:
    """Placed, delivered, running in Slurm and past its first line of output."""
    assert run_cycle(SchedulerCache()).placed == 1 and drain_outbox() == 1
    wait(
        lambda: (
            sync_cluster(cluster)
            and Job.objects.get(pk=job.pk).state == JobState.RUNNING
            and word in output(job)
        ),
        f"job {job.pk} to run in Slurm",
        timeout=60,
    )
    return JobAttempt.objects.get(job=job, active=True)


def preempt(job: Job) -> None:
    assert preempt_jobs([Victim(job.pk, WHO)]) == [job.pk]
    assert Job.objects.get(pk=job.pk).state == JobState.PREEMPTED


def requeued(cluster: Cluster, job: Job, timeout: float = 60) -> Job:
    return wait(
        lambda: sync_cluster(cluster) and (j := Job.objects.get(pk=job.pk)).state == JobState.PENDING and j,
        f"job {job.pk} to be requeued",
        timeout=timeout,
    )


def test_a_preempted_slurm_job_gets_sigterm_is_requeued_and_runs_again(hpc, alice, queue):
    job = job_on(hpc, alice, queue, "trap 'echo got TERM; exit 0' TERM; echo started; sleep 300 & wait")
    first = running(hpc, job)
    preempt(job)
    counts = sync_cluster(hpc)
    assert counts.signalled == 1 and counts.cancelled == 0
    first.refresh_from_db()
    assert first.signalled_at is not None

    fresh = requeued(hpc, job)
    assert "got TERM" in output(job)  # the batch script's trap ran: the signal reached it
    assert fresh.reason == PendingReason.PREEMPTED and fresh.reason_message.startswith(f"{WHO}; requeued (")
    first.refresh_from_db()
    assert (first.state, first.active, first.exit_code) == (AttemptState.PREEMPTED, False, 0)
    assert not Allocation.objects.filter(job=job, active=True).exists()
    assert squeue(first.remote_id) in ("", "COMPLETED")  # it ended on its signal: no kill was needed

    second = running(hpc, job)
    assert second.number == 2 and second.remote_id != first.remote_id
    assert squeue(second.remote_id) == "RUNNING"
    cancel_job(Job.objects.get(pk=job.pk), actor=None)
    sync_cluster(hpc)


def test_a_slurm_job_that_ignores_its_signal_is_cancelled_when_its_grace_ends(hpc, alice, queue):
    queue.preemption_grace_s = 3
    queue.save()
    # The trap records the signal and carries on: only the cancel ends this job.
    job = job_on(hpc, alice, queue, "trap 'echo got TERM' TERM; echo started; while :; do sleep 0.2; done")
    attempt = running(hpc, job)
    preempt(job)
    asked = time.monotonic()
    assert sync_cluster(hpc).signalled == 1
    wait(
        lambda: sync_cluster(hpc) and "got TERM" in output(job), "the signal to reach the script", timeout=30
    )
    if time.monotonic() - asked < 2.5:
        assert sync_cluster(hpc).cancelled == 0, "cancelled within its grace"
        assert (
            squeue(attempt.remote_id) == "RUNNING" and Job.objects.get(pk=job.pk).state == JobState.PREEMPTED
        )
    time.sleep(max(0.0, 3.2 - (time.monotonic() - asked)))
    assert sync_cluster(hpc).cancelled == 1  # the grace is over: killed
    fresh = requeued(hpc, job)  # once Slurm reports it cancelled (after its own KillWait)
    assert fresh.reason == PendingReason.PREEMPTED and "cancelled in Slurm" in fresh.reason_message
    assert squeue(attempt.remote_id) in ("", "CANCELLED")
    attempt.refresh_from_db()
    assert attempt.state == AttemptState.PREEMPTED


def test_a_slurm_job_gets_the_signal_its_spec_names(hpc, alice, queue):
    job = job_on(
        hpc,
        alice,
        queue,
        "trap 'echo got TERM; exit 9' TERM; trap 'echo got USR1; exit 0' USR1; "
        "echo started; sleep 300 & wait",
        preemption={"signal": "USR1"},
    )
    running(hpc, job)
    preempt(job)
    requeued(hpc, job)
    assert "got USR1" in output(job) and "got TERM" not in output(job)


def test_a_job_still_pending_in_slurm_is_withdrawn_at_once(hpc, alice, queue):
    # Someone else's job fills n1 in Slurm, so the job Orrery places there waits in Slurm.
    blocker = subprocess.run(
        ["sbatch", "--parsable", "-w", "n1", "--gres=gpu:a100:4", "-o", "/dev/null", "--wrap", "sleep 300"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        Node.objects.filter(cluster=hpc).exclude(name="n1").update(state=NodeState.CORDONED)
        job = job_on(hpc, alice, queue, "echo ran")
        assert run_cycle(SchedulerCache()).placed == 1 and drain_outbox() == 1
        remote = JobAttempt.objects.get(job=job).remote_id
        wait(lambda: squeue(remote) == "PENDING", "Slurm to keep it pending", timeout=60)
        preempt(job)
        counts = sync_cluster(hpc)
        assert (counts.cancelled, counts.signalled, counts.moved) == (1, 0, 1)
        fresh = Job.objects.get(pk=job.pk)
        assert (fresh.state, fresh.reason) == (JobState.PENDING, PendingReason.PREEMPTED)
        assert fresh.reason_message == f"{WHO}; requeued (withdrawn while queued)"
        wait(lambda: squeue(remote) in ("", "CANCELLED"), "the Slurm job to be withdrawn", timeout=30)
    finally:
        subprocess.run(["scancel", blocker], timeout=30)
        Node.objects.filter(cluster=hpc).update(state=NodeState.READY)
