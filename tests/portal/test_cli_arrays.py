"""Arrays and updates through the ``orrery`` CLI, run as a real process against a live server:
``submit -f`` of an array with a throttle, of a YAML list and of several documents; ``jobs``
with its summary row and ``-r``; ``cancel`` of a range and of a whole array; ``update``."""

from __future__ import annotations

import contextlib
import io
import json
from types import SimpleNamespace
from typing import Any

import pytest

from portal.cli.commands import main
from scheduling.models import Job
from tests.portal.cli_runs import alice_world, cli_env, run_cli

pytestmark = pytest.mark.django_db(transaction=True)

ARRAY = """\
apiVersion: orrery/v1
kind: Job
metadata: {name: sweep, project: vision}
spec:
  array: "0-5%2"
  resources: {gpus: "h100:1"}
  timeLimit: 30m
  run: python sweep.py --seed $ORRERY_ARRAY_INDEX
"""

PLAIN = """\
- apiVersion: orrery/v1
  metadata: {name: first, project: vision}
  spec: {run: "true", timeLimit: 10m}
- apiVersion: orrery/v1
  metadata: {name: second, project: vision}
  spec: {run: "true", timeLimit: 10m}
"""


@pytest.fixture
def cli(live_server, tmp_path, monkeypatch):
    """``cli(*args)`` runs ``orrery`` logged in as alice, a member of project vision: in this
    process (its ``main``, real HTTP to the live server; a fresh interpreter costs seconds), or
    as a real process with ``process=True``."""
    _, token = alice_world()
    env = cli_env(tmp_path) | {"ORRERY_SERVER": live_server.url, "ORRERY_TOKEN": token}
    for key, value in env.items():
        if key.startswith("ORRERY_"):
            monkeypatch.setenv(key, value)

    def run(*args: str, process: bool = False) -> Any:
        if process:
            return run_cli(env, *args)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse refuses the arguments
                code = exc.code
        return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())

    return run


def first_column(listing: str) -> list[str]:
    return [line.split()[0] for line in listing.splitlines()[1:]]


def test_an_array_from_submit_to_cancel(cli, tmp_path):
    spec = tmp_path / "array.yaml"
    spec.write_text(ARRAY)
    submitted = cli("submit", "-f", str(spec), process=True)
    assert submitted.returncode == 0, submitted.stderr
    array = Job.objects.order_by("pk").first().pk
    assert f"Submitted array {array} (sweep): 6 tasks {array}_[0-5%2] — PENDING" in submitted.stdout
    assert Job.objects.filter(array_id=array, array_throttle=2).count() == 6

    summary = cli("jobs")
    assert first_column(summary.stdout) == [f"{array}_[0-5%2]"]
    assert summary.stdout.splitlines()[1].split()[1] == "sweep"
    expanded = cli("jobs", "-r")
    assert sorted(first_column(expanded.stdout)) == [f"{array}_{i}" for i in range(6)]

    ranged = cli("cancel", f"{array}_[1-2]")
    assert ranged.returncode == 0, ranged.stderr
    assert ranged.stdout.strip() == f"{array}_[1-2]: 2 cancelled"
    assert first_column(cli("jobs").stdout) == [f"{array}_[0,3-5%2]"]  # squeue: ended ones are gone
    assert sorted(first_column(cli("jobs", "--all").stdout)) == sorted(
        [f"{array}_[0,3-5%2]", f"{array}_1", f"{array}_2"]
    )

    updated = cli("update", str(array), "--time-limit", "10m", "--throttle", "3", "--priority", "5")
    assert updated.returncode == 0, updated.stderr
    assert updated.stdout.strip() == f"{array}: 4 updated, 2 unchanged"
    shown = json.loads(cli("show", f"{array}_3", "-o", "json").stdout)
    assert (shown["ref"], shown["timeLimitSeconds"], shown["arrayThrottle"], shown["priority"]) == (
        f"{array}_3",
        600,
        3,
        5,
    )
    raised = cli("update", f"{array}_3", "--time-limit", "2h")
    assert raised.returncode == 1 and "may only be lowered" in raised.stderr
    held = cli("update", f"{array}_4", "--hold")
    assert held.stdout.strip() == f"job {array}_4: updated (HELD)"
    events = cli("events", f"{array}_3")
    assert "time limit 0:30:00 → 0:10:00" in events.stdout

    whole = cli("cancel", str(array))
    assert whole.stdout.strip() == f"{array}: 4 cancelled, 2 unchanged"
    assert set(Job.objects.filter(array_id=array).values_list("state", flat=True)) == {"CANCELLED"}
    junk = cli("cancel", f"{array}_[x]")
    assert junk.returncode == 2 and "is not a job" in junk.stderr


def test_a_yaml_list_and_several_documents_submit_every_spec(cli, tmp_path):
    listed = tmp_path / "list.yaml"
    listed.write_text(PLAIN)
    result = cli("submit", "-f", str(listed))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("Submitted job") == 2
    several = tmp_path / "several.yaml"
    several.write_text(ARRAY.replace("0-5%2", "0-1") + "---\n" + PLAIN)
    result = cli("submit", "-f", str(several))
    assert result.returncode == 0, result.stderr
    assert "2 tasks" in result.stdout and result.stdout.count("Submitted job") == 2
    assert sorted(Job.objects.values_list("name", flat=True)) == sorted(
        ["first", "second", "sweep-0", "sweep-1", "first", "second"]
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    refused = cli("submit", "-f", str(bad))
    assert refused.returncode == 1 and "item 1 is not a job spec" in refused.stderr
