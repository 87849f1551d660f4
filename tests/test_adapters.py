"""One contract, every kind of cluster (clusters/adapters/): the same tests run on a simulated
cluster, on a real ``orrery-agent`` process talking to a live server, on a real Slurm
(scripts/slurm-dev-cluster.sh) and on Kubernetes — the fake API server of tests/kubefake, or a
real cluster when ``ORRERY_TEST_KUBECONFIG`` names its kubeconfig — through the kind-agnostic
dispatcher (scheduling/dispatch/).
A world gives the cluster and what differs per kind: how a command is written, and how to see
that work stopped on the cluster itself. Adding a kind is one more ``*_world`` fixture and one
more parameter of ``world``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.db import close_old_connections
from kubernetes import client as k8s

from clusters.adapters.base import ClusterAdapter
from clusters.adapters.kubernetes.client import api_for
from clusters.adapters.kubernetes.informer import forget_all
from clusters.adapters.registry import ADAPTERS, adapter_for
from clusters.choices import ClusterKind, Identity, NodeState
from clusters.models import Cluster, GpuDevice, Node, PosixAccount
from clusters.services.credentials import create_join_token
from clusters.services.onboarding import onboard_kubernetes, onboard_slurm
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
from tests.kubefake import FakeKube
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
    image: str = ""  # the container image jobs run in, on kinds that run images only

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

    def job(self, command: str, *, exit_code: int = 0, seconds: float = 0, env: dict | None = None) -> Job:
        return make_job(
            self.queue.project.memberships.get().user,
            self.queue,
            gpus=1,
            model=self.model,
            placement={"clusters": [self.cluster.name]},
            command=command,
            spec={"sim": {"durationSeconds": seconds, "exitCode": exit_code}}
            | ({"image": self.image} if self.image else {})
            | ({"env": env} if env else {}),
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


@pytest.fixture
def kubernetes_world(django_capture_on_commit_callbacks) -> Iterator[World]:
    """The fake API server with its controllers played by ``KubeletPlayer`` — or, when
    ``ORRERY_TEST_KUBECONFIG`` is set, the real cluster of that kubeconfig (namespace
    ``ORRERY_TEST_KUBE_NAMESPACE``, default orrery, set up with docs/clusters/kubernetes.rbac.yaml;
    its nodes need a GPU model of the catalog, and ``busybox`` must be pullable)."""
    ensure_catalog()
    real = os.environ.get("ORRERY_TEST_KUBECONFIG")
    fake = player = None
    if real:
        kubeconfig, namespace = Path(real).read_text(), os.environ.get("ORRERY_TEST_KUBE_NAMESPACE", "orrery")
    else:
        fake = FakeKube(adapter_rbac=False).start()
        fake.apply_rbac((ROOT / "docs" / "clusters" / "kubernetes.rbac.yaml").read_text())
        fake.add_gpu_node("kn-1", gpus=2, product="NVIDIA-A100-SXM4-80GB")
        fake.patch_node("kn-1", {"spec": {"taints": None}})  # what the node lifecycle controller does
        kubeconfig, namespace = fake.kubeconfig("adapter"), "orrery"
        player = KubeletPlayer(fake, namespace).start()
    try:
        with django_capture_on_commit_callbacks(execute=True):
            cluster, _ = onboard_kubernetes("k8s", kubeconfig=kubeconfig, namespace=namespace)
        Node.objects.filter(cluster=cluster, gpus__isnull=False).update(state=NodeState.READY)
        model = GpuDevice.objects.filter(node__cluster=cluster).values_list("model__slug", flat=True).first()
        api = k8s.CoreV1Api(api_for(cluster))

        def stopped(attempt: JobAttempt) -> bool:
            found = api.list_namespaced_pod(
                namespace, label_selector=f"orrery.io/attempt-id={attempt.pk}", _preload_content=False
            )
            return all(pod["metadata"].get("deletionTimestamp") for pod in json.loads(found.data)["items"])

        yield World(cluster, model or "", runs_commands=True, stopped=stopped, image="busybox:1.36")
    finally:
        if player is not None:
            player.stop()
        forget_all()
        if fake is not None:
            fake.stop()


class KubeletPlayer:
    """Plays the Job controller, scheduler and kubelet around the fake API server, for the
    contract suite: each Job gets a pod per completion index on a node its affinity allows; the
    pod runs, then ends as its script says (``echo TEXT``: output TEXT, exit 0; ``exit N``;
    ``sleep``: runs until deleted). A pod marked for deletion is removed, as its kubelet would.
    The fake's own simulated controllers replace this once they exist; a real cluster needs none."""

    def __init__(self, fake: FakeKube, namespace: str) -> None:
        self.fake, self.namespace = fake, namespace
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kubelet-player", daemon=True)

    def start(self) -> KubeletPlayer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            with contextlib.suppress(Exception):  # an object deleted under our feet: next turn
                self._turn()

    def _turn(self) -> None:
        fake, ns = self.fake, self.namespace
        for job in fake.objects("jobs", ns):
            name, template = job["metadata"]["name"], job["spec"]["template"]
            nodes = template["spec"]["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"
            ]
            allowed = nodes["nodeSelectorTerms"][0]["matchFields"][0]["values"]
            for index in range(job["spec"].get("completions") or 1):
                pod = f"{name}-{index}-play"
                if fake.get("pods", pod, ns) is None and not job["metadata"].get("deletionTimestamp"):
                    labels = template["metadata"]["labels"] | {"batch.kubernetes.io/job-name": name}
                    body = {
                        "metadata": {"name": pod, "labels": labels},
                        "spec": template["spec"] | {"nodeName": allowed[index]},
                    }
                    fake.cluster.create("pods", ns, body, manager="kube-controller-manager")
                    self._status(pod, "Running", {"running": {"startedAt": "2026-12-01T14:31:01Z"}})
        for pod in fake.objects("pods", ns):
            name = pod["metadata"]["name"]
            if pod["metadata"].get("deletionTimestamp"):
                fake.cluster.delete("pods", ns, name, {"gracePeriodSeconds": 0})
            elif pod["status"].get("phase") == "Running":
                script = (pod["spec"]["containers"][0].get("command") or ["", "", ""])[-1]
                if script.startswith("sleep"):
                    continue
                code = int(script.split()[1]) if script.startswith("exit ") else 0
                if script.startswith("echo "):
                    fake.set_pod_log(ns, name, self._expand(pod, script[5:]) + "\n")
                terminated = {
                    "terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}
                }
                self._status(name, "Succeeded" if code == 0 else "Failed", terminated)

    POD_IP = "10.244.0.7"

    def _expand(self, pod: dict[str, Any], text: str) -> str:
        """``$NAME`` as the container's shell would see it: the pod's env, with the fields a
        kubelet fills in (its IP, its completion index)."""
        env = {}
        for item in pod["spec"]["containers"][0].get("env") or []:
            field = (item.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath", "")
            if "value" in item:
                env[item["name"]] = item["value"]
            elif field == "status.podIP":
                env[item["name"]] = self.POD_IP
            elif "job-completion-index" in field:
                env[item["name"]] = pod["metadata"]["name"].split("-")[-2]
        return re.sub(r"\$([A-Za-z_][A-Za-z0-9_]*)", lambda m: env.get(m.group(1), ""), text)

    def _status(self, pod: str, phase: str, state: dict[str, Any]) -> None:
        status = {
            "phase": phase,
            "containerStatuses": [{"name": "main", "state": state, "ready": phase == "Running"}],
        }
        self.fake.cluster.patch(
            "pods",
            self.namespace,
            pod,
            {"status": status},
            "application/merge-patch+json",
            subresource="status",
            manager="kubelet",
        )


@pytest.fixture(params=["simulated", "native", "slurm", "kubernetes"])
def world(request: pytest.FixtureRequest) -> World:
    return request.getfixturevalue(f"{request.param}_world")


def _place(world: World, *jobs: Job) -> None:
    assert run_cycle(SchedulerCache()).placed == len(jobs)
    assert drain_outbox() == len(jobs)


def test_every_kind_has_an_adapter():
    assert set(ADAPTERS) == set(ClusterKind.values)
    for kind in ADAPTERS:
        adapter = adapter_for(kind)
        assert adapter.kind == kind and adapter.dispatch_batch >= 1 and isinstance(adapter.runs_images, bool)
        assert isinstance(adapter.needs_image, bool) and (adapter.runs_images or not adapter.needs_image)
        assert all(callable(getattr(adapter, op)) for op in ("inventory", "dispatch", "sync", "cancel"))
    with pytest.raises(LookupError, match="mesos"):
        adapter_for("mesos")


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


LAUNCH = (
    "echo launch addr=$MASTER_ADDR port=$MASTER_PORT nodes=$NNODES node=$NODE_RANK rank=$RANK "
    "world=$WORLD_SIZE local=$LOCAL_WORLD_SIZE head=$ORRERY_HEAD_ADDR oport=$ORRERY_MASTER_PORT "
    "onodes=$ORRERY_NNODES onode=$ORRERY_NODE_RANK oworld=$ORRERY_WORLD_SIZE olocal=$ORRERY_LOCAL_WORLD_SIZE"
)


def test_a_job_gets_the_launch_environment_whatever_its_own_env_says(world):
    mine = {"MASTER_PORT": "1", "MASTER_ADDR": "evil", "RANK": "9", "WORLD_SIZE": "99", "ORRERY_NNODES": "7"}
    job = world.job(LAUNCH, env=mine)
    _place(world, job)
    done = world.until(job, JobState.SUCCEEDED, JobState.FAILED)
    assert done.state == JobState.SUCCEEDED
    attempt = JobAttempt.objects.get(job=job)
    if not world.runs_commands:
        assert attempt.master_port is None  # nothing runs, nothing listens: no port taken
        return
    assert attempt.master_port == 29500  # the first gang headed on its node
    end = time.monotonic() + 30
    while not [x for x in log_tail(job.pk, 10)[0] if "launch " in x] and time.monotonic() < end:
        world.sync()
        time.sleep(0.3)
    (line,) = [x.split("launch ", 1)[1] for x in log_tail(job.pk, 10)[0] if "launch " in x]
    seen = dict(item.split("=", 1) for item in line.split())
    if world.cluster.kind == ClusterKind.NATIVE:
        head = Node.objects.get(cluster=world.cluster).labels.get("orrery.io/address")
    elif world.cluster.kind == ClusterKind.SLURM:
        head = attempt.allocations.get(gpu__isnull=True).node.name  # the allocation's first host
    else:
        head = KubeletPlayer.POD_IP  # a single pod is its own head
    assert seen == {
        "addr": head,
        "port": "29500",
        "nodes": "1",
        "node": "0",
        "rank": "0",
        "world": "1",
        "local": "1",
        "head": head,
        "oport": "29500",
        "onodes": "1",
        "onode": "0",
        "oworld": "1",
        "olocal": "1",
    }
