"""One contract, every kind of cluster (clusters/adapters/): the same tests run on a simulated
cluster, on a real ``orrery-agent`` process talking to a live server, and on a real Slurm
(scripts/slurm-dev-cluster.sh), through the kind-agnostic dispatcher (scheduling/dispatch/).
A world gives the cluster and what differs per kind: how a command is written, and how to see
that work stopped on the cluster itself. Adding a kind is one more ``*_world`` fixture and one
more parameter of ``world``."""

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

from clusters.adapters.base import ClusterAdapter
from clusters.adapters.registry import ADAPTERS, adapter_for
from clusters.choices import ClusterKind, Identity, NodeState
from clusters.models import Cluster, GpuDevice, Node, PosixAccount
from clusters.services.credentials import create_join_token
from clusters.services.onboarding import onboard_slurm
from scheduling.choices import JobState
from scheduling.dispatch.outbox import drain_outbox
from scheduling.dispatch.sync import sync_cluster
from scheduling.dispatch.works import load_works
from scheduling.engine.cache import SchedulerCache
from scheduling.engine.cycle import run_cycle
from scheduling.models import Job, JobAttempt
from scheduling.selectors import log_tail
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
from tests.processes import scancel_tagged, spawn_agent, squeue

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
        return adapter_for(self.cluster.kind)

    def sync(self) -> None:
        """What the periodic pass does for this kind (agents push: nothing to ask)."""
        if self.adapter.sync_every_s is not None:
            sync_cluster(self.cluster)

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
            self.sync()
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
    cluster = make_cluster("lab", kind=ClusterKind.NATIVE, identity=Identity.SHARED)
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
def slurm_world(slurm, unix_users) -> Iterator[World]:
    ensure_catalog()
    token = Path(slurm["ORRERY_SLURM_TOKEN_FILE"]).read_text().strip()
    cluster, _ = onboard_slurm("hpc", slurm["ORRERY_SLURM_URL"], token, slurm_conf=slurm["SLURM_CONF"])
    Node.objects.filter(cluster=cluster).update(state=NodeState.READY)

    def stopped(attempt: JobAttempt) -> bool:
        attempt.refresh_from_db()
        state = squeue(attempt.remote_id)
        return state in ("", "CANCELLED", "COMPLETED", "FAILED", "TIMEOUT")

    world = World(cluster, "a100-80g", runs_commands=True, stopped=stopped)
    PosixAccount.objects.create(
        cluster=cluster, user=world.queue.project.memberships.get().user, username="orrt-alice"
    )
    yield world
    scancel_tagged(cluster.config["tag"])


@pytest.fixture(params=["simulated", "native", "slurm"])
def world(request: pytest.FixtureRequest) -> World:
    return request.getfixturevalue(f"{request.param}_world")


def _place(world: World, *jobs: Job) -> None:
    assert run_cycle(SchedulerCache()).placed == len(jobs)
    assert drain_outbox() == len(jobs)


def test_every_kind_has_an_adapter():
    assert set(ADAPTERS) == {ClusterKind.NATIVE, ClusterKind.SIMULATED, ClusterKind.SLURM}
    for kind in ADAPTERS:
        adapter = adapter_for(kind)
        assert adapter.kind == kind and adapter.dispatch_batch >= 1 and isinstance(adapter.runs_images, bool)
        assert all(callable(getattr(adapter, op)) for op in ("inventory", "dispatch", "sync", "cancel"))
    with pytest.raises(LookupError, match="kubernetes"):
        adapter_for(ClusterKind.KUBERNETES)


def test_inventory_shows_the_nodes_and_their_gpu_models(world):
    seen = world.adapter.inventory(world.cluster)
    assert seen.nodes >= 1 and seen.gpus >= 1
    models = set(GpuDevice.objects.filter(node__cluster=world.cluster).values_list("model__slug", flat=True))
    assert models == {world.model}


def test_a_job_runs_once_and_succeeds_with_its_output(world):
    job = world.job("echo contract-ok")
    _place(world, job)
    assert drain_outbox() == 0  # delivered once; a second sweep finds nothing to do
    done = world.until(job, JobState.SUCCEEDED, JobState.FAILED)
    assert (done.state, done.exit_code) == (JobState.SUCCEEDED, 0)
    assert JobAttempt.objects.filter(job=job).count() == 1
    if world.runs_commands:
        end = time.monotonic() + 30
        while "contract-ok" not in log_tail(job.pk, 10)[0] and time.monotonic() < end:
            world.sync()
            time.sleep(0.3)
        assert "contract-ok" in log_tail(job.pk, 10)[0]
    else:
        assert log_tail(job.pk, 10) == ([], False)


def test_a_delivery_made_again_finds_what_it_created(world):
    job = world.job("sleep 300", seconds=300)
    assert run_cycle(SchedulerCache()).placed == 1
    works = load_works(JobAttempt.objects.filter(job=job).values_list("pk", flat=True))
    first = list(world.adapter.dispatch(world.cluster, works))
    again = list(world.adapter.dispatch(world.cluster, works))  # a drain that died before recording
    assert [s.error for s in first + again] == ["", ""]
    assert first[0].remote_id == again[0].remote_id
    if world.cluster.kind == ClusterKind.SLURM:
        assert first[0].remote_id and squeue(first[0].remote_id) in ("PENDING", "RUNNING")
        found = subprocess.run(
            ["squeue", "-h", "-o", "%i", f"--name={works[0].attempt_id}"], capture_output=True, text=True
        )
        assert found.stdout.split() == [first[0].remote_id]  # one Slurm job, not two
    cancel_job(Job.objects.get(pk=job.pk), actor=None)
    drain_outbox()
    world.sync()


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
        world.sync()
        time.sleep(0.3)
    world.sync()
    assert Job.objects.get(pk=job.pk).state == JobState.CANCELLED  # nothing moved it back
