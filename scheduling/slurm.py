"""Running attempts on Slurm clusters: dispatch with the node list and GPUs the scheduler
chose, state sync, output, cancel.

Dispatch uses ``sbatch`` (slurmrestd 22.05 cannot pin a node list), with the cluster's
``slurm_conf``; everything else goes through slurmrestd. The Slurm job is named after the
attempt id, so a retried dispatch finds the job it already submitted instead of submitting it
twice, and the sync finds every job Orrery ever submitted there.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from django.db import transaction

from clusters.adapters.slurm import SlurmClient, SlurmError, decode_exit, job_state, raw_job_state
from clusters.choices import ClusterKind
from clusters.models import Cluster
from clusters.services.slurm import client_for
from scheduling.agentwork import store_log
from scheduling.choices import ACTIVE_STATES, JobState
from scheduling.models import Allocation, DispatchOutbox, Job, JobAttempt
from scheduling.services.transitions import InvalidTransition, TransitionConflict, transition_job

log = logging.getLogger(__name__)
OUTPUT_DIR = Path(os.environ.get("ORRERY_SLURM_OUTPUT_DIR", "/tmp"))


def _cli_env(cluster: Cluster) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JWT"}  # a stray SLURM_JWT breaks munge auth
    if cluster.config.get("slurm_conf"):
        env["SLURM_CONF"] = cluster.config["slurm_conf"]
    return env


def _output_path(attempt_id: Any) -> Path:
    return OUTPUT_DIR / f"orrery-{attempt_id}.out"


def submit_attempt(attempt: JobAttempt) -> str:
    """Submit (or find) the Slurm job of an attempt; returns its Slurm job id."""
    cluster, job = attempt.cluster, attempt.job
    env = _cli_env(cluster)
    found = subprocess.run(
        ["squeue", "-h", "-o", "%i", f"--name={attempt.pk}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    if found.returncode == 0 and found.stdout.strip():
        return found.stdout.split()[0]
    rows = list(Allocation.objects.filter(attempt=attempt).select_related("node", "gpu"))
    nodes = sorted({r.node.name for r in rows})
    gpus = sum(1 for r in rows if r.gpu_id) // max(len(nodes), 1)
    gres_type = next((r.node.labels.get("slurm.io/gres-type") for r in rows), "") or ""
    variables = {
        "ORRERY_JOB_ID": str(job.pk),
        "ORRERY_ATTEMPT": str(attempt.number),
        "ORRERY_ATTEMPT_ID": str(attempt.pk),
        "ORRERY_NNODES": str(len(nodes)),
        "ORRERY_GPUS_PER_NODE": str(gpus),
        **{str(k): str(v) for k, v in ((job.spec or {}).get("env") or {}).items()},
    }
    argv = [
        "sbatch",
        "--parsable",
        f"--job-name={attempt.pk}",
        f"--nodelist={','.join(nodes)}",
        f"--nodes={len(nodes)}",
        f"--output={_output_path(attempt.pk)}",
        # Always: Orrery's failover policy places a retry (anywhere, counted against the job's
        # retries); Slurm's own requeue would rerun it pinned to the same nodes, unseen.
        "--no-requeue",
        "--export=ALL," + ",".join(f"{k}={v}" for k, v in variables.items()),
    ]
    if gpus:
        argv.append(f"--gres=gpu:{gres_type}:{gpus}" if gres_type else f"--gres=gpu:{gpus}")
    if job.time_limit_s:
        argv.append(f"--time={max(1, -(-job.time_limit_s // 60))}")
    argv += ["--wrap", job.command]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    if done.returncode != 0:
        raise SlurmError(f"sbatch refused the job: {done.stderr.strip()[:300]}")
    return done.stdout.strip().split(";")[0]


def dispatch_slurm(limit: int = 200) -> int:
    """Deliver pending ``start`` outbox rows of Slurm clusters. Idempotent."""
    rows = list(
        DispatchOutbox.objects.filter(
            state=DispatchOutbox.State.PENDING,
            cluster__kind=ClusterKind.SLURM,
            kind=DispatchOutbox.Kind.START,
        ).order_by("id")[:limit]
    )
    sent = 0
    for row in rows:
        attempt = JobAttempt.objects.select_related("job", "cluster").get(pk=row.attempt_id)
        if not attempt.active:
            DispatchOutbox.objects.filter(pk=row.pk).update(state=DispatchOutbox.State.SENT)
            continue
        try:
            remote = submit_attempt(attempt)
        except (SlurmError, OSError, subprocess.TimeoutExpired) as exc:
            DispatchOutbox.objects.filter(pk=row.pk).update(tries=row.tries + 1, last_error=str(exc)[:1000])
            log.warning("dispatch of %s to %s failed: %s", attempt.pk, attempt.cluster.name, exc)
            continue
        with transaction.atomic():
            JobAttempt.objects.filter(pk=attempt.pk).update(remote_id=remote)
            DispatchOutbox.objects.filter(pk=row.pk).update(
                state=DispatchOutbox.State.SENT, tries=row.tries + 1
            )
        sent += 1
    return sent


def sync_slurm(cluster: Cluster) -> dict[str, int]:
    """Bring Orrery's attempts on this cluster in line with what Slurm says about their jobs;
    cancel in Slurm what Orrery no longer runs; fail attempts whose job vanished."""
    client = client_for(cluster)
    by_name = {j.get("name"): j for j in client.jobs()}
    counts = {"moved": 0, "cancelled": 0, "vanished": 0}
    active = {
        str(a.pk): a for a in JobAttempt.objects.filter(cluster=cluster, active=True).select_related("job")
    }
    for name, slurm_job in by_name.items():
        attempt = active.get(name)
        state = job_state(slurm_job.get("job_state"))
        if attempt is None:
            if (
                state in ("PENDING", "HELD", "RUNNING", "STARTING")
                and JobAttempt.objects.filter(pk=_uuid(name)).exists()
                and _cancel(client, slurm_job)  # Orrery cancelled or moved it
            ):
                counts["cancelled"] += 1
            continue
        counts["moved"] += _follow(attempt, state, slurm_job, client)
    for name, attempt in active.items():
        if attempt.remote_id and name not in by_name:
            counts["vanished"] += _move(attempt, JobState.FAILED, message="the job vanished from Slurm")
    return counts


def _uuid(name: str) -> Any:
    try:
        return uuid.UUID(name)
    except ValueError:
        return None


# Why Slurm keeps a job pending, in words for the job page (the rest are shown as Slurm says).
SLURM_PENDING = {
    "JobHeldAdmin": "held by a Slurm administrator (scontrol release)",
    "JobHeldUser": "held in Slurm by its user (scontrol release)",
    "Resources": "waiting for resources in Slurm",
    "Priority": "waiting behind higher-priority Slurm jobs",
    "ReqNodeNotAvail": "a chosen node is not available in Slurm",
    "PartitionDown": "the Slurm partition is down",
}


def _follow(attempt: JobAttempt, state: str, slurm_job: dict[str, Any], client: SlurmClient) -> int:
    _copy_output(attempt)
    job = attempt.job
    if state in ("PENDING", "HELD") and job.state in (JobState.SCHEDULED, JobState.STARTING):
        why = str(slurm_job.get("state_reason") or "")
        text = f"pending in Slurm: {SLURM_PENDING.get(why, why)}"[:512] if why not in ("", "None") else ""
        if text != job.reason_message:
            Job.objects.filter(pk=job.pk, state=job.state).update(reason_message=text)
        return 0
    if _past_time_limit(job, slurm_job) and _cancel(client, slurm_job):
        # Slurm's limits are whole minutes (and checked every 30 s); Orrery's are seconds.
        return _move(attempt, JobState.TIMEOUT, message=f"ran past its time limit of {job.time_limit_s} s")
    if state in ("RUNNING", "COMPLETING") and job.state in (JobState.SCHEDULED, JobState.STARTING):
        return _move(attempt, JobState.RUNNING, message=f"running on {slurm_job.get('nodes')}")
    if state in ("SUCCEEDED", "FAILED", "TIMEOUT", "CANCELLED", "PREEMPTED"):
        code, signal = decode_exit(slurm_job.get("exit_code"))
        why = slurm_job.get("state_reason") or state
        message = f"{state.lower()} in Slurm ({why}" + (f", exit code {code})" if code else ")")
        if signal:
            message = f"{state.lower()} in Slurm (signal {signal})"
        return _move(attempt, JobState(state), exit_code=code, message=message)
    return 0


def _past_time_limit(job: Job, slurm_job: dict[str, Any]) -> bool:
    """Still running (not completing, not suspended) past the job's limit."""
    if raw_job_state(slurm_job.get("job_state")) != "RUNNING":
        return False
    started = slurm_job.get("start_time") or 0
    return bool(job.time_limit_s and started and time.time() > started + job.time_limit_s)


def _cancel(client: SlurmClient, slurm_job: dict[str, Any]) -> bool:
    """Cancel a Slurm job; a refusal (it ended meanwhile) is logged, and the sync goes on."""
    try:
        client.cancel(int(slurm_job["job_id"]))
        return True
    except SlurmError as exc:
        log.warning("could not cancel Slurm job %s: %s", slurm_job.get("job_id"), exc)
        return False


def _move(attempt: JobAttempt, to: str, *, exit_code: int | None = None, message: str = "") -> int:
    try:
        transition_job(attempt.job_id, to, only_from=ACTIVE_STATES, exit_code=exit_code, message=message)
        return 1
    except (InvalidTransition, TransitionConflict):
        return 0


def _copy_output(attempt: JobAttempt) -> None:
    path = _output_path(attempt.pk)
    if not path.exists():
        return
    head = (
        Allocation.objects.filter(attempt=attempt, gpu__isnull=True)
        .order_by("node__name")
        .values_list("node_id", flat=True)
        .first()
    )
    data = path.read_bytes()[-(1 << 20) :]
    store_log(
        head,
        {
            "attempt": str(attempt.pk),
            "offset": max(path.stat().st_size - len(data), 0),
            "data": data.decode("utf-8", "replace"),
        },
    )
