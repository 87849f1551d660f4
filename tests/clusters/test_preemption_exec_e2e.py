"""A preemption end to end on a real ``orrery-agent`` process talking to a live server: the job's
own process gets the signal (SIGTERM, or the one its spec names), a job that ignores it is killed
when its grace period ends, the job drains as PREEMPTED and comes back PENDING ("Preempted") with
its first attempt ``preempted``, and the next scheduling cycle runs it again as attempt 2.

The test drives the control plane's periodic work itself (cycles, the outbox), so each step is
seen in order; the agent is the real one, running real processes as the node's shared account."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusters.choices import ClusterKind, Identity, NodeState
from clusters.models import Cluster, Node
from clusters.services.credentials import create_join_token
from scheduling.choices import AttemptState, EventKind, JobState, PendingReason
from scheduling.dispatch.outbox import drain_outbox
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import run_cycle
from scheduling.models import Allocation, Job, JobAttempt, JobEvent
from scheduling.selectors import log_tail
from scheduling.services.jobs import cancel_job
from scheduling.services.preemption import Victim, preempt_jobs
from tests.factories import ensure_catalog, make_cluster, make_job, make_project, make_queue, make_user
from tests.processes import spawn_agent, wait

pytestmark = pytest.mark.django_db(transaction=True)
WHO = "preempted by job 77 of bob (priority 50 over 1)"


class Lab:
    def __init__(self, cluster: Cluster, work: Path) -> None:
        self.cluster, self.work = cluster, work
        alice = make_user("alice")
        self.queue = make_queue(make_project("vision", members=(alice,)))
        self.owner = alice

    def job(self, run: str, **spec) -> Job:
        return make_job(
            self.owner,
            self.queue,
            gpus=1,
            model="a100",
            placement={"clusters": [self.cluster.name]},
            command=run,
            spec=spec,
        )

    def place(self, job: Job) -> JobAttempt:
        assert run_cycle(SchedulerCache()).placed == 1
        assert drain_outbox() == 1
        wait(lambda: Job.objects.get(pk=job.pk).state == JobState.RUNNING, f"job {job.pk} to run")
        return JobAttempt.objects.get(job=job, active=True)

    def marker(self, attempt: JobAttempt) -> str:
        """What the job wrote to ``marker`` in its own directory ("" before it did)."""
        with contextlib.suppress(OSError):
            return (self.work / "jobs" / str(attempt.pk) / "marker").read_text().strip()
        return ""

    def pids(self, attempt: JobAttempt) -> list[int]:
        """The job's processes on this machine (its environment names the attempt)."""
        found = []
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                if proc.name.isdigit() and f"ORRERY_ATTEMPT_ID={attempt.pk}".encode() in (
                    proc / "environ"
                ).read_bytes().split(b"\0"):
                    found.append(int(proc.name))
        return found


@pytest.fixture
def lab(live_server, settings, tmp_path) -> Iterator[Lab]:
    """One node, ``n1``, running a real agent (two fake A100s) against the live server."""
    settings.ORRERY_HEARTBEAT_INTERVAL = 1
    ensure_catalog()
    cluster = make_cluster("lab", kind=ClusterKind.NATIVE, identity=Identity.SHARED)
    _, join = create_join_token(cluster)
    work = tmp_path / "agent"
    agent = spawn_agent(live_server.url, join, work, "n1", "a100:2")
    try:
        wait(lambda: Node.objects.filter(cluster=cluster, gpus__isnull=False).exists(), "n1 to register")
        Node.objects.filter(cluster=cluster).update(state=NodeState.READY)
        yield Lab(cluster, work)
    finally:
        agent.kill()
        agent.wait()
        for meta in work.glob("attempts/*/meta.json"):
            with contextlib.suppress(ProcessLookupError, KeyError, ValueError):
                os.killpg(json.loads(meta.read_text())["pgid"], signal.SIGKILL)


def preempt(job: Job) -> None:
    assert preempt_jobs([Victim(job.pk, WHO)]) == [job.pk]
    assert Job.objects.get(pk=job.pk).state == JobState.PREEMPTED


def requeued(job: Job) -> Job:
    return wait(
        lambda: (j := Job.objects.get(pk=job.pk)).state == JobState.PENDING and j,
        f"job {job.pk} to be requeued",
        timeout=30,
    )


def test_a_preempted_job_gets_sigterm_is_requeued_and_runs_again_as_attempt_2(lab):
    job = lab.job(
        "trap 'echo got TERM; echo got TERM > marker; exit 0' TERM; echo started > marker; sleep 300 & wait"
    )
    first = lab.place(job)
    wait(lambda: lab.marker(first) == "started", "the job's process to start")

    preempt(job)
    assert Allocation.objects.filter(job=job, active=True).exists()  # it keeps its GPUs while it drains
    fresh = requeued(job)
    assert lab.marker(first) == "got TERM"
    assert (fresh.reason, fresh.reason_message) == (
        PendingReason.PREEMPTED,
        f"{WHO}; requeued (SIGTERM, then exit code 0)",
    )
    first.refresh_from_db()
    assert (first.state, first.active, first.exit_code) == (AttemptState.PREEMPTED, False, 0)
    assert not Allocation.objects.filter(job=job, active=True).exists()
    moves = list(
        JobEvent.objects.filter(job=job, kind=EventKind.TRANSITION).values_list("from_state", "to_state")
    )
    assert moves[-2:] == [(JobState.RUNNING, JobState.PREEMPTED), (JobState.PREEMPTED, JobState.PENDING)]
    wait(lambda: "got TERM" in " ".join(log_tail(job.pk, 10)[0]), "its output to reach the server")
    wait(lambda: not lab.pids(first), "the first attempt's processes to be gone")

    second = lab.place(job)
    assert second.number == 2 and second.pk != first.pk
    wait(lambda: lab.marker(second) == "started", "attempt 2 to run")
    assert lab.pids(second)
    cancel_job(Job.objects.get(pk=job.pk), actor=None)
    wait(lambda: not lab.pids(second), "attempt 2 to stop")


def test_a_job_that_ignores_its_signal_is_killed_when_its_grace_ends(lab):
    lab.queue.preemption_grace_s = 2
    lab.queue.save()
    # The trap records the signal and carries on: only SIGKILL ends this job.
    job = lab.job("trap 'echo got TERM > marker' TERM; echo started > marker; while :; do sleep 0.1; done")
    attempt = lab.place(job)
    wait(lambda: lab.marker(attempt) == "started", "the job's process to start")

    preempt(job)
    wait(lambda: lab.marker(attempt) == "got TERM", "the signal to reach the job", timeout=10)
    signalled = time.monotonic()
    time.sleep(1.0)
    assert lab.pids(attempt) and Job.objects.get(pk=job.pk).state == JobState.PREEMPTED  # within its grace
    fresh = requeued(job)
    assert time.monotonic() - signalled >= 1.8  # the grace, less the time the test took to see the signal
    assert fresh.reason_message == f"{WHO}; requeued (SIGTERM, then killed after its 2 s grace)"
    attempt.refresh_from_db()
    assert (attempt.state, attempt.exit_code) == (AttemptState.PREEMPTED, None)
    wait(lambda: not lab.pids(attempt), "the killed processes to be gone", timeout=5)


def test_the_signal_a_job_asks_for_is_the_one_it_gets(lab):
    job = lab.job(
        "trap 'echo got TERM > marker; exit 9' TERM; trap 'echo got USR1 > marker; exit 0' USR1; "
        "echo started > marker; sleep 300 & wait",
        preemption={"signal": "USR1", "graceSeconds": 20},
    )
    attempt = lab.place(job)
    wait(lambda: lab.marker(attempt) == "started", "the job's process to start")
    preempt(job)
    fresh = requeued(job)
    assert lab.marker(attempt) == "got USR1"
    assert fresh.reason_message == f"{WHO}; requeued (SIGUSR1, then exit code 0)"
    attempt.refresh_from_db()
    assert (attempt.state, attempt.exit_code, attempt.stop_signal, attempt.stop_grace_s) == (
        AttemptState.PREEMPTED,
        0,
        "USR1",
        20,
    )
