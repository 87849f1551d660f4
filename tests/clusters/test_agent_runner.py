"""The agent's runner on its own, as root with real cgroups: what an agent killed at the worst
moment leaves behind is cleaned up, and a refused attempt starts nothing."""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest

from clusters.agent.cgroups import Cgroups
from clusters.agent.runner import Refused, Runner


@pytest.fixture
def cgroups():
    found, why = Cgroups.detect("runner-test")
    assert found is not None, f"the agent tests run as root with cgroups: {why}"
    return found


def entry(attempt: str, script: str, **extra) -> dict:
    return {"attempt": attempt, "job": 1, "script": script, "user": "", **extra}


def sleepers(marker: str) -> list[str]:
    return subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()


def test_an_attempt_started_but_never_recorded_is_not_run_twice(tmp_path, cgroups):
    attempt = str(uuid.uuid4())
    marker = f"sleep 3{uuid.uuid4().int % 1000:03d}"
    first = Runner(tmp_path, grace=0.5, cgroups=cgroups)
    first.start(entry(attempt, f"(setsid sh -c 'exec {marker}' &); exec {marker}"))
    deadline = time.monotonic() + 10
    while len(sleepers(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(sleepers(marker)) == 2
    # The agent dies after starting the attempt and before recording it.
    (tmp_path / "attempts" / attempt / "meta.json").unlink()
    again = Runner(tmp_path, grace=0.5, cgroups=cgroups)
    assert attempt not in again.attempts  # nothing to adopt: the server's list starts it again
    again.start(entry(attempt, f"exec {marker}"))
    time.sleep(0.3)
    assert len(sleepers(marker)) == 1, "the unrecorded first start still runs beside the second"
    again.stop(attempt)
    deadline = time.monotonic() + 10
    while again.attempts and time.monotonic() < deadline:
        again.poll()
        time.sleep(0.05)
    assert not sleepers(marker) and not cgroups.group(attempt).exists()


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"user": None}, "no POSIX account"),
        ({"user": "root"}, "work never runs as root"),
        ({"user": "orrt-nobody-here"}, "no user 'orrt-nobody-here'"),
        ({"env": {"BAD-NAME": "x"}}, "not an environment variable name"),
        ({"image": "localhost/x:1", "env": {"A": "two\nlines"}}, "newline"),
    ],
)
def test_an_attempt_that_cannot_run_here_is_refused_before_anything_starts(tmp_path, cgroups, fields, words):
    attempt = str(uuid.uuid4())
    runner = Runner(tmp_path, cgroups=cgroups)
    with pytest.raises(Refused, match=words):
        runner.start(entry(attempt, "echo never") | fields)
    assert not (tmp_path / "jobs" / attempt).exists() and not cgroups.group(attempt).exists()


def test_two_agents_on_one_machine_keep_the_ranks_of_one_gang_apart(tmp_path):
    """Both ranks of a gang attempt share its id; two agents on one machine (development, the
    tests) must not share its cgroup, or one rank's end or start kills the other."""
    attempt = str(uuid.uuid4())
    marker = f"sleep 4{uuid.uuid4().int % 1000:03d}"
    ranks = [Runner(tmp_path / name, grace=0.5, cgroups=Cgroups.detect(name)[0]) for name in ("n1", "n2")]
    for runner in ranks:
        runner.start(entry(attempt, f"exec {marker}"))
    deadline = time.monotonic() + 10
    while len(sleepers(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(sleepers(marker)) == 2, "starting the second rank killed the first"
    first, second = ranks
    first.stop(attempt)
    while first.attempts and time.monotonic() < deadline + 10:
        first.poll()
        time.sleep(0.05)
    assert len(sleepers(marker)) == 1, "ending one rank killed the other"
    second.stop(attempt)
    while second.attempts and time.monotonic() < deadline + 20:
        second.poll()
        time.sleep(0.05)
    assert not sleepers(marker)
