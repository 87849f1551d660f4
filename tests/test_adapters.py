"""One contract, every kind of cluster (scheduling/adapters.py): the same tests run on a
simulated cluster, on a real ``orrery-agent`` process talking to a live server, and on a real
Slurm (scripts/slurm-dev-cluster.sh). A world gives the cluster and what differs per kind:
how a command is written, and how to see that work stopped on the cluster itself."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.db import close_old_connections

from clusters.choices import ClusterKind, NodeState
from clusters.models import Cluster, GpuDevice, Node
from clusters.services.credentials import create_join_token
from clusters.services.slurm import onboard_slurm
from scheduling.adapters import ADAPTERS, ClusterAdapter, adapter_for
from scheduling.choices import JobState
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import run_cycle
from scheduling.models import Job, JobAttempt
from scheduling.services.jobs import cancel_job
from tests.factories import (
    ensure_catalog,
    make_cluster,
    make_job,
    make_node,
    make_project,
    make_queue,
    make_user,
)
from tests.processes import spawn_agent, squeue

pytestmark = pytest.mark.django_db(transaction=True)
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class World:
    cluster: Cluster
    model: str  # the catalog slug its GPUs must have
    runs_commands: bool  # simulated clusters run none, so they have no output
    stopped: Callable[[JobAttempt], bool]  # the work is gone from the cluster itself
    queue: Any = None

    def __post_init__(self) -> None:
        alice = make_user("alice")
        self.queue = make_queue(make_project("vision", members=(alice,)))

    @property
    def adapter(self) -> ClusterAdapter:
        return adapter_for(self.cluster)

    def job(self, command: str, *, exit_code: int = 0, seconds: float = 0) -> Job:
        return make_job(
            self.queue.project.memberships.get().user,
            self.queue,
            gpus=1,
            model=self.model,
            placement={"clusters": [self.cluster.name]},
            command=command,
            spec={"sim": {"durationSeconds": seconds, "exitCode": exit_code}},
        )

    def until(self, job: Job, *states: str, timeout: float = 60.0) -> Job:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            close_old_connections()
            self.adapter.poll(self.cluster)
            fresh = Job.objects.get(pk=job.pk)
            if fresh.state in states:
                return fresh
            time.sleep(0.3)
        raise AssertionError(f"job {job.pk} never reached {states}; it is {Job.objects.get(pk=job.pk).state}")


@pytest.fixture
def simulated_world() -> Iterator[World]:
    ensure_catalog()
    cluster = make_cluster("sim", kind=ClusterKind.SIMULATED)
    make_node(cluster, gpus=2, model="a100", name="sim-n1")
    yield World(cluster, "a100-80g", runs_commands=False, stopped=lambda attempt: not attempt.active)


@pytest.fixture
def native_world(live_server, settings, tmp_path) -> Iterator[World]:
    settings.ORRERY_HEARTBEAT_INTERVAL = 1
    ensure_catalog()
    cluster = make_cluster("lab", kind=ClusterKind.NATIVE)
    _, join = create_join_token(cluster)
    work = tmp_path / "agent"
    agent = spawn_agent(live_server.url, join, work, "n1", "a100:2")
    try:
        end = time.monotonic() + 30
        while not Node.objects.filter(cluster=cluster, gpus__isnull=False).exists():
            assert time.monotonic() < end, Path(f"{work}.log").read_text()[-2000:]
            time.sleep(0.2)
        Node.objects.filter(cluster=cluster).update(state=NodeState.READY)

        def stopped(attempt: JobAttempt) -> bool:
            meta = work / "attempts" / str(attempt.pk) / "meta.json"
            if not meta.exists():
                return True
            try:
                os.killpg(json.loads(meta.read_text())["pgid"], 0)
            except ProcessLookupError:
                return True
            return False

        yield World(cluster, "a100-80g", runs_commands=True, stopped=stopped)
    finally:
        agent.kill()
        agent.wait()
        for meta in work.glob("attempts/*/meta.json"):
            with contextlib.suppress(ProcessLookupError, KeyError, ValueError):
                os.killpg(json.loads(meta.read_text())["pgid"], 9)


@pytest.fixture
def slurm_world(slurm) -> Iterator[World]:
    ensure_catalog()
    token = Path(slurm["ORRERY_SLURM_TOKEN_FILE"]).read_text().strip()
    cluster, _ = onboard_slurm("hpc", slurm["ORRERY_SLURM_URL"], token, slurm_conf=slurm["SLURM_CONF"])
    Node.objects.filter(cluster=cluster).update(state=NodeState.READY)

    def stopped(attempt: JobAttempt) -> bool:
        attempt.refresh_from_db()
        state = squeue(attempt.remote_id)
        return state in ("", "CANCELLED", "COMPLETED", "FAILED", "TIMEOUT")

    yield World(cluster, "a100-80g", runs_commands=True, stopped=stopped)
    subprocess.run(["scancel", "--user", "root"], capture_output=True, timeout=30)


@pytest.fixture(params=["simulated", "native", "slurm"])
def world(request: pytest.FixtureRequest) -> World:
    return request.getfixturevalue(f"{request.param}_world")


def _place(world: World, *jobs: Job) -> None:
    assert run_cycle(SchedulerCache()).placed == len(jobs)
    assert world.adapter.dispatch() >= len(jobs) or world.cluster.kind == ClusterKind.SIMULATED


def test_every_kind_has_an_adapter():
    assert set(ADAPTERS) == {ClusterKind.NATIVE, ClusterKind.SIMULATED, ClusterKind.SLURM}
    with pytest.raises(LookupError, match="kubernetes"):
        adapter_for(Cluster(kind=ClusterKind.KUBERNETES))


def test_inventory_shows_the_nodes_and_their_gpu_models(world):
    assert world.adapter.inventory(world.cluster) >= 1
    models = set(GpuDevice.objects.filter(node__cluster=world.cluster).values_list("model__slug", flat=True))
    assert models == {world.model}


def test_a_job_runs_once_and_succeeds_with_its_output(world):
    job = world.job("echo contract-ok")
    _place(world, job)
    assert world.adapter.dispatch() == 0  # delivered once; a second sweep finds nothing to do
    done = world.until(job, JobState.SUCCEEDED, JobState.FAILED)
    assert (done.state, done.exit_code) == (JobState.SUCCEEDED, 0)
    assert JobAttempt.objects.filter(job=job).count() == 1
    if world.runs_commands:
        end = time.monotonic() + 30
        while "contract-ok" not in world.adapter.logs(job.pk, 10) and time.monotonic() < end:
            world.adapter.poll(world.cluster)
            time.sleep(0.3)
        assert "contract-ok" in world.adapter.logs(job.pk, 10)
    else:
        assert world.adapter.logs(job.pk, 10) == []


def test_an_exit_code_comes_back(world):
    job = world.job("exit 3", exit_code=3)
    _place(world, job)
    done = world.until(job, JobState.SUCCEEDED, JobState.FAILED)
    assert (done.state, done.exit_code) == (JobState.FAILED, 3)


def test_a_cancelled_job_stops_on_the_cluster(world):
    job = world.job("sleep 300", seconds=300)
    _place(world, job)
    world.until(job, JobState.RUNNING)
    attempt = JobAttempt.objects.get(job=job)
    assert not world.stopped(attempt)
    cancel_job(Job.objects.get(pk=job.pk), actor=None)
    end = time.monotonic() + 30
    while not world.stopped(JobAttempt.objects.get(pk=attempt.pk)):
        assert time.monotonic() < end, "the work kept running on the cluster"
        world.adapter.poll(world.cluster)
        time.sleep(0.3)
    world.adapter.poll(world.cluster)
    assert Job.objects.get(pk=job.pk).state == JobState.CANCELLED  # nothing moved it back
