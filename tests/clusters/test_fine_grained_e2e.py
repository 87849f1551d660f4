"""Fine-grained GPUs end to end: the real control plane (Daphne, a Celery worker with beat
running the scheduler, the aggregator, telemetry sync and the energy meter) and a real agent
whose fake A100s emulate MIG (GPU 0: 2 × 1g.10gb + 3g.40gb) and power (50 W idle, 350 W busy).

Jobs go in through the API — a MIG job, a fraction of a shareable GPU — and are placed by the
scheduler, started by the agent with the right devices in their environment, and metered:
each attempt's energy grows from the fake GPUs' power, and the job API shows it."""

from __future__ import annotations

import subprocess

import pytest

from clusters.choices import ClusterKind, ClusterState, Identity, NodeState
from clusters.models import GpuDevice, MigInstance, Node
from clusters.services.credentials import create_join_token
from portal.services.tokens import issue_token
from scheduling.models import Allocation, JobAttempt
from tests.clusters.test_agent_e2e import _kill_leftovers, api, running_plane, state_of, submit
from tests.factories import ensure_catalog, make_cluster, make_project, make_queue, make_user
from tests.processes import spawn_agent, wait

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def lab(tmp_path):
    """n1: two fake A100s, GPU 0 in MIG mode, GPU 1 offered in fractions; telemetry synced and
    energy metered every second; the scheduler re-reads the fleet (the shareable mark) every 3 s."""
    ensure_catalog()
    with running_plane(
        tmp_path, ORRERY_TELEMETRY_SYNC_S="1", ORRERY_ENERGY_METER_S="1", ORRERY_SCHEDULER_RESYNC_S="3"
    ) as plane:
        alice = make_user("alice")
        make_queue(make_project("vision", members=(alice,)))
        cluster = make_cluster(
            "lab", kind=ClusterKind.NATIVE, state=ClusterState.READY, identity=Identity.SHARED
        )
        _, join = create_join_token(cluster)
        _, token = issue_token(alice)
        agent: subprocess.Popen = spawn_agent(
            plane["url"],
            join,
            tmp_path / "n1",
            "n1",
            "a100:2",
            "--fake-mig",
            "0:1g.10gb,1g.10gb,3g.40gb",
            "--fake-power",
            "50:350",
        )
        try:
            node = wait(lambda: Node.objects.filter(name="n1", state=NodeState.READY).first(), "n1 ready")
            GpuDevice.objects.filter(node=node, index=1).update(shareable=True)
            yield {"url": plane["url"], "token": token, "node": node, "tmp": tmp_path}
        finally:
            agent.kill()
            agent.wait()
            _kill_leftovers(tmp_path)


def test_mig_and_shared_jobs_run_on_their_devices_and_are_metered(lab):
    report = 'echo "$CUDA_VISIBLE_DEVICES|${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:-}|${ORRERY_GPU_MEMORY_MB:-}"'
    report += "; sleep 6"
    mig = submit(lab, "mig", report, gpus="a100:1g.10gb:2", timeLimit="5m")
    shared = submit(lab, "shared", report, gpus="a100", resources={"gpuMemory": "20Gi"}, timeLimit="5m")
    for job_id in (mig, shared):
        wait(
            lambda job_id=job_id: state_of(lab, job_id, "RUNNING", "SUCCEEDED"),
            f"job {job_id} to run",
            timeout=90,
        )

    instances = set(
        Allocation.objects.filter(job_id=mig, mig_instance__isnull=False).values_list(
            "mig_instance__uuid", flat=True
        )
    )
    assert instances == set(
        MigInstance.objects.filter(gpu__node=lab["node"], profile="1g.10gb").values_list("uuid", flat=True)
    )
    (fraction,) = Allocation.objects.filter(job_id=shared, gpu__isnull=False)
    assert (fraction.gpu.index, fraction.gpu_memory_mb) == (1, 20480)

    def output(job_id: int) -> str:
        (attempt,) = JobAttempt.objects.filter(job_id=job_id)
        log = lab["tmp"] / "n1" / "attempts" / str(attempt.pk) / "output.log"
        return log.read_text().strip() if log.exists() else ""

    wait(lambda: output(mig) and output(shared), "both jobs' output")
    seen, _, _ = output(mig).partition("|")
    assert set(seen.split(",")) == instances, "a MIG job sees its instances' UUIDs, nothing else"
    gpu, percent, memory = output(shared).split("|")
    share = 20480 / GpuDevice.objects.get(node=lab["node"], index=1).memory_mb
    assert (gpu, memory) == ("1", "20480") and int(percent) == -(-int(share * 10_000) // 100)

    # Metered while they run: the busy fake GPUs draw 350 W, a MIG instance counts its slices/7
    # of it and the fraction its share of memory.
    wait(
        lambda: all(a.energy_wh > 0 for a in JobAttempt.objects.filter(job_id__in=[mig, shared])),
        "both attempts to be metered",
        timeout=60,
    )
    # The API shows what the meter wrote (in kWh, to 4 places: a few seconds of a MIG instance
    # may round to 0).
    wait(lambda: state_of(lab, mig, "SUCCEEDED"), "the MIG job to end", timeout=60)
    shown = api(lab, "GET", f"jobs/{mig}")
    metered = sum(a.energy_wh for a in JobAttempt.objects.filter(job_id=mig))
    assert metered > 0 and shown["energy"]["kwh"] == round(metered / 1000, 4)
    assert shown["resources"]["gpus"]["mig"] == "1g.10gb"
    assert api(lab, "GET", f"jobs/{shared}")["resources"]["gpuMemoryMiB"] == 20480
