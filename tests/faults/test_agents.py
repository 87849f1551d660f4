"""The fault suite, agent half: real agents under a live control plane (``agent_lab``), each
scenario ending with the invariant checker.

What an agent must guarantee under faults: an attempt never runs twice at once (an agent cut off
from the server past its lease — the node failover time the server announces — stops its work
before the server may requeue it, and a restarted agent never starts again what it already
started); and a flapping node is damped, never marked ready while silent. That no report is
lost (an unwritable spool stops neither the agent nor its reports) and that reporting never
wedges (200 MB or binary output) is ``tests/clusters/test_agent_faults.py``'s.
"""

from __future__ import annotations

import sys
import time

import pytest
from django.conf import settings
from django.db import close_old_connections, connection

from clusters.choices import NodeState
from clusters.models import Node, NodeEvent
from scheduling.models import Allocation, JobAttempt, JobEvent, JobLog
from tests.faults.agent_lab import ENDED, Lab, attempt_shells, attempts_of, job_shells, job_state
from tests.faults.invariants import assert_invariants
from tests.processes import Service, wait

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def lab(tmp_path):
    """``lab(**timers)`` starts a live control plane with these environment overrides; every
    process is stopped at the end, whatever happened."""
    if not settings.REDIS_URL:
        pytest.skip("the processes share the heartbeat buffer and the broker through Redis")
    labs: list[Lab] = []

    def start(**timers: str) -> Lab:
        labs.append(Lab(tmp_path, **timers))
        return labs[-1].start()

    yield start
    for each in labs:
        each.close()


def check(lab: Lab, settle_s: float = 0.0) -> None:
    close_old_connections()
    with connection.cursor() as cursor:
        assert_invariants(cursor, accepted_jobs=lab.accepted, settle_s=settle_s)


def node_of(attempt_id: str) -> str:
    return (
        Allocation.objects.filter(attempt_id=attempt_id, gpu__isnull=True)
        .values_list("node__name", flat=True)
        .get()
    )


def live_attempt(job_id: int) -> str | None:
    pk = JobAttempt.objects.filter(job_id=job_id, active=True).values_list("pk", flat=True).first()
    return str(pk) if pk else None


def transitions(job_id: int) -> list[tuple[str, str]]:
    return list(
        JobEvent.objects.filter(job_id=job_id, kind="transition")
        .order_by("id")
        .values_list("from_state", "to_state")
    )


def stored_log(job_id: int) -> str:
    return "".join(JobLog.objects.filter(job_id=job_id).values_list("text", flat=True))


class Sampler:
    """Samples, while a scenario unfolds, how many processes run for each of some jobs (here, on
    any node: every agent runs on this machine) and remembers the worst moment."""

    def __init__(self, *jobs: int) -> None:
        self.jobs = jobs
        self.worst: list[tuple[float, int, list[tuple[str, int]]]] = []

    def sample(self) -> None:
        close_old_connections()
        for job in self.jobs:
            shells = job_shells(job)
            if len(shells) > 1:
                self.worst.append((time.time(), job, shells))

    def until(self, condition, what: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.sample()
            if condition():
                return
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for: {what}")

    def assert_never_twice(self) -> None:
        assert not self.worst, "one job ran twice at once:\n" + "\n".join(
            f"  {time.strftime('%H:%M:%S', time.localtime(t))} job {job}: {shells}"
            for t, job, shells in self.worst[:5]
        )


def test_an_agent_killed_and_back_before_failover_adopts_its_work(lab):
    """Scenario: the agent is SIGKILLed and restarted well within the failover time. Its
    attempt runs on untouched, the new agent adopts it, and it ends normally: one attempt, no
    requeue, never a second process."""
    plane = lab(ORRERY_NODE_FAILOVER_AFTER="30")
    plane.start_agent("fa-a")
    plane.wait_ready("fa-a")
    job = plane.submit("adopted", "sleep 10; echo adopted-done", retries=1, failover="requeue")
    plane.wait_job(job, "RUNNING")
    [(attempt, pid)] = wait(lambda: job_shells(job), "the attempt's process")
    watch = Sampler(job)

    plane.kill_agent("fa-a")
    end = time.monotonic() + 4  # longer than the grace (3 s): the node may go not ready
    while time.monotonic() < end:
        assert job_shells(job) == [(attempt, pid)], "the attempt runs on while its agent is away"
        time.sleep(0.2)
    plane.start_agent("fa-a")
    watch.until(lambda: job_state(job) in ENDED, "the adopted attempt to end", timeout=40)

    watch.assert_never_twice()
    assert job_state(job) == "SUCCEEDED"
    assert attempts_of(job) == {attempt}, "the job was never requeued"
    assert ("RUNNING", "PENDING") not in transitions(job)
    assert "adopted-done" in wait(lambda: stored_log(job), "the output")
    plane.wait_ready("fa-a")
    check(plane, settle_s=5)


def test_an_agent_killed_past_failover_stops_the_stale_attempt_on_return(lab):
    """Scenario: the agent is SIGKILLed and stays away past the failover time; the server
    requeues the job elsewhere. The restarted agent must kill at once the attempt the server no
    longer wants (its process outlived the agent, which could not fence it)."""
    plane = lab(ORRERY_NODE_GRACE="2", ORRERY_NODE_FAILOVER_AFTER="6")
    plane.start_agent("fa-a")
    plane.wait_ready("fa-a")
    job = plane.submit("moved", "sleep 300", retries=1, failover="requeue")
    plane.wait_job(job, "RUNNING")
    [(old, _)] = wait(lambda: job_shells(job), "the attempt's process")
    plane.start_agent("fa-b")
    plane.wait_ready("fa-b")

    plane.kill_agent("fa-a")
    wait(lambda: (new := live_attempt(job)) and new != old and job_state(job) == "RUNNING", "the requeue", 60)
    returned = time.monotonic()
    plane.start_agent("fa-a")
    wait(lambda: old not in dict(attempt_shells()), "the returning agent to stop the stale attempt", 15)
    print(f"stale attempt stopped {time.monotonic() - returned:.1f} s after its agent returned")
    assert node_of(live_attempt(job)) == "fa-b"
    check(plane, settle_s=5)


def test_an_agent_cut_off_past_failover_fences_itself(lab):
    """Scenario: the agent stays alive but cannot reach the server (a cut TCP link) for longer
    than the failover time; the server requeues its job on another node. At no sampled moment
    may two processes run for the job: the cut-off agent must stop its attempt (its lease, the
    announced failover time, runs out) before the server may requeue it. When the link is back,
    the agent keeps nothing the server does not want."""
    plane = lab(ORRERY_NODE_GRACE="2", ORRERY_NODE_FAILOVER_AFTER="6")
    link = plane.link()
    plane.start_agent("fa-a", via=link)
    plane.wait_ready("fa-a")
    job = plane.submit("fenced", "sleep 300", retries=1, failover="requeue")
    plane.wait_job(job, "RUNNING")
    [(old, _)] = wait(lambda: job_shells(job), "the attempt's process")
    plane.start_agent("fa-b")
    plane.wait_ready("fa-b")
    watch = Sampler(job)

    link.cut()
    cut_at = time.monotonic()
    stopped_at = None

    def requeued_and_running() -> bool:
        nonlocal stopped_at
        if stopped_at is None and old not in dict(attempt_shells()):
            stopped_at = time.monotonic()
        new = live_attempt(job)
        return bool(new and new != old and any(a == new for a, _ in job_shells(job)))

    watch.until(requeued_and_running, "the job to run again on fa-b", timeout=60)
    requeued_at = time.monotonic()
    # The old process, if it still runs, is caught beside the new one (it cannot come back once
    # gone: its agent is cut off), sampled every 0.1 s.
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        requeued_and_running()
        watch.sample()
        time.sleep(0.1)
    print(
        f"cut-off agent stopped its attempt after {stopped_at - cut_at:.1f} s; "
        if stopped_at
        else "cut-off agent never stopped its attempt; ",
        f"the requeued attempt ran after {requeued_at - cut_at:.1f} s",
    )
    link.restore()
    plane.wait_ready("fa-a")
    watch.sample()
    watch.assert_never_twice()
    assert plane.agents["fa-a"].poll() is None, "the agent survives the outage"
    assert node_of(live_attempt(job)) == "fa-b"
    check(plane, settle_s=10)


# The ticker runs the heartbeat flush and the node lifecycle every 0.25 s besides beat's own
# passes (every 2 s and 5 s), so that the node's state follows a flap of a few seconds.
TICKER = (
    "import time, django\n"
    "django.setup()\n"
    "from clusters.tasks import flush_heartbeats_task, node_lifecycle_task\n"
    "while True:\n"
    "    flush_heartbeats_task()\n"
    "    node_lifecycle_task()\n"
    "    time.sleep(0.25)\n"
)


def test_a_flapping_agent_is_damped_and_never_marked_ready_while_silent(lab):
    """Scenario: heartbeats cut 4.5 s, let through 2 s, for 30 s, with the production timers
    scaled by 0.1 (grace 40 → 4 s, recovery 30 → 3 s, heartbeat 10 → 1 s). The issue saw 9
    flips in 5 minutes (the scaled 30 s) and the node marked ready while already silent again.
    Damping allows at most 3 state changes in the window, and none to ready while the node has
    been silent for more than 2.5 heartbeat intervals."""
    plane = lab(
        ORRERY_NODE_GRACE="4",
        ORRERY_NODE_RECOVERY="3",
        ORRERY_HEARTBEAT_INTERVAL="1",
        ORRERY_NODE_FAILOVER_AFTER="30",
    )
    plane.add(Service([sys.executable, "-c", TICKER], plane.env, plane.tmp / "ticker.log"))
    link = plane.link()
    plane.start_agent("fa-a", via=link)
    plane.wait_ready("fa-a")
    time.sleep(4)  # a run of on-time heartbeats longer than the recovery time
    node = Node.objects.get(name="fa-a")
    last_event = NodeEvent.objects.filter(node=node).order_by("-id").values_list("id", flat=True).first() or 0

    end = time.monotonic() + 30
    while time.monotonic() < end:
        link.cut()
        time.sleep(4.5)
        link.restore()
        time.sleep(2)
    close_old_connections()
    flips = list(NodeEvent.objects.filter(node=node, id__gt=last_event).order_by("id"))
    print("flips:", [(f"{e.at:%H:%M:%S.%f}"[:12], e.from_state, e.to_state) for e in flips])

    problems = [f"{len(flips)} state changes in 30 s of flapping: not damped"] if len(flips) > 3 else []
    for event in flips:
        if event.to_state != NodeState.READY:
            continue
        at = event.at.timestamp()
        for start, stop in link.cuts:
            if start + 2.5 < at and (stop is None or at < stop):
                problems.append(f"marked ready at {event.at:%H:%M:%S} after {at - start:.1f} s of silence")
    assert not problems, "; ".join(problems)
    assert plane.agents["fa-a"].poll() is None
    check(plane)


def test_an_agent_killed_between_starting_and_reporting_never_starts_twice(lab):
    """Scenario: the agent is SIGKILLed the moment its attempt's process appears, before the
    server hears that it runs, and restarted. Exactly one process runs the attempt afterwards,
    and the attempt ends once."""
    plane = lab(ORRERY_NODE_FAILOVER_AFTER="30")
    plane.start_agent("fa-a")
    plane.wait_ready("fa-a")
    job = plane.submit("crash-start", "echo started-once; sleep 8; echo crash-done")
    attempts = wait(lambda: attempts_of(job), "the job's attempt")
    [attempt] = attempts
    deadline = time.monotonic() + 30
    while not any(a == attempt for a, _ in attempt_shells()):
        assert time.monotonic() < deadline, "the attempt never started"
    plane.kill_agent("fa-a")
    close_old_connections()
    state_at_kill = job_state(job)
    first = [pid for a, pid in attempt_shells() if a == attempt]
    print(f"agent killed with the job {state_at_kill} on the server; attempt processes: {first}")

    plane.start_agent("fa-a")
    counts = []
    end = time.monotonic() + 40
    while job_state(job) not in ENDED and time.monotonic() < end:
        counts.append(len([pid for a, pid in attempt_shells() if a == attempt]))
        time.sleep(0.2)
    assert job_state(job) == "SUCCEEDED", f"the job ended {job_state(job)}"
    assert max(counts, default=0) <= 1, f"the attempt ran in {max(counts)} processes at once"
    assert attempts_of(job) == {attempt}
    ends = [t for t in transitions(job) if t[1] in ENDED]
    assert len(ends) == 1, f"the attempt ended {len(ends)} times: {transitions(job)}"
    log = wait(lambda: "crash-done" in (text := stored_log(job)) and text, "the output")
    print(f"the attempt's script started {log.count('started-once')} time(s)")
    check(plane, settle_s=5)
