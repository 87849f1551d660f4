"""Onboarding a real Slurm cluster (scripts/slurm-dev-cluster.sh: slurmctld, four slurmd with
fake A100s, slurmrestd with JWT) and collecting its nodes through the heartbeat pipeline."""

from __future__ import annotations

import os
import subprocess
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from clusters.choices import ClusterKind, ClusterState, NodeState
from clusters.models import Cluster, ClusterSecret, GpuDevice, Node, NodeLastSeen
from clusters.services.aggregation import flush_heartbeats
from clusters.services.slurm import collect
from scheduling.models import Allocation
from tests.factories import ensure_catalog

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def slurm():
    """The dev cluster, started (or found running) once per test run; stopped at the end."""
    up = subprocess.run(
        [str(ROOT / "scripts/slurm-dev-cluster.sh"), "up"], capture_output=True, text=True, timeout=600
    )
    assert up.returncode == 0, up.stderr[-3000:]
    env = dict(line.removeprefix("export ").replace("'", "").split("=", 1) for line in up.stdout.splitlines())
    os.environ["SLURM_CONF"] = env["SLURM_CONF"]
    yield env
    subprocess.run([str(ROOT / "scripts/slurm-dev-cluster.sh"), "down"], capture_output=True, timeout=120)


def test_onboarding_tests_the_connection_and_reads_the_nodes(slurm, tmp_path):
    ensure_catalog()
    out = StringIO()
    call_command(
        "add_cluster",
        kind="slurm",
        name="hpc",
        url=slurm["ORRERY_SLURM_URL"],
        token_file=Path(slurm["ORRERY_SLURM_TOKEN_FILE"]),
        stdout=out,
    )
    assert "Cluster hpc (slurm, v0.0.38): 4 nodes, 16 GPUs." in out.getvalue()
    cluster = Cluster.objects.get(name="hpc")
    assert (cluster.kind, cluster.state) == (ClusterKind.SLURM, ClusterState.READY)
    assert "token" not in cluster.config and ClusterSecret.objects.get(cluster=cluster).data["token"]
    assert set(Node.objects.filter(cluster=cluster).values_list("name", flat=True)) == {
        "n1",
        "n2",
        "n3",
        "n4",
    }
    assert set(GpuDevice.objects.filter(node__cluster=cluster).values_list("model__slug", flat=True)) == {
        "a100-80g"
    }
    assert Node.objects.get(cluster=cluster, name="n1").labels["slurm.io/partitions"] == "gpu"
    flush_heartbeats()  # the collector reported the healthy nodes like any other heartbeat
    assert NodeLastSeen.objects.filter(node__cluster=cluster).count() == 4


@pytest.mark.parametrize(
    "url, token, words",
    [("http://127.0.0.1:9", "x", "cannot reach slurmrestd"), (None, "not-a-jwt", "could not use the token")],
    ids=["unreachable", "bad-token"],
)
def test_onboarding_says_what_is_wrong(slurm, tmp_path, url, token, words):
    token_file = tmp_path / "jwt"
    token_file.write_text(token)
    with pytest.raises(CommandError, match=words):
        call_command(
            "add_cluster",
            kind="slurm",
            name="bad",
            url=url or slurm["ORRERY_SLURM_URL"],
            token_file=token_file,
        )
    assert not Cluster.objects.filter(name="bad").exists()


def test_a_node_drained_in_slurm_is_drained_in_orrery(slurm):
    ensure_catalog()
    call_command(
        "add_cluster",
        kind="slurm",
        name="hpc",
        url=slurm["ORRERY_SLURM_URL"],
        token_file=Path(slurm["ORRERY_SLURM_TOKEN_FILE"]),
        stdout=StringIO(),
    )
    cluster = Cluster.objects.get(name="hpc")
    scontrol = ["scontrol", "update", "nodename=n3"]
    subprocess.run([*scontrol, "state=drain", "reason=disk"], check=True, timeout=30)
    try:
        collect(cluster)
        node = Node.objects.get(cluster=cluster, name="n3")
        assert (node.state, node.state_reason) == (NodeState.DRAINED, "slurm: disk")
    finally:
        subprocess.run([*scontrol, "state=resume"], check=True, timeout=30)
    collect(cluster)
    assert Node.objects.get(cluster=cluster, name="n3").state == NodeState.NOT_READY  # back to the lifecycle


def _wait(condition, what, timeout=60.0):
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def test_jobs_run_on_the_nodes_orrery_chose(slurm, alice, queue):
    from scheduling.cache import SchedulerCache
    from scheduling.choices import JobState
    from scheduling.cycle import run_cycle
    from scheduling.models import Job, JobAttempt
    from scheduling.services.jobs import cancel_job
    from scheduling.slurm import dispatch_slurm, sync_slurm
    from tests.factories import make_job

    ensure_catalog()
    call_command(
        "add_cluster",
        kind="slurm",
        name="hpc",
        url=slurm["ORRERY_SLURM_URL"],
        token_file=Path(slurm["ORRERY_SLURM_TOKEN_FILE"]),
        slurm_conf=slurm["SLURM_CONF"],
        stdout=StringIO(),
    )
    cluster = Cluster.objects.get(name="hpc")
    Node.objects.filter(cluster=cluster).update(state=NodeState.READY)
    ok = make_job(
        alice,
        queue,
        gpus=2,
        model="a100",
        placement={"clusters": ["hpc"]},
        command='echo "on $SLURMD_NODENAME gpus=$CUDA_VISIBLE_DEVICES job=$ORRERY_JOB_ID"',
    )
    failing = make_job(alice, queue, gpus=1, model="a100", placement={"clusters": ["hpc"]}, command="exit 3")
    sleeper = make_job(
        alice, queue, gpus=1, model="a100", placement={"clusters": ["hpc"]}, command="sleep 120"
    )
    assert run_cycle(SchedulerCache()).placed == 3
    assert dispatch_slurm() == 3
    assert dispatch_slurm() == 0  # idempotent

    def settled(job, *states):
        sync_slurm(cluster)
        return Job.objects.get(pk=job.pk).state in states

    _wait(lambda: settled(ok, JobState.SUCCEEDED, JobState.FAILED), "the job to finish")
    chosen = Allocation.objects.filter(job=ok, gpu__isnull=True).values_list("node__name", flat=True).get()
    from scheduling.agentwork import log_tail

    lines = _wait(lambda: log_tail(ok.pk, 10)[0], "its output")
    assert f"on {chosen} gpus=0,1 job={ok.pk}" in lines
    assert Job.objects.get(pk=ok.pk).state == JobState.SUCCEEDED
    _wait(lambda: settled(failing, JobState.FAILED), "exit 3")
    assert Job.objects.get(pk=failing.pk).exit_code == 3

    _wait(lambda: settled(sleeper, JobState.RUNNING), "the sleeper to run")
    remote = JobAttempt.objects.get(job=sleeper).remote_id
    cancel_job(Job.objects.get(pk=sleeper.pk), actor=alice)
    sync_slurm(cluster)  # Orrery no longer runs it: cancelled in Slurm too
    state = subprocess.run(["squeue", "-h", "-j", remote, "-o", "%T"], capture_output=True, text=True).stdout
    assert state.strip() in ("", "CANCELLED", "COMPLETING")
