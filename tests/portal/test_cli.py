"""The ``orrery`` CLI, run as a real process against a live server (real HTTP, real port)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from portal.services.tokens import issue_token
from tests.factories import make_cluster, make_node, make_project, make_queue, make_user

pytestmark = pytest.mark.django_db(transaction=True)

SPEC = """\
apiVersion: orrery/v1
kind: Job
metadata: {name: cli-train, project: vision}
spec:
  resources: {gpus: "h100:4", cpus: 8, memory: 64Gi}
  timeLimit: 30m
  run: python train.py
"""


@pytest.fixture
def cli(live_server, tmp_path):
    alice = make_user("alice")
    make_queue(make_project("vision", members=(alice,)))
    make_node(make_cluster("sim-a"), gpus=8, model="h100")
    _, token = issue_token(alice)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORRERY_")}
    env |= {"ORRERY_CONFIG": str(tmp_path / "config.yaml")}

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "portal.cli.commands", *args],
            input=stdin,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    login = run("login", "--server", live_server.url, "--token", token)
    assert login.returncode == 0, login.stderr
    assert "as alice" in login.stdout
    assert oct((tmp_path / "config.yaml").stat().st_mode & 0o777) == "0o600"
    return run


def test_submit_show_cancel_round_trip(cli, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC)
    submitted = cli("submit", "-f", str(spec))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.split()[2]
    assert "PENDING" in submitted.stdout

    listing = cli("jobs")
    assert listing.stdout.splitlines()[0].split()[:6] == ["JOBID", "NAME", "USER", "PROJECT", "QUEUE", "ST"]
    row = next(line for line in listing.stdout.splitlines() if line.startswith(job_id))
    assert row.split()[5] == "PD" and "h100-80g:4" in row

    shown = cli("show", job_id, "-o", "json")
    assert json.loads(shown.stdout)["state"] == "PENDING"

    cancelled = cli("cancel", job_id)
    assert cancelled.returncode == 0 and "CANCELLED" in cancelled.stdout
    assert "CA" in cli("jobs").stdout

    events = cli("events", job_id)
    assert "PENDING" in events.stdout and "CANCELLED" in events.stdout

    again = cli("cancel", job_id)
    assert again.returncode == 1 and "final state" in again.stderr


def test_errors_print_the_servers_message_and_fail(cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(SPEC.replace("h100:4", "h100:-1"))
    result = cli("submit", "-f", str(bad))
    assert result.returncode == 1
    assert "spec.resources.gpus" in result.stderr and "negative" in result.stderr
    missing = cli("show", "999999")
    assert missing.returncode == 1 and "404" in missing.stderr


def test_submit_from_stdin_and_dry_run(cli):
    dry = cli("submit", "--dry-run", "-f", "-", stdin=SPEC)
    assert dry.returncode == 0 and "would submit 1 job" in dry.stdout
    assert "PD" not in cli("jobs").stdout.splitlines()[-1]


def test_every_command_has_help():
    from portal.cli.commands import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    for name in commands:
        result = subprocess.run(
            [sys.executable, "-m", "portal.cli.commands", name, "--help"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 0 and "usage: orrery" in result.stdout, name


def test_unreachable_server_is_a_clear_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORRERY_")}
    env |= {
        "ORRERY_CONFIG": str(tmp_path / "none.yaml"),
        "ORRERY_SERVER": "http://127.0.0.1:9",
        "ORRERY_TOKEN": "x",
    }
    result = subprocess.run(
        [sys.executable, "-m", "portal.cli.commands", "jobs"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1 and "cannot reach" in result.stderr


def test_console_script_is_installed():
    script = os.path.join(os.path.dirname(sys.executable), "orrery")
    result = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.startswith("orrery ")


def test_tokens_lists_scopes_expiry_and_last_use(cli):
    listed = cli("tokens")
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split()[:5] == ["ID", "NAME", "PREFIX", "SCOPES", "EXPIRES"] and "LAST USED" in header
    assert "read,submit" in row and "never" not in row  # the login used it
    as_json = json.loads(cli("tokens", "-o", "json").stdout)
    assert as_json[0]["scopes"] == ["read", "submit"] and as_json[0]["expiresAt"]
