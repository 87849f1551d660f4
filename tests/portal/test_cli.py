"""The ``orrery`` CLI, run as a real process against a live server (real HTTP, real port)."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading

import pytest
from django.contrib.auth import get_user_model

from clusters.adapters.base import LogChunk
from scheduling.models import Queue
from tests.factories import make_job
from tests.portal.cli_runs import alice_world, cli_env, run_cli

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
    _, token = alice_world()
    env = cli_env(tmp_path)

    def run(*args: str, stdin: str | None = None, **more_env: str) -> subprocess.CompletedProcess:
        return run_cli(env | more_env, *args, stdin=stdin)

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
    assert "CA" in cli("jobs", "--all").stdout

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


def test_submitting_says_no_none(cli):
    submitted = cli("submit", "-f", "-", stdin=SPEC)
    assert submitted.returncode == 0, submitted.stderr
    assert submitted.stdout.rstrip().endswith("— PENDING") and "None" not in submitted.stdout
    job_id = submitted.stdout.split()[2]
    shown = cli("show", job_id)
    assert "None" not in shown.stdout and "Reason:" not in shown.stdout
    row = next(line for line in cli("jobs").stdout.splitlines() if line.startswith(job_id))
    assert "None" not in row


@pytest.mark.parametrize(
    ("args", "listed"),
    [
        ((), {"PD", "R"}),
        (("--all",), {"PD", "R", "CD", "F", "CA"}),
        (("--state", "all"), {"PD", "R", "CD", "F", "CA"}),
        (("-t", "CD,F"), {"CD", "F"}),
    ],
    ids=["unfinished-by-default", "all", "state-all", "chosen-states"],
)
def test_jobs_lists_unfinished_jobs_unless_told(cli, args, listed):
    alice, queue = _alices_queue()
    for state in ("PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"):
        make_job(alice, queue, state=state)
    rows = cli("jobs", *args).stdout.splitlines()[1:]
    assert {row.split()[5] for row in rows} == listed


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


# --- predicted starts, preemption, checkpoints -------------------------------------------------

LOCAL = "Asia/Kolkata"  # UTC+05:30, so a time shown in UTC would not pass for local time


def _alices_queue() -> tuple[object, Queue]:
    return get_user_model().objects.get(username="alice"), Queue.objects.get(project__name="vision")


def _local(when) -> str:
    from zoneinfo import ZoneInfo

    return when.astimezone(ZoneInfo(LOCAL)).strftime("%Y-%m-%dT%H:%M:%S")


def test_jobs_start_lists_pending_jobs_by_expected_start(cli):
    from datetime import timedelta

    from django.utils import timezone

    from scheduling.choices import JobState, PendingReason

    alice, queue = _alices_queue()
    now = timezone.now()
    later = make_job(
        alice, queue, name="later", estimated_start_at=now + timedelta(hours=2), estimated_where="sim-a"
    )
    soon = make_job(
        alice,
        queue,
        name="soon",
        estimated_start_at=now + timedelta(minutes=20),
        estimated_where="sim-a:a-n001",
        reserved=True,
        reason="Resources",
    )
    unknown = make_job(alice, queue, name="unknown", reason=PendingReason.PREEMPTED)
    make_job(alice, queue, name="running", state=JobState.RUNNING)

    result = cli("jobs", "--start", TZ=LOCAL)
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["JOBID", "NAME", "ST", "START_TIME", "WHERE", "RESERVED", "REASON"]
    assert [row.split()[:3] for row in rows] == [
        [str(soon.pk), "soon", "PD"],
        [str(later.pk), "later", "PD"],
        [str(unknown.pk), "unknown", "PD"],
    ]
    assert rows[0].split()[3:] == [_local(soon.estimated_start_at), "sim-a:a-n001", "yes", "(Resources)"]
    assert rows[1].split()[3:] == [_local(later.estimated_start_at), "sim-a", "no"]  # no reason yet: blank
    assert rows[2].split()[3:] == ["N/A", "N/A", "no", "(Preempted)"]

    as_json = json.loads(cli("jobs", "--start", "-o", "json").stdout)
    assert [j["id"] for j in as_json] == [soon.pk, later.pk, unknown.pk]
    assert as_json[0]["estimatedStart"]["reserved"] is True


def test_jobs_start_reads_every_page_before_sorting(cli):
    from datetime import timedelta

    from django.utils import timezone

    alice, queue = _alices_queue()
    now = timezone.now()
    # The oldest job starts first: on the last page of the newest-first list.
    first = make_job(alice, queue, name="first", estimated_start_at=now + timedelta(minutes=1))
    for i in range(1005):
        make_job(alice, queue, name=f"sweep-{i}", estimated_start_at=now + timedelta(hours=1, seconds=i))
    rows = cli("jobs", "--start", "-n", "3").stdout.splitlines()[1:]
    assert len(rows) == 3 and rows[0].split()[:2] == [str(first.pk), "first"]


def test_show_gives_the_estimate_the_preference_and_why_it_was_preempted(cli):
    from datetime import timedelta

    from django.utils import timezone

    from scheduling.models import Job

    alice, queue = _alices_queue()
    at = timezone.now() + timedelta(minutes=30)
    job = make_job(
        alice,
        queue,
        gpus=2,
        reason="Preempted",
        reason_message="preempted by job 42 (priority 100 over 0); requeued",
        estimated_start_at=at,
        estimated_where="sim-a: a-n001",
        reserved=True,
        preemptible=True,
    )
    Job.objects.filter(pk=job.pk).update(gpu_model=None, placement={"gpuModels": ["h100-80g", "a100-80g"]})
    shown = cli("job", str(job.pk), TZ=LOCAL)  # `job` is `show`
    assert shown.returncode == 0, shown.stderr
    lines = {
        line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in shown.stdout.splitlines()
    }
    assert lines["Reason"] == "Preempted"
    assert lines["Why"] == "preempted by job 42 (priority 100 over 0); requeued"
    assert lines["StartTime"] == f"≈ {_local(at)} on sim-a: a-n001 (reserved)"
    assert (lines["Gpus"], lines["GpuModels"], lines["Preemptible"]) == (
        "h100-80g|a100-80g:2",
        "h100-80g,a100-80g",
        "yes",
    )
    listing = cli("jobs").stdout
    assert "h100-80g|a100-80g:2" in listing and "(Preempted)" in listing


def test_checkpoint_stamps_a_running_job(cli):
    from clusters.models import Node
    from scheduling.choices import JobState
    from scheduling.models import Job
    from scheduling.services.allocations import NodePlacement, bind_job
    from scheduling.services.transitions import transition_job

    alice, queue = _alices_queue()
    job = make_job(alice, queue, gpus=8)
    bind_job(job, [NodePlacement(Node.objects.get(), range(8))])
    transition_job(job.pk, JobState.RUNNING)
    done = cli("checkpoint", str(job.pk))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"job {job.pk}: checkpoint recorded at ")
    first = Job.objects.get(pk=job.pk).checkpointed_at
    assert first is not None
    # Inside the job, without an id: ORRERY_JOB_ID says which.
    inside = cli("checkpoint", ORRERY_JOB_ID=str(job.pk))
    assert inside.returncode == 0, inside.stderr
    assert Job.objects.get(pk=job.pk).checkpointed_at > first

    waiting = make_job(alice, queue)
    refused = cli("checkpoint", str(waiting.pk))
    assert refused.returncode == 1 and "409" in refused.stderr and "PENDING" in refused.stderr
    assert Job.objects.get(pk=waiting.pk).checkpointed_at is None
    nothing = cli("checkpoint")
    assert nothing.returncode == 2 and "ORRERY_JOB_ID" in nothing.stderr


# --- the token stays with its server --------------------------------------------------------------


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers a GET as the test's routes say and records what each request carried."""

    def do_GET(self) -> None:
        self.server.seen.append((self.headers["Host"], self.path, self.headers["Authorization"]))
        if self.server.busy.get(self.path):
            status, retry_after = self.server.busy[self.path].pop(0)
            body = json.dumps({"detail": "busy", "errors": []}).encode()
            self.send_response(status)
            self.send_header("Retry-After", retry_after)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        location = self.server.redirects.get(self.path)
        if location:
            self.send_response(self.server.code)
            self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = json.dumps({"id": 1, "name": "x"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_servers():
    """Two real HTTP servers on two ports of this machine, sharing one record of requests."""
    seen: list[tuple[str, str, str | None]] = []
    servers = []
    for _ in range(2):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
        server.seen, server.redirects, server.code, server.busy = seen, {}, 302, {}
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    yield servers
    for server in servers:
        server.shutdown()
        server.server_close()


def _orrery(server: str, *args: str, tmp_path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORRERY_")}
    env |= {"ORRERY_CONFIG": str(tmp_path / "none.yaml"), "ORRERY_SERVER": server, "ORRERY_TOKEN": "s3cret"}
    return subprocess.run(
        [sys.executable, "-m", "portal.cli.commands", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
@pytest.mark.parametrize(
    "target",
    [
        "http://127.0.0.1:{other}/api/v1/jobs/1",
        "http://localhost:{port}/moved",
        "https://127.0.0.1:{port}/moved",
    ],
    ids=["other-port", "other-host", "other-scheme"],
)
def test_a_redirect_to_another_server_is_refused_and_gets_no_token(http_servers, tmp_path, code, target):
    server, other = http_servers
    port, other_port = server.server_address[1], other.server_address[1]
    server.code = code
    server.redirects["/api/v1/jobs/1"] = target.format(port=port, other=other_port)
    result = _orrery(f"http://127.0.0.1:{port}", "show", "1", "-o", "json", tmp_path=tmp_path)
    assert result.returncode == 1
    assert "redirected to" in result.stderr and "not followed" in result.stderr, result.stderr
    # Only the first request was made: nothing at all (token or not) went to the other place.
    assert server.seen == [(f"127.0.0.1:{port}", "/api/v1/jobs/1", "Bearer s3cret")]


def test_a_redirect_within_the_server_is_followed_with_the_token(http_servers, tmp_path):
    server, _ = http_servers
    port = server.server_address[1]
    server.redirects["/api/v1/jobs/1"] = "/moved"
    result = _orrery(f"http://127.0.0.1:{port}", "show", "1", "-o", "json", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert server.seen[1] == (f"127.0.0.1:{port}", "/moved", "Bearer s3cret")


def test_busy_and_unavailable_answers_are_retried_after_the_time_the_server_says(http_servers, tmp_path):
    server, _ = http_servers
    port = server.server_address[1]
    server.busy["/api/v1/jobs/1"] = [(429, "0"), (503, "0")]
    result = _orrery(f"http://127.0.0.1:{port}", "show", "1", "-o", "json", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert len(server.seen) == 3


def test_a_long_retry_after_is_shown_not_waited_for(http_servers, tmp_path):
    server, _ = http_servers
    port = server.server_address[1]
    server.busy["/api/v1/jobs/1"] = [(429, "3600")]
    result = _orrery(f"http://127.0.0.1:{port}", "show", "1", "-o", "json", tmp_path=tmp_path)
    assert result.returncode == 1 and "busy" in result.stderr
    assert len(server.seen) == 1


# --- what a job wrote never drives the terminal -------------------------------------------------

ATTACK = "\x1b]0;pwned\x07\x1b[2J\x1bP+q\x1b\\\x9b31m\x9d8;;http://evil\x9cok\x1b[0m\x07\tdone\x01\x7f"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("\x1b]0;pwned\x07title", "title"),
        ("\x1b]0;pwned\x1b\\title", "title"),
        ("\x1b[2Jcleared", "cleared"),
        ("\x1b[?1049hswitched", "switched"),
        ("\x9b2Jcleared", "cleared"),
        ("\x9d0;pwned\x9ctitle", "title"),
        ("\x1bP+q544e\x1b\\asked", "asked"),
        ("\x1b_apc\x1b\\x", "x"),
        ("\x1b(Bcharset", "charset"),
        ("\x1b\x1b[2Jdouble", "double"),
        ("\x1b]0;never ended\nnext line", "\nnext line"),
        ("over\rwrite", "overwrite"),
        ("bell\x07 bs\x08 del\x7f nel\x85", "bell bs del nel"),
        ("tab\tand\nnewline", "tab\tand\nnewline"),
        ("épοch ✓ 100%", "épοch ✓ 100%"),
    ],
    ids=[
        "osc-bel",
        "osc-st",
        "csi",
        "csi-private",
        "c1-csi",
        "c1-osc",
        "dcs",
        "apc",
        "charset",
        "esc-esc",
        "unterminated",
        "cr",
        "c0-c1",
        "kept",
        "unicode",
    ],
)
def test_inert_removes_every_control_sequence(text, shown):
    from portal.cli.render import inert

    assert inert(text) == shown


def _escape_laden_job():
    from clusters.models import Cluster
    from scheduling.choices import EventKind
    from scheduling.models import JobAttempt, JobEvent
    from scheduling.services.logs import store_log

    alice = get_user_model().objects.get(username="alice")
    job = make_job(alice, Queue.objects.get(project__name="vision"))
    attempt = JobAttempt.objects.create(job=job, number=1, cluster=Cluster.objects.get(name="sim-a"))
    store_log(LogChunk(str(attempt.pk), "a-n001", 0, f"epoch 1 {ATTACK}\nepoch 2\n"))
    JobEvent.objects.create(job=job, kind=EventKind.NOTE, reason="note", message=f"hello {ATTACK}")
    return job


def _controls(text: str) -> set[str]:
    return {c for c in text if (ord(c) < 0x20 and c not in "\n\t") or 0x7F <= ord(c) <= 0x9F}


def test_logs_and_events_print_no_terminal_control_sequences(cli):
    job = _escape_laden_job()
    logs = cli("logs", str(job.pk))
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout == "epoch 1 ok\tdone\nepoch 2\n"
    events = cli("events", str(job.pk))
    assert events.returncode == 0, events.stderr
    assert "hello ok\tdone" in events.stdout
    assert _controls(logs.stdout + events.stdout) == set()


def test_raw_prints_them_as_written(cli):
    job = _escape_laden_job()
    assert f"epoch 1 {ATTACK}" in cli("logs", str(job.pk), "--raw").stdout
    assert "\x1b]0;pwned\x07" in cli("events", str(job.pk), "--raw").stdout
