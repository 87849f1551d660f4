"""Tenants on one node, played as an attacker would: two real Unix users (``unix_users``), an
``orrery-agent`` running as root as on a real node, and Bob's job trying to read everything of
Alice's and of the platform it can name. Also: a job that forks out of its process group is
still stopped, a job over its memory request is killed, and an image job runs under podman as
its owner."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from clusters.choices import ClusterKind, ClusterState, Identity, NodeState
from clusters.models import Node, PosixAccount
from clusters.services.credentials import create_join_token
from portal.services.tokens import issue_token
from tests.clusters.test_agent_e2e import api, plane, state_of, submit  # noqa: F401 (a fixture)
from tests.factories import ensure_catalog, make_cluster, make_project, make_queue, make_user
from tests.processes import spawn_agent, wait

pytestmark = pytest.mark.django_db(transaction=True)
IMAGE = "localhost/orrery-test-busybox:1"
# crun refuses hosts whose cgroups mix v1 and v2 (this one does), and no runtime may raise
# limits above the host's own here: the node's operator passes these, as documented.
PODMAN_ARGS = ("--runtime=runc", "--ulimit=nofile=4096:4096", "--ulimit=nproc=4096:4096")


@pytest.fixture
def lab(plane, tmp_path, unix_users):  # noqa: F811 (plane is the imported fixture)
    """One node shared by Alice and Bob, each mapped to their own Unix account."""
    ensure_catalog()
    users = {name: make_user(name) for name in ("alice", "bob")}
    make_queue(make_project("vision", members=tuple(users.values())))
    cluster = make_cluster(
        "lab", kind=ClusterKind.NATIVE, state=ClusterState.READY, identity=Identity.ACCOUNTS
    )
    for name, user in users.items():
        PosixAccount.objects.create(cluster=cluster, user=user, username=unix_users[name].pw_name)
    _, join = create_join_token(cluster)
    canary = f"agent-canary-{secrets.token_hex(8)}"
    work = tmp_path / "n1"
    agents: list[subprocess.Popen] = []

    def start_agent() -> None:
        os.environ["ORRERY_AGENT_CANARY"] = canary  # in the agent's environment, never in a job's
        try:
            extra = [f"--podman-arg={a}" for a in PODMAN_ARGS]
            agents.append(
                spawn_agent(plane["url"], join, work, "n1", "h100:4", "--address", "n1.lab", *extra)
            )
        finally:
            del os.environ["ORRERY_AGENT_CANARY"]

    def kill_agent() -> None:
        agents[-1].kill()
        agents[-1].wait()

    start_agent()
    wait(lambda: Node.objects.filter(cluster=cluster, state=NodeState.READY).exists(), "the node to be ready")
    yield {
        "url": plane["url"],
        "work": work,
        "join": join,
        "canary": canary,
        "unix": unix_users,
        "as": {name: {"url": plane["url"], "token": issue_token(u)[1]} for name, u in users.items()},
        "start_agent": start_agent,
        "kill_agent": kill_agent,
    }
    kill_agent()


def logs(world: dict, job: int) -> str:
    return "\n".join(api(world, "GET", f"jobs/{job}/logs?tail=10000")["lines"])


def test_bob_cannot_reach_alice_or_the_platform_on_a_shared_node(lab):
    alice, bob = lab["as"]["alice"], lab["as"]["bob"]
    secret = f"alice-secret-{secrets.token_hex(8)}"
    hers = submit(
        alice,
        "hers",
        'id -un; echo "output of alice"; echo private > notes.txt; sleep 120',
        gpus="h100:1",
        env={"API_KEY": secret},
    )
    wait(lambda: "output of alice" in logs(alice, hers), "alice's job to run and print")
    attempt = api(alice, "GET", f"jobs/{hers}")["placement"]["attemptId"]
    work = lab["work"]
    state, job_dir = work / "attempts" / attempt, work / "jobs" / attempt
    # Everything Bob's job can read of other processes: their environments and command lines.
    probe = f"""
        for f in /proc/[0-9]*/environ; do cat "$f" 2>/dev/null; echo; done | tr '\\0' '\\n' | grep = || true
        for f in /proc/[0-9]*/cmdline; do cat "$f" 2>/dev/null; echo; done | tr '\\0' ' '
        cat {state}/output.log || echo denied-output
        ls {job_dir} || echo denied-dir
        cat {job_dir}/notes.txt || echo denied-notes
        cat {work}/credential.json || echo denied-credential
        ls {work}/attempts || echo denied-state
        echo "probe-identity $(id -un) groups $(id -G)"
        env | sort
    """
    his = submit(bob, "his", probe, gpus="h100:1")
    done = wait(lambda: state_of(bob, his, "SUCCEEDED", "FAILED"), "bob's probe to end")
    out = wait(lambda: "ORRERY_JOB_ID" in logs(bob, his) and logs(bob, his), "bob's output")
    assert done["state"] == "SUCCEEDED", out
    line = next((line for line in out.splitlines() if "probe-identity " in line), out[-3000:])
    identity = line.split("probe-identity ", 1)[1].split()
    assert identity[0] == lab["unix"]["bob"].pw_name, identity
    groups = identity[2:]
    assert "0" not in groups and str(lab["unix"]["bob"].pw_gid) in groups, groups
    credential = json.loads((work / "credential.json").read_text())["credential"]
    for leaked in (secret, "output of alice", "private", lab["join"], lab["canary"], credential):
        assert leaked not in out, f"bob saw {leaked!r}"
    for refused in ("denied-output", "denied-dir", "denied-notes", "denied-credential", "denied-state"):
        assert refused in out, f"{refused} missing: the probe did not run as expected\n{out}"
    assert "sleep 120" in out, "the probe saw no command line of alice's job at all"
    # The job's environment is its own and the platform's documented variables, nothing else.
    names = {line.split("=", 1)[0].split("] ", 1)[-1] for line in out.splitlines() if "=" in line}
    assert "ORRERY_AGENT_CANARY" not in names and "DATABASE_URL" not in names
    assert {"HOME", "USER", "PATH", "CUDA_VISIBLE_DEVICES", "ORRERY_JOB_ID"} <= names

    # Alice's job ran as her; its directory and output are hers and root's alone.
    assert lab["unix"]["alice"].pw_name in logs(alice, hers)
    assert (job_dir.stat().st_uid, job_dir.stat().st_mode & 0o777) == (lab["unix"]["alice"].pw_uid, 0o700)
    assert (state / "output.log").stat().st_mode & 0o077 == 0
    assert (work / "credential.json").stat().st_mode & 0o077 == 0
    api(alice, "POST", f"jobs/{hers}/cancel")


def test_a_job_that_forks_away_is_stopped_whole_and_memory_is_limited(lab):
    bob = lab["as"]["bob"]
    user = lab["unix"]["bob"].pw_name
    escapee = submit(
        bob,
        "escapee",
        # a double fork into a new session: out of the attempt's process group for good
        "(setsid sh -c 'exec sleep 1001' &); (setsid sh -c 'exec sleep 1002' &); sleep 1000",
        gpus="h100:1",
    )
    wait(lambda: _pids(user, "sleep 100"), "the escapee's processes")
    wait(lambda: state_of(bob, escapee, "RUNNING"), "the escapee to run")
    assert len(_pids(user, "sleep 100")) == 3
    api(bob, "POST", f"jobs/{escapee}/cancel")
    wait(lambda: not _pids(user, "sleep 100"), "every process of the job to be killed", timeout=30)

    hog = submit(
        bob,
        "hog",
        "head -c 400000000 /dev/zero | tail -c 300000000 > /dev/null && echo survived",
        gpus="h100:1",
        resources={"memory": "64Mi"},
    )
    done = wait(lambda: state_of(bob, hog, "SUCCEEDED", "FAILED"), "the hog to end")
    assert done["state"] == "FAILED", logs(bob, hog)
    assert "survived" not in logs(bob, hog)


def test_an_agent_killed_halfway_finds_its_attempt_again_and_still_stops_all_of_it(lab):
    """The agent dies (SIGKILL) while a job that forked away runs: the job goes on, and the
    agent started again adopts it, cgroup and all, so a cancel still reaches every process."""
    bob = lab["as"]["bob"]
    user = lab["unix"]["bob"].pw_name
    job = submit(
        bob,
        "survivor",
        "(setsid sh -c 'exec sleep 2001' &); (setsid sh -c 'exec sleep 2002' &); sleep 2000",
        gpus="h100:1",
    )
    wait(lambda: len(_pids(user, "sleep 200")) == 3, "the job's three processes")
    wait(lambda: state_of(bob, job, "RUNNING"), "the job to run")
    lab["kill_agent"]()
    time.sleep(1)
    assert len(_pids(user, "sleep 200")) == 3, "the job dies with its agent"
    lab["start_agent"]()
    api(bob, "POST", f"jobs/{job}/cancel")
    wait(lambda: not _pids(user, "sleep 200"), "every process of the adopted job to be killed", timeout=40)


def test_an_image_job_runs_in_a_container_as_its_owner(lab, tmp_path):
    _build_image(tmp_path)
    alice = lab["as"]["alice"]
    job = submit(
        alice,
        "boxed",
        'echo "uid=$(id -u) job=$ORRERY_JOB_ID"; ls /bin/busybox; cat /etc/os-release 2>&1 | head -1',
        gpus="h100:1",
        image=IMAGE,
    )
    done = wait(lambda: state_of(alice, job, "SUCCEEDED", "FAILED"), "the image job to end", timeout=90)
    out = wait(lambda: "uid=" in logs(alice, job) and logs(alice, job), "its output")
    assert done["state"] == "SUCCEEDED", out
    assert f"uid={lab['unix']['alice'].pw_uid} job={job}" in out
    assert "/bin/busybox" in out and "Debian" not in out  # the image's file system, not the host's
    listed = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True)
    assert f"orrery-{api(alice, 'GET', f'jobs/{job}')['placement']['attemptId']}" not in listed.stdout


def _build_image(tmp: Path) -> None:
    """A local image from Debian's static busybox (no registry is reachable from the tests)."""
    if subprocess.run(["podman", "image", "exists", IMAGE]).returncode == 0:
        return
    archive = tmp / "rootfs.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add("/bin/busybox", "bin/busybox")
        for tool in ("sh", "id", "echo", "ls", "cat", "head", "sleep", "env"):
            link = tarfile.TarInfo(f"bin/{tool}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
    subprocess.run(["podman", "import", str(archive), IMAGE], check=True, capture_output=True)


def _pids(user: str, pattern: str) -> list[str]:
    found = subprocess.run(["pgrep", "-u", user, "-f", pattern], capture_output=True, text=True)
    return found.stdout.split()
