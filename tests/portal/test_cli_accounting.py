"""``orrery history`` and ``orrery usage``, run as real processes against a live server: a job
submitted and cancelled through the CLI shows up in the history it reads back, with filters,
columns and CSV."""

from __future__ import annotations

import csv
import io
import json
import subprocess
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from portal.services.tokens import issue_token
from scheduling.choices import AttemptState, JobState
from scheduling.models import JobAttempt
from scheduling.services.accounting import record_ends
from tests.factories import make_cluster, make_job, make_node, make_project, make_queue, make_user
from tests.portal.cli_runs import cli_env, run_cli

pytestmark = pytest.mark.django_db(transaction=True)

SPEC = """\
apiVersion: orrery/v1
kind: Job
metadata: {name: cli-sweep, project: vision}
spec:
  resources: {gpus: "h100:4", cpus: 8, memory: 64Gi}
  timeLimit: 30m
  run: python sweep.py
"""


@pytest.fixture
def cli(live_server, tmp_path):
    alice, bob = make_user("alice"), make_user("bob")
    queue = make_queue(make_project("vision", members=(alice, bob)))
    cluster = make_cluster("sim-a")
    make_node(cluster, gpus=8, model="h100")
    ended = timezone.now() - timedelta(hours=1)
    for owner, name, gpus, state in (
        (alice, "train", 2, JobState.SUCCEEDED),
        (alice, "broken", 1, JobState.FAILED),
        (bob, "eval", 4, JobState.SUCCEEDED),
    ):
        job = make_job(owner, queue, gpus=gpus, name=name, state=state, finished_at=ended, exit_code=0)
        job.started_at = ended - timedelta(hours=1)
        job.save(update_fields=["started_at"])
        JobAttempt.objects.create(
            job=job,
            number=1,
            cluster=cluster,
            state=AttemptState.SUCCEEDED,
            active=False,
            started_at=job.started_at,
            finished_at=ended,
            # an hour at 500 W per GPU, at 0.2 per kWh and 300 g of CO₂ per kWh
            energy_wh=500 * gpus,
            energy_cost=0.5 * gpus * 0.2,
            co2_g=0.5 * gpus * 300,
        )
        record_ends([job.pk], ended)
    _, token = issue_token(alice)
    env = cli_env(tmp_path)

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return run_cli(env, *args, stdin=stdin)

    assert run("login", "--server", live_server.url, "--token", token).returncode == 0
    return run


def test_history_reads_back_what_the_cli_did_with_filters_columns_and_csv(cli):
    submitted = cli("submit", "-f", "-", stdin=SPEC)
    job_id = submitted.stdout.split()[2]
    assert cli("cancel", job_id).returncode == 0

    table = cli("history")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["ID", "NAME", "USER", "PROJECT", "STATE", "ENDED", "ELAPSED", "GPUS",
                                "GPUHOURS", "EXITCODE", "CLUSTER"]  # fmt: skip
    assert [line.split()[1] for line in lines[1:]] == ["cli-sweep", "broken", "train"]  # newest, ties by id
    train = next(line.split() for line in lines if " train " in line)
    assert train[6:9] == ["1:00:00", "2", "2.0"]

    failed = cli("history", "-s", "F,CA", "--format", "JobID,JobName,State,ExitCode", "-o", "csv")
    assert failed.returncode == 0, failed.stderr
    rows = list(csv.reader(io.StringIO(failed.stdout)))
    assert rows == [["id", "name", "state", "exitCode"], [job_id, "cli-sweep", "CANCELLED", ""],
                    [rows[2][0], "broken", "FAILED", "0"]]  # fmt: skip

    everyone = json.loads(cli("history", "-u", "all", "-n", "2", "-o", "json").stdout)
    assert len(everyone) == 2 and {"id", "gpuHours", "cluster"} <= set(everyone[0])
    assert [r["name"] for r in json.loads(cli("history", "-u", "bob", "-o", "json").stdout)] == ["eval"]

    bad = cli("history", "-S", "last tuesday")
    assert bad.returncode == 1 and "query.since" in bad.stderr
    unknown = cli("history", "--format", "id,colour")
    assert unknown.returncode == 1 and "unknown column 'colour'" in unknown.stderr


def test_usage_by_project_and_user_as_a_table_and_csv(cli):
    table = cli("usage")
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[1].split() == ["PROJECT", "JOBS", "GPU-HOURS", "KWH", "COST", "CO2-KG"]
    assert table.stdout.splitlines()[2].split() == ["vision", "3", "7.00", "3.50", "0.70", "1.05"]
    assert table.stdout.splitlines()[-1].split() == ["TOTAL", "3", "7.00", "3.50", "0.70", "1.05"]

    per_user = cli("usage", "--by", "project,user", "-o", "csv")
    assert per_user.returncode == 0, per_user.stderr
    assert per_user.stdout.splitlines() == [
        "project,user,jobs,gpuHours,gpuSeconds,elapsedSeconds,energyKwh,energyCost,co2Kg",
        "vision,alice,2,3.0,10800,7200,1.5,0.3,0.45",  # a member sees only their own figures per user
    ]
    report = json.loads(cli("usage", "--by", "gpu-model,day", "-o", "json").stdout)
    ended = (datetime.now(UTC) - timedelta(hours=1)).date()  # the seeded jobs' day
    assert [(r["day"], r["jobs"]) for r in report["results"]] == [(ended.isoformat(), 3)]
    bad = cli("usage", "--by", "colour")
    assert bad.returncode == 1 and "query.by" in bad.stderr
