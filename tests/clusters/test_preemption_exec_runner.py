"""A preemption on the node (clusters/agent/): the runner sends an attempt its own signal and
kills it after its own grace period, reports it ``preempted`` with its exit code, and goes on
with a stop it began after a restart; the agent reads ``stop`` from the server's answer, never
starts a preempted attempt, and still works with a server that sends no ``stop``.

Real processes, as root, with a cgroup per attempt or with only a process group (an agent not
running as root)."""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path

import pytest

from clusters.agent.agent import Agent, stop_terms
from clusters.agent.cgroups import Cgroups
from clusters.agent.runner import Runner

# Each job writes its marker in its own directory (it runs as the node's shared account).
TRAPS = "trap 'echo got {sig} > marker; exit 0' {sig}; echo started > marker; sleep 300 & wait"
IGNORES = "trap '' TERM; echo started > marker; while :; do sleep 0.1; done"


@pytest.fixture(params=["cgroup", "process-group"])
def cgroups(request):
    if request.param == "process-group":
        return None
    found, why = Cgroups.detect("preempt-test")
    assert found is not None, f"the agent tests run as root with cgroups: {why}"
    return found


def entry(attempt: str, script: str, **extra) -> dict:
    return {"attempt": attempt, "job": 1, "script": script, "user": "", **extra}


def wait_for(condition, what: str, timeout: float = 10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := condition():
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def ended(runner: Runner, timeout: float = 10.0) -> dict[str, dict]:
    """Poll until every attempt ended; their reports by attempt id."""
    reports: dict[str, dict] = {}

    def done() -> bool:
        reports.update({r["attempt"]: r for r in runner.poll()})
        return not runner.attempts

    wait_for(done, "the attempts to end", timeout)
    return reports


def marker_of(work: Path, attempt: str) -> Path:
    return work / "jobs" / attempt / "marker"


def started(marker: Path) -> None:
    wait_for(lambda: marker.exists() and marker.read_text().strip() == "started", "the job to start")


def job_processes(attempt: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if f"ORRERY_ATTEMPT_ID={attempt}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def gone(*attempts: str) -> None:
    """Nothing of the attempts is left (a SIGKILL takes a moment to land: a shell's background
    child ignores SIGINT, and goes with the rest of its group once the job's shell ended)."""
    wait_for(lambda: not any(job_processes(a) for a in attempts), "every process of the attempts to go", 5)


@pytest.mark.parametrize("sig", ["TERM", "USR1", "INT"])
def test_a_preempted_attempt_gets_its_signal_and_ends_with_its_exit_code(tmp_path, cgroups, sig):
    attempt = str(uuid.uuid4())
    marker = marker_of(tmp_path / "work", attempt)
    runner = Runner(tmp_path / "work", grace=30, cgroups=cgroups)
    runner.start(entry(attempt, TRAPS.format(sig=sig)))
    started(marker)
    asked = time.monotonic()
    runner.stop(attempt, "preempted", signal.Signals[f"SIG{sig}"], 30)
    report = ended(runner)[attempt]
    assert time.monotonic() - asked < 5, "it ended on its signal, not at the end of its grace"
    assert marker.read_text().strip() == f"got {sig}"
    assert report == {
        "attempt": attempt,
        "state": "preempted",
        "exit_code": 0,
        "reason": f"SIG{sig}, then exit code 0",
    }
    gone(attempt)


def test_a_job_that_ignores_its_signal_is_killed_after_its_own_grace_not_the_runners(tmp_path, cgroups):
    preempted, cancelled = str(uuid.uuid4()), str(uuid.uuid4())
    runner = Runner(tmp_path / "work", grace=0.5, cgroups=cgroups)
    for attempt in (preempted, cancelled):
        runner.start(entry(attempt, IGNORES))
        started(marker_of(tmp_path / "work", attempt))
    asked = time.monotonic()
    runner.stop(preempted, "preempted", signal.SIGTERM, 2.5)
    runner.stop(cancelled)  # any other stop keeps the runner's grace
    first = wait_for(lambda: runner.poll(), "the cancelled attempt to be killed")
    assert [r["attempt"] for r in first] == [cancelled] and first[0]["state"] == "cancelled"
    assert time.monotonic() - asked < 2.0 and job_processes(preempted), "killed before its grace ended"
    report = ended(runner)[preempted]
    assert time.monotonic() - asked >= 2.5
    assert report["state"] == "preempted" and report["reason"] == "SIGTERM, then killed after its 2.5 s grace"
    gone(preempted, cancelled)


def test_a_second_stop_changes_nothing(tmp_path, cgroups):
    attempt = str(uuid.uuid4())
    marker = marker_of(tmp_path / "work", attempt)
    runner = Runner(tmp_path / "work", grace=0.5, cgroups=cgroups)
    runner.start(entry(attempt, IGNORES))
    started(marker)
    runner.stop(attempt, "preempted", signal.SIGUSR1, 1.0)
    runner.stop(attempt, "cancelled")  # the next heartbeat, or the server's stop list
    report = ended(runner)[attempt]
    assert (report["state"], report["reason"]) == (
        "preempted",
        "SIGUSR1, then exit code 138",
    )  # USR1 is not ignored: 128 + 10


def test_a_restarted_agent_goes_on_with_the_preemption_it_began(tmp_path, cgroups):
    attempt = str(uuid.uuid4())
    marker = marker_of(tmp_path / "work", attempt)
    first = Runner(tmp_path / "work", grace=0.5, cgroups=cgroups)
    first.start(entry(attempt, IGNORES))
    started(marker)
    asked = time.monotonic()
    first.stop(attempt, "preempted", signal.SIGTERM, 2.0)
    again = Runner(tmp_path / "work", grace=0.5, cgroups=cgroups)  # the agent was restarted
    assert again.is_stopping(attempt)
    report = ended(again)[attempt]
    assert 2.0 <= time.monotonic() - asked < 5, "the grace ran from the first stop, not the restart"
    assert (report["state"], report["reason"]) == ("preempted", "SIGTERM, then killed after its 2 s grace")
    gone(attempt)


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        ({"signal": "TERM", "grace_s": 30}, (signal.SIGTERM, 30.0)),
        ({"signal": "USR1", "grace_s": 2}, (signal.SIGUSR1, 2.0)),
        ({"signal": "SIGHUP", "grace_s": 0}, (signal.SIGHUP, 0.0)),
        ({"signal": "usr2", "grace_s": 1.5}, (signal.SIGUSR2, 1.5)),
        ({"signal": "KILL", "grace_s": 5}, (signal.SIGTERM, 5.0)),  # a stop always leaves a chance
        ({"signal": "NOPE"}, (signal.SIGTERM, 7.0)),
        ({"signal": 15, "grace_s": -1}, (signal.SIGTERM, 7.0)),
        ({"grace_s": "30"}, (signal.SIGTERM, 7.0)),
        ({"grace_s": True}, (signal.SIGTERM, 7.0)),
        ({"grace_s": 10**9}, (signal.SIGTERM, 7.0)),
        ({"grace_s": float("nan")}, (signal.SIGTERM, 7.0)),
        ({}, (signal.SIGTERM, 7.0)),
    ],
    ids=lambda v: str(v),
)
def test_stop_terms_are_read_safely(stop, expected):
    assert stop_terms({"attempt": "a", "stop": stop}, 7.0) == expected


@pytest.mark.parametrize("entry_", [None, {"attempt": "a"}, {"attempt": "a", "stop": "TERM"}, {"stop": None}])
def test_an_entry_without_a_stop_is_not_a_preemption(entry_):
    assert stop_terms(entry_, 7.0) is None


# --- the agent's reconcile: what it does with the server's answer -----------------------------------


@pytest.fixture
def agent(tmp_path) -> Agent:
    """An agent whose server is never asked here: the tests hand it answers."""
    return Agent("http://127.0.0.1:9", tmp_path / "agent", name="n1", fake_gpus="h100:1", grace=0.5)


def test_the_agent_never_starts_a_preempted_attempt_and_reports_it(agent, tmp_path):
    attempt = str(uuid.uuid4())
    preempted = entry(attempt, "touch marker", stop={"signal": "TERM", "grace_s": 30})
    agent._reconcile([preempted], set())
    agent._reconcile([preempted], set())  # the next heartbeat, before the server heard
    time.sleep(0.3)
    assert not (tmp_path / "agent" / "jobs" / attempt).exists() and not agent.runner.attempts
    assert agent.queue == [{"attempt": attempt, "state": "preempted", "reason": "before it started"}]
    assert Agent("http://127.0.0.1:9", tmp_path / "agent", name="n1", fake_gpus="h100:1").runner.is_ended(
        attempt
    ), "a restarted agent would start it"


def test_the_agent_stops_a_running_attempt_with_the_stop_it_is_given(agent, tmp_path):
    attempt = str(uuid.uuid4())
    marker = marker_of(tmp_path / "agent", attempt)
    running = entry(attempt, TRAPS.format(sig="USR2"))
    agent._reconcile([running], set())
    started(marker)
    agent._reconcile([running | {"stop": {"signal": "USR2", "grace_s": 20}}], {attempt})
    wait_for(lambda: (agent._spool_ends(), not agent.runner.attempts)[1], "the attempt to end")
    assert marker.read_text().strip() == "got USR2"
    ends = [r for r in agent.queue if r["state"] != "running"]
    assert ends == [
        {"attempt": attempt, "state": "preempted", "exit_code": 0, "reason": "SIGUSR2, then exit code 0"}
    ]


def test_with_a_server_that_sends_no_stop_the_agent_works_as_before(agent, tmp_path):
    attempt = str(uuid.uuid4())
    marker = marker_of(tmp_path / "agent", attempt)
    running = entry(attempt, IGNORES)
    agent._reconcile([running], set())
    started(marker)
    agent._reconcile([running], set())
    time.sleep(0.2)
    agent._spool_ends()
    assert attempt in agent.runner.attempts  # still wanted: it runs on
    agent._reconcile([], set())  # no longer wanted: SIGTERM, the agent's grace, SIGKILL
    wait_for(lambda: (agent._spool_ends(), not agent.runner.attempts)[1], "the attempt to end")
    (end,) = [r for r in agent.queue if r["state"] != "running"]
    assert (end["state"], end["reason"]) == ("cancelled", "stopped by the agent")
