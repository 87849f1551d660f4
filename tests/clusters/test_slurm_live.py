"""A real Slurm cluster under Orrery (scripts/slurm-dev-cluster.sh: slurmctld, four slurmd with
fake A100s, slurmrestd with JWT): onboarding from the command line, the API and the console;
inventory through the heartbeat pipeline; jobs submitted through Orrery's API running where
Orrery chose; exit codes, cancel, time limits and holds; a killed slurmd; slurmrestd stopped."""

from __future__ import annotations

import json
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db.models import F
from django.test import TestCase
from django.utils import timezone

from clusters.adapters.slurm.adapter import SlurmAdapter, submitted
from clusters.adapters.slurm.inventory import collect
from clusters.choices import ClusterKind, ClusterState, NodeState
from clusters.models import Cluster, ClusterSecret, GpuDevice, Node, NodeLastSeen, PosixAccount
from clusters.services.aggregation import flush_heartbeats
from clusters.services.inventory import take_inventories
from clusters.services.lifecycle import run_node_lifecycle
from clusters.services.onboarding import onboard_slurm
from scheduling.choices import JobState
from scheduling.dispatch.outbox import drain_outbox
from scheduling.dispatch.sync import sync_cluster
from scheduling.dispatch.works import load_works
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import run_cycle
from scheduling.models import Allocation, DispatchOutbox, Job, JobAttempt
from tests.factories import ensure_catalog
from tests.processes import scancel_tagged, squeue, wait

pytestmark = pytest.mark.django_db


def test_onboarding_tests_the_connection_and_reads_the_nodes(slurm, tmp_path):
    ensure_catalog()
    out = StringIO()
    with TestCase.captureOnCommitCallbacks(execute=True):  # the collector's heartbeats, after commit
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
    [("http://127.0.0.1:9", "x", "no slurmrestd accepted"), (None, "not-a-jwt", "could not use the token")],
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
    cluster = _onboard(slurm)
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


def test_power_saving_asks_slurm_or_says_why_it_cannot(slurm, operator, settings):
    """The dev cluster's slurmrestd serves v0.0.36–v0.0.38, which cannot update nodes: the action
    is refused in those words and the node is given back, untouched in Slurm. A slurmrestd of
    23.02 or later takes the request (or Slurm refuses it without a SuspendProgram, and says so)."""
    from clusters.adapters.slurm.api import NODE_UPDATE_VERSIONS
    from clusters.adapters.slurm.inventory import client_for
    from clusters.services.power import power_down_nodes

    settings.ORRERY_POWER_IDLE_S, settings.ORRERY_POWER_KEEP_IDLE = 0, 0
    cluster = _onboard(slurm)
    Cluster.objects.filter(pk=cluster.pk).update(power_saving=True)
    n4 = Node.objects.get(cluster=cluster, name="n4")
    updates = client_for(cluster)._served(NODE_UPDATE_VERSIONS)
    try:
        result = power_down_nodes(cluster, [n4.pk], actor=operator)
    finally:
        if updates:
            subprocess.run(["scontrol", "update", "nodename=n4", "state=power_up"], timeout=30)
    n4.refresh_from_db()
    sinfo = subprocess.run(
        ["sinfo", "-h", "-n", "n4", "-o", "%T"], capture_output=True, text=True, timeout=30
    )
    if result.done:
        assert updates and (n4.state, n4.power_state) == (NodeState.DRAINED, "suspended")
        assert "power" in sinfo.stdout.lower(), sinfo.stdout
        return
    assert len(result.refused) == 1
    if not updates:
        assert "power saving needs API v0.0.39 or later" in result.refused[0]
    assert (n4.state, n4.power_state) == (NodeState.READY, "on")  # given back
    assert sinfo.stdout.strip() == "idle", sinfo.stdout
    assert list(n4.events.values_list("to_state", flat=True)) == [NodeState.DRAINED, NodeState.READY]


def slurm_job(name: str, run: str, gpus: str = "a100:1", **spec) -> dict:
    """A job spec for the dev Slurm cluster ``hpc``, in alice's project."""
    return {
        "apiVersion": "orrery/v1",
        "kind": "Job",
        "metadata": {"name": name, "project": "vision"},
        "spec": {"resources": {"gpus": gpus}, "run": run, "placement": {"clusters": ["hpc"]}, **spec},
    }


def _onboard(slurm, **options) -> Cluster:
    """Cluster "hpc" on the dev Slurm, through ``add_cluster`` (``options`` are its own)."""
    ensure_catalog()
    call_command(
        "add_cluster",
        kind="slurm",
        name="hpc",
        url=slurm["ORRERY_SLURM_URL"],
        token_file=Path(slurm["ORRERY_SLURM_TOKEN_FILE"]),
        slurm_conf=slurm["SLURM_CONF"],
        stdout=StringIO(),
        **options,
    )
    cluster = Cluster.objects.get(name="hpc")
    Node.objects.filter(cluster=cluster).update(state=NodeState.READY)
    return cluster


@pytest.fixture
def hpc(slurm, alice, unix_users) -> Iterator[Cluster]:
    """The dev Slurm cluster onboarded as ``hpc``, where alice's work runs as ``orrt-alice``; its
    jobs left in Slurm are cancelled afterwards."""
    cluster = _onboard(slurm)
    PosixAccount.objects.create(cluster=cluster, user=alice, username="orrt-alice")
    yield cluster
    scancel_tagged(cluster.config["tag"])


def test_operators_onboard_through_the_api(slurm, api, alice, operator, tmp_path):
    ensure_catalog()
    token = Path(slurm["ORRERY_SLURM_TOKEN_FILE"]).read_text().strip()
    body = {"name": "hpc", "kind": "slurm", "url": slurm["ORRERY_SLURM_URL"], "token": token}
    assert api(alice).post("/api/v1/clusters", body, format="json").status_code == 403
    ops = api(operator)
    bad = [
        ({**body, "token": "not-a-jwt"}, "token", "could not use the token"),
        ({**body, "url": "http://127.0.0.1:9"}, "url", "no slurmrestd accepted"),
        ({**body, "url": "not a url", "kind": "pbs"}, "url", "valid URL"),
        ({k: v for k, v in body.items() if k != "token"}, "token", "required"),
        ({**body, "identity": "everyone"}, "identity", "not a valid choice"),
        ({**body, "outputDir": "scratch/{uid}"}, "outputDir", "absolute path"),
    ]
    for wrong, path, words in bad:
        answer = ops.post("/api/v1/clusters", wrong, format="json")
        assert answer.status_code == 400, answer.content
        errors = {e["path"]: e["message"] for e in answer.json()["errors"]}
        assert words in errors[path], errors
    assert not Cluster.objects.filter(name="hpc").exists()
    created = ops.post("/api/v1/clusters", body | {"identity": "same_name"}, format="json")
    assert created.status_code == 201, created.content
    assert Cluster.objects.get(name="hpc").identity == "same_name"
    assert created.json()["kind"] == "slurm" and token not in created.content.decode()
    shown = ops.get("/api/v1/clusters/hpc").json()
    assert shown["nodes"]["total"] == 4 and "config" not in shown and token not in str(shown)


def test_the_console_onboards_with_a_connection_test(slurm, client, operator):
    ensure_catalog()
    client.force_login(operator)
    url = "/admin/clusters/cluster/onboard-slurm/"
    assert "Add a Slurm cluster" in client.get("/admin/clusters/cluster/").content.decode()
    form = {"name": "hpc", "url": slurm["ORRERY_SLURM_URL"], "token": "not-a-jwt", "user": "root"}
    refused = client.post(url, form)
    assert refused.status_code == 200 and "could not use the token" in refused.content.decode()
    assert not Cluster.objects.filter(name="hpc").exists()
    form["token"] = Path(slurm["ORRERY_SLURM_TOKEN_FILE"]).read_text().strip()
    added = client.post(url, form | {"identity": "shared"}, follow=True)
    assert "4 nodes, 16 GPUs" in added.content.decode()
    assert Cluster.objects.get(name="hpc").identity == "shared"
    assert form["token"] not in added.content.decode()  # never shown back
    tested = client.post(
        "/admin/clusters/cluster/",
        {"action": "test_connection", "_selected_action": [Cluster.objects.get(name="hpc").pk]},
        follow=True,
    )
    assert "slurmrestd answers (v0.0.38)" in tested.content.decode()


def test_slurm_rings_orrery_when_its_job_ends_and_not_for_anyone_elses(
    hpc, slurm, api, alice, queue, catcher, client, settings, monkeypatch
):
    """The dev Slurm runs ``orrery-epilog`` as its ``EpilogSlurmctld``: once told where, the end
    of a job Orrery submitted rings ``agent/ended`` with the cluster's credential, and that ring,
    answered by Orrery, syncs the cluster at once; a job submitted to Slurm by someone else rings
    nothing."""
    from clusters.services.credentials import issue_cluster_credential
    from scheduling import wakeup
    from scheduling.tasks import sync_cluster_task
    from scheduling.wakeup import ring_sync

    server, caught = catcher
    conf = Path(slurm["SLURM_CONF"]).parent / "orrery-epilog.conf"
    secret = conf.parent / "orrery-hpc.credential"
    _, credential = issue_cluster_credential(hpc, name="epilog")
    secret.write_text(credential)
    secret.chmod(0o600)
    conf.write_text(f"url=http://127.0.0.1:{server.server_port}\ncluster=hpc\ncredential_file={secret}\n")
    try:
        foreign = subprocess.run(
            ["sbatch", "--parsable", "--output=/dev/null", "--comment=mine", "--wrap", "true"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
        answer = api(alice).post("/api/v1/jobs", slurm_job("quick", "true"), format="json")
        assert answer.status_code == 201, answer.content
        assert run_cycle(SchedulerCache()).placed == 1 and drain_outbox() == 1
        remote = JobAttempt.objects.get(job_id=answer.json()["id"]).remote_id
        rung = wait(
            lambda: [c for c in caught if json.loads(c[2]).get("job") == remote], "its ring", timeout=60
        )
        wait(lambda: squeue(foreign) in ("", "COMPLETED"), "the other job's end", timeout=60)
    finally:
        conf.unlink(missing_ok=True)
        secret.unlink(missing_ok=True)
    assert not [c for c in caught if json.loads(c[2]).get("job") == foreign]  # not Orrery's: no ring
    path, headers, body = rung[0]
    assert len(rung) == 1 and path == "/api/v1/agent/ended"
    assert json.loads(body) == {"cluster": "hpc", "job": remote}
    settings.REDIS_URL = "redis://wake-ups-only"  # wake-ups are a Celery feature
    sent = []
    monkeypatch.setattr(
        wakeup, "_send", lambda task, **o: sent.append((task, o.get("args"), o.get("kwargs")))
    )
    from django.core.cache import cache

    cache.clear()
    answered = client.post(
        path, body, content_type="application/json", HTTP_AUTHORIZATION=headers["Authorization"]
    )
    assert answered.status_code == 202, answered.content
    assert sent == [(wakeup.SYNC_TASK, [hpc.pk], {"rung": True})]
    assert wakeup.rung_jobs(hpc.pk) == {remote}
    ring_sync(hpc.pk, remote)  # as it was
    wait(lambda: squeue(remote) in ("", "COMPLETED"), "Slurm to finish completing it", timeout=60)
    sync_cluster_task(*sent[0][1], **sent[0][2])  # reads back that one job (squeue -j), no other
    assert Job.objects.get(pk=answer.json()["id"]).state == JobState.SUCCEEDED
    assert not SlurmAdapter().read_back(hpc, []).states
    gone = load_works(JobAttempt.objects.filter(job_id=answer.json()["id"]))
    assert SlurmAdapter().read_back(hpc, [replace(gone[0], remote_id="987654321")]).states == []


def test_jobs_submitted_through_the_api_run_where_orrery_chose(hpc, api, alice, queue):
    cluster = hpc
    as_alice = api(alice)

    def submit(name: str, run: str, gpus: str = "a100:1", **spec) -> int:
        answer = as_alice.post("/api/v1/jobs", slurm_job(name, run, gpus, **spec), format="json")
        assert answer.status_code == 201, answer.content
        return answer.json()["id"]

    ok = submit("ok", 'echo "on $SLURMD_NODENAME gpus=$CUDA_VISIBLE_DEVICES job=$ORRERY_JOB_ID"', "a100:2")
    failing = submit("failing", "exit 3")
    sleeper = submit("sleeper", "sleep 120")
    late = submit("late", "sleep 120", timeLimit="0:04")
    assert run_cycle(SchedulerCache()).placed == 4
    assert drain_outbox() == 4
    assert drain_outbox() == 0  # idempotent

    def state(job_id: int, *states: str) -> dict | None:
        sync_cluster(cluster)
        job = as_alice.get(f"/api/v1/jobs/{job_id}").json()
        return job if job["state"] in states else None

    done = wait(lambda: state(ok, "SUCCEEDED", "FAILED"), "the job to finish", timeout=60)
    assert done["state"] == "SUCCEEDED"
    chosen = done["placement"]["nodes"][0]["node"]
    assert chosen == Allocation.objects.filter(job_id=ok, gpu__isnull=True).get().node.name
    lines = wait(lambda: as_alice.get(f"/api/v1/jobs/{ok}/logs").json()["lines"], "its output", timeout=60)
    assert f"on {chosen} gpus=0,1 job={ok}" in lines
    failed = wait(lambda: state(failing, "FAILED"), "exit 3", timeout=60)
    assert failed["exitCode"] == 3

    wait(lambda: state(sleeper, "RUNNING"), "the sleeper to run", timeout=60)
    remote = JobAttempt.objects.get(job_id=sleeper).remote_id
    assert as_alice.post(f"/api/v1/jobs/{sleeper}/cancel").json()["state"] == "CANCELLED"
    sync_cluster(cluster)  # Orrery no longer runs it: cancelled in Slurm too
    assert squeue(remote) in ("", "CANCELLED", "COMPLETING")

    timed_out = wait(lambda: state(late, "TIMEOUT"), "the time limit", timeout=30)
    assert "time limit of 4s" in Job.objects.get(pk=late).events.order_by("-id").first().message
    assert squeue(JobAttempt.objects.get(job_id=late).remote_id) in ("", "CANCELLED", "COMPLETING")
    assert timed_out["exitCode"] is None


def test_a_gang_runs_once_on_each_node_with_one_launch_environment(hpc, api, alice, queue):
    as_alice = api(alice)
    run = (
        'echo "launch $SLURMD_NODENAME $MASTER_ADDR:$MASTER_PORT node=$NODE_RANK rank=$RANK '
        'world=$WORLD_SIZE local=$LOCAL_WORLD_SIZE nodes=$NNODES head=$ORRERY_HEAD_ADDR"'
    )
    body = slurm_job("gang", run, "a100:2", env={"MASTER_PORT": "1"})
    body["spec"]["resources"]["nodes"] = 2
    answer = as_alice.post("/api/v1/jobs", body, format="json")
    assert answer.status_code == 201, answer.content
    job = answer.json()["id"]
    assert run_cycle(SchedulerCache()).placed == 1
    assert drain_outbox() == 1
    port = JobAttempt.objects.get(job_id=job).master_port
    assert port == 29500

    def ended() -> dict | None:
        sync_cluster(hpc)
        found = as_alice.get(f"/api/v1/jobs/{job}").json()
        return found if found["state"] in ("SUCCEEDED", "FAILED") else None

    assert wait(ended, "the gang to finish", timeout=60)["state"] == "SUCCEEDED"
    lines = wait(
        lambda: [x for x in as_alice.get(f"/api/v1/jobs/{job}/logs").json()["lines"] if "launch " in x],
        "its output",
        timeout=60,
    )
    seen = sorted(x.split("launch ", 1)[1] for x in lines)
    nodes = sorted(
        Allocation.objects.filter(job_id=job, gpu__isnull=True).values_list("node__name", flat=True)
    )
    head = nodes[0]  # Slurm's first node of the allocation (n1 < n2 < n3 < n4 in slurm.conf)
    assert seen == [
        f"{nodes[0]} {head}:{port} node=0 rank=0 world=4 local=2 nodes=2 head={head}",
        f"{nodes[1]} {head}:{port} node=1 rank=2 world=4 local=2 nodes=2 head={head}",
    ]


def test_holds_in_orrery_and_in_slurm(hpc, api, alice, queue):
    cluster = hpc
    as_alice = api(alice)
    # Someone else's job fills n1 in Slurm, so the job Orrery places there waits in Slurm.
    blocker = subprocess.run(
        ["sbatch", "--parsable", "-w", "n1", "--gres=gpu:a100:4", "-o", "/dev/null", "--wrap", "sleep 300"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        body = slurm_job("waits", "echo ran", "a100:4")
        Node.objects.filter(cluster=cluster).exclude(name="n1").update(state=NodeState.CORDONED)
        answer = as_alice.post("/api/v1/jobs", body, format="json")
        assert answer.status_code == 201, answer.content
        waits = answer.json()["id"]
        held = as_alice.post(
            "/api/v1/jobs", body | {"metadata": {"name": "held", "project": "vision"}}, format="json"
        )
        assert run_cycle(SchedulerCache()).placed == 1 and drain_outbox() == 1
        remote = JobAttempt.objects.get(job_id=waits).remote_id
        wait(lambda: squeue(remote, "%r") == "Resources", "Slurm to keep it pending", timeout=60)
        sync_cluster(cluster)
        assert Job.objects.get(pk=waits).reason_message == "pending in Slurm: waiting for resources in Slurm"

        subprocess.run(["scontrol", "hold", remote], check=True, timeout=30)
        sync_cluster(cluster)
        assert "held by a Slurm administrator" in Job.objects.get(pk=waits).reason_message
        subprocess.run(["scontrol", "release", remote], check=True, timeout=30)
        sync_cluster(cluster)
        assert Job.objects.get(pk=waits).state == JobState.SCHEDULED

        # A hold in Orrery on a job placed but not running gives the placement back, and the
        # Slurm job is withdrawn.
        assert as_alice.post(f"/api/v1/jobs/{waits}/hold").json()["state"] == "HELD"
        assert not Allocation.objects.filter(job_id=waits, active=True).exists()
        sync_cluster(cluster)
        wait(lambda: squeue(remote) in ("", "CANCELLED"), "the Slurm job to be withdrawn", timeout=60)
        assert held.status_code == 201
    finally:
        subprocess.run(["scancel", blocker], timeout=30)
        Node.objects.filter(cluster=cluster).update(state=NodeState.READY)


def test_a_killed_slurmd_takes_its_node_down_then_it_returns(slurm):
    cluster = _onboard(slurm)
    pidfile = Path(slurm["SLURM_CONF"]).parents[1] / "run/slurmd-n4.pid"
    subprocess.run(["kill", "-TERM", pidfile.read_text().strip()], check=True)
    try:
        node = wait(
            lambda: collect(cluster) and Node.objects.get(cluster=cluster, name="n4").state == NodeState.DOWN,
            "Slurm to call n4 down (SlurmdTimeout=20 s)",
            timeout=90,
        )
        assert node
        assert Node.objects.get(cluster=cluster, name="n4").state_reason.startswith("slurm: ")
        assert Node.objects.filter(cluster=cluster, state=NodeState.READY).count() == 3
    finally:
        subprocess.run([slurm["script"], "up"], capture_output=True, check=True, timeout=120)
    wait(
        lambda: collect(cluster) and Node.objects.get(cluster=cluster, name="n4").state != NodeState.DOWN,
        "n4 to come back",
        timeout=60,
    )
    assert Node.objects.get(cluster=cluster, name="n4").state_reason == "slurm: back in service"


def test_slurmrestd_stopped_makes_the_cluster_unreachable_then_it_recovers(slurm, hpc, alice, queue):
    from tests.factories import make_job

    cluster = hpc
    with TestCase.captureOnCommitCallbacks(execute=True):
        take_inventories(paced=False)
    flush_heartbeats()
    running = make_job(
        alice, queue, gpus=1, model="a100", placement={"clusters": ["hpc"]}, command="sleep 120"
    )
    assert run_cycle(SchedulerCache()).placed == 1 and drain_outbox() == 1
    wait(
        lambda: sync_cluster(cluster) and Job.objects.get(pk=running.pk).state == JobState.RUNNING,
        "it to run",
        timeout=60,
    )

    pidfile = Path(slurm["SLURM_CONF"]).parents[1] / "run/slurmrestd.pid"
    subprocess.run(["kill", "-TERM", pidfile.read_text().strip()], check=True)
    try:
        wait(lambda: take_inventories(paced=False) == 0, "slurmrestd to stop answering", timeout=10)
        later = timezone.now() + timedelta(seconds=41)  # past NODE_GRACE with no word from Slurm
        run_node_lifecycle(now=later)
        cluster.refresh_from_db()
        assert (cluster.state, cluster.state_reason) == (ClusterState.UNREACHABLE, "4/4 nodes silent")
        waiting = make_job(
            alice, queue, gpus=1, model="a100", placement={"clusters": ["hpc"]}, command="true"
        )
        assert run_cycle(SchedulerCache()).placed == 0  # no new placements there
        assert Job.objects.get(pk=running.pk).state == JobState.RUNNING  # running work is left alone
    finally:
        subprocess.run([slurm["script"], "up"], capture_output=True, check=True, timeout=120)
    with TestCase.captureOnCommitCallbacks(execute=True):  # the collector's heartbeats, after commit
        assert take_inventories(paced=False) == 1
    flush_heartbeats()
    # NODE_RECOVERY of good reports, up to now
    NodeLastSeen.objects.filter(node__cluster=cluster).update(good_since=F("seen_at") - timedelta(seconds=31))
    run_node_lifecycle()
    cluster.refresh_from_db()
    assert cluster.state == ClusterState.READY
    sync_cluster(cluster)
    assert Job.objects.get(pk=running.pk).state == JobState.RUNNING
    assert run_cycle(SchedulerCache()).placed == 1  # placements resume
    assert Job.objects.get(pk=waiting.pk).state == JobState.SCHEDULED
    subprocess.run(["scancel", JobAttempt.objects.get(job=running).remote_id], timeout=30)


def _run_to_the_end(cluster: Cluster, as_alice, body: dict) -> tuple[int, str]:
    """Submit ``body`` through the API, place and dispatch it, follow it to its end; returns the
    job id and the output Orrery copied back."""
    answer = as_alice.post("/api/v1/jobs", body, format="json")
    assert answer.status_code == 201, answer.content
    job = answer.json()["id"]
    assert run_cycle(SchedulerCache()).placed == 1 and drain_outbox() == 1

    def finished() -> bool:
        sync_cluster(cluster)
        return Job.objects.get(pk=job).state in (JobState.SUCCEEDED, JobState.FAILED)

    wait(finished, "the job to finish", timeout=60)
    lines = wait(lambda: as_alice.get(f"/api/v1/jobs/{job}/logs").json()["lines"], "its output", timeout=30)
    return job, "\n".join(lines)


def test_a_slurm_job_sees_nothing_of_the_control_plane(hpc, api, alice, queue, unix_users, monkeypatch):
    """The control plane's environment holds its secrets; a job printing its whole environment
    must find none of them, runs as its owner's account, and values it was given cannot add
    variables or run commands."""
    home = Path(unix_users["alice"].pw_dir)
    monkeypatch.setenv("ORRERY_CANARY_SECRET", "canary-7f3a9")
    monkeypatch.setenv("DATABASE_URL", "postgres://orrery:canary-7f3a9@db/orrery")
    hostile = {
        "GREETING": "a,ORRERY_INJECTED=1",  # a comma once split --export into two variables
        "QUOTE": "it's $(id)",
        "RUN": f"$(touch {home}/pwned)`touch {home}/pwned2`",
        "LINES": "one\nORRERY_NEWLINE=1",
    }
    script = (
        'echo "whoami=$(id -un)"; env; echo "injected=${ORRERY_INJECTED-none},${ORRERY_NEWLINE-none}"; '
        'echo "lines=$(printf \'%s\\n\' "$LINES" | wc -l)"; echo done'
    )
    job, text = _run_to_the_end(hpc, api(alice), slurm_job("nosy", script, env=hostile))
    assert "done" in text and Job.objects.get(pk=job).state == JobState.SUCCEEDED
    assert "whoami=orrt-alice" in text
    assert "canary-7f3a9" not in text and "DATABASE_URL" not in text and "ORRERY_SECRET_KEY" not in text
    assert "GREETING=a,ORRERY_INJECTED=1" in text and "QUOTE=it's $(id)" in text
    assert "injected=none,none" in text and "lines=2" in text  # the newline stayed inside LINES
    assert f"RUN=$(touch {home}/pwned)`touch {home}/pwned2`" in text
    assert not (home / "pwned").exists() and not (home / "pwned2").exists()


def test_a_slurm_job_runs_as_its_owners_account_in_its_home(hpc, api, alice, queue, unix_users):
    me = unix_users["alice"]
    script = 'echo "as $(id -un) uid=$(id -u) gid=$(id -g) in $(pwd) home=$HOME"'
    job, text = _run_to_the_end(hpc, api(alice), slurm_job("whoami", script))
    assert Job.objects.get(pk=job).state == JobState.SUCCEEDED
    assert me.pw_uid != 0 and me.pw_gid != 0
    assert f"as orrt-alice uid={me.pw_uid} gid={me.pw_gid} in {me.pw_dir} home={me.pw_dir}" in text


def test_a_slurm_jobs_output_is_its_owners_alone(hpc, api, alice, queue, unix_users):
    """The output file is in the owner's own directory, readable by the owner only: another user
    of the cluster cannot read it; the control plane still copies it into the job's log."""
    me = unix_users["alice"]
    job, text = _run_to_the_end(hpc, api(alice), slurm_job("private", "echo secret-4d1"))
    assert "secret-4d1" in text
    attempt = str(JobAttempt.objects.get(job_id=job).pk)
    path = Path(me.pw_dir) / ".orrery" / "slurm" / f"orrery-{attempt}.out"
    seen = path.stat()
    assert (seen.st_uid, seen.st_gid, stat.S_IMODE(seen.st_mode)) == (me.pw_uid, me.pw_gid, 0o600)
    for directory in (path.parent, path.parent.parent):
        assert (directory.stat().st_uid, stat.S_IMODE(directory.stat().st_mode)) == (me.pw_uid, 0o700)
    assert not Path(f"/tmp/orrery-{attempt}.out").exists()
    peek = subprocess.run(
        ["runuser", "-u", "orrt-bob", "--", "cat", str(path)], capture_output=True, text=True
    )
    assert peek.returncode != 0 and "Permission denied" in peek.stderr and "secret-4d1" not in peek.stdout


def test_two_orrery_clusters_on_one_slurm_never_touch_each_others_jobs(hpc, slurm, api, alice, queue):
    token = Path(slurm["ORRERY_SLURM_TOKEN_FILE"]).read_text().strip()
    other, _ = onboard_slurm("hpc-b", slurm["ORRERY_SLURM_URL"], token, slurm_conf=slurm["SLURM_CONF"])
    assert other.config["tag"] != hpc.config["tag"]
    answer = api(alice).post("/api/v1/jobs", slurm_job("mine", "sleep 120"), format="json")
    assert answer.status_code == 201, answer.content
    assert run_cycle(SchedulerCache()).placed == 1 and drain_outbox() == 1
    attempt = JobAttempt.objects.get(job_id=answer.json()["id"])
    wait(lambda: squeue(attempt.remote_id) == "RUNNING", "the job to run in Slurm", timeout=60)

    adapter = SlurmAdapter()
    # A live Slurm job under an attempt's name that B did not ask about: not B's orphan.
    assert attempt.remote_id not in [o.remote_id for o in adapter.sync(other, []).orphans]
    # Even under an attempt id B might know (a copy of A's database) B neither adopts the job...
    known = replace(load_works([attempt.pk])[0], remote_id="")
    assert adapter.sync(other, [known]).states == []
    assert submitted(hpc, known.attempt_id, hpc.config["tag"]) == attempt.remote_id
    assert submitted(other, known.attempt_id, other.config["tag"]) == ""
    # ...nor cancels it: B's whole sync leaves it running, in Slurm and in A's view.
    assert sync_cluster(other).cancelled == 0
    assert squeue(attempt.remote_id) == "RUNNING"
    sync_cluster(hpc)
    assert Job.objects.get(pk=attempt.job_id).state == JobState.RUNNING


@pytest.mark.parametrize(
    "identity, status",
    [("accounts", 400), ("same_name", 201), ("shared", 201)],
)
def test_the_identity_chosen_at_onboarding_decides_who_may_submit(slurm, api, alice, queue, identity, status):
    assert _onboard(slurm, identity=identity).identity == identity
    answer = api(alice).post("/api/v1/jobs", slurm_job("who", "true"), format="json")
    assert answer.status_code == status, answer.content
    if status == 400:
        errors = {e["path"]: e["message"] for e in answer.json()["errors"]}
        assert "no POSIX account on cluster 'hpc'" in errors["spec.placement.clusters[0]"], errors


@pytest.mark.parametrize(
    "account, words",
    [
        (None, "the job's owner has no POSIX account on cluster 'hpc'"),
        ("orrt-nobody", "no user 'orrt-nobody' on the Orrery host that submits to cluster 'hpc'"),
    ],
    ids=["mapping-removed", "unknown-user"],
)
def test_an_attempt_without_an_account_fails_at_once(hpc, api, alice, queue, account, words):
    """An owner whose mapping went away (or names no user of the submit host) between submission
    and dispatch: the attempt fails with the reason, nothing is submitted, nothing is retried."""
    answer = api(alice).post("/api/v1/jobs", slurm_job("orphaned", "true"), format="json")
    assert answer.status_code == 201, answer.content
    job = answer.json()["id"]
    assert run_cycle(SchedulerCache()).placed == 1
    mapping = PosixAccount.objects.filter(cluster=hpc, user=alice)
    mapping.delete() if account is None else mapping.update(username=account)
    assert drain_outbox() == 1 and drain_outbox() == 0
    assert Job.objects.get(pk=job).state == JobState.FAILED
    assert words in Job.objects.get(pk=job).events.order_by("-id").first().message
    attempt = JobAttempt.objects.get(job_id=job)
    assert DispatchOutbox.objects.get(attempt=attempt).state == DispatchOutbox.State.SENT
    assert not Allocation.objects.filter(job_id=job, active=True).exists()
    listed = subprocess.run(
        ["squeue", "-h", f"--name={attempt.pk}"], capture_output=True, text=True, timeout=30
    )
    assert listed.stdout.strip() == ""  # nothing was submitted
