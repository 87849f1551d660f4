"""``orrery submit --dependency`` end to end: the CLI as a real process against a live server."""

from __future__ import annotations

import json
import subprocess

import pytest

from scheduling.choices import JobState
from scheduling.models import Job
from scheduling.services.transitions import transition_job
from tests.portal.cli_runs import alice_world, cli_env, run_cli

pytestmark = pytest.mark.django_db(transaction=True)

SPEC = """\
apiVersion: orrery/v1
kind: Job
metadata: {name: step, project: vision}
spec:
  resources: {gpus: "h100:1"}
  timeLimit: 30m
  run: python step.py
"""


@pytest.fixture
def cli(live_server, tmp_path):
    _, token = alice_world()
    env = cli_env(tmp_path)
    spec = tmp_path / "step.yaml"
    spec.write_text(SPEC)

    def run(*args: str) -> subprocess.CompletedProcess:
        return run_cli(env, *args)

    assert run("login", "--server", live_server.url, "--token", token).returncode == 0

    def submit(*args: str) -> subprocess.CompletedProcess:
        return run("submit", "-f", str(spec), *args)

    run.submit = submit  # type: ignore[attr-defined]
    return run


def _submitted_id(result: subprocess.CompletedProcess) -> int:
    assert result.returncode == 0, result.stderr
    return int(result.stdout.split()[2])


def _run_to(job_id: int, state: str) -> None:
    """The job runs and ends as ``state`` (no scheduler runs here: moved as a cluster would)."""
    Job.objects.filter(pk=job_id).update(state=JobState.RUNNING)
    transition_job(job_id, state)


def test_afterok_waits_for_success_and_is_cancelled_by_a_failure(cli):
    first = _submitted_id(cli.submit())
    waiting = cli.submit("--dependency", f"afterok:{first}")
    second = _submitted_id(waiting)
    assert "PENDING: Dependency" in waiting.stdout
    shown = json.loads(cli("show", str(second), "-o", "json").stdout)
    assert (shown["reason"], shown["reasonMessage"]) == ("Dependency", f"waits for {first} (afterok)")
    assert shown["dependency"] == [{"kind": "afterok", "job": str(first), "state": "waiting"}]

    _run_to(first, JobState.SUCCEEDED)
    released = Job.objects.get(pk=second)
    assert (released.state, released.reason, released.dependency_pending) == ("PENDING", "None", False)

    doomed = _submitted_id(cli.submit("-d", f"afterok:{second},afterany:{first}"))
    _run_to(second, JobState.FAILED)
    events = cli("events", str(doomed)).stdout
    assert "CANCELLED" in events and "DependencyNeverSatisfied" in events
    assert Job.objects.get(pk=doomed).state == JobState.CANCELLED

    refused = cli.submit("--dependency", f"afterok:{second}")
    assert refused.returncode == 1
    assert "spec.dependency" in refused.stderr
    assert f"job {second} already ended FAILED; afterok can never be met" in refused.stderr
