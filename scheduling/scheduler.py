"""The process's scheduler: its cache, the cycle entry point tasks call, and the simulated
clusters' runner (jobs placed on a simulated cluster start at once and end after their
``spec.sim.duration``)."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models import F
from django.utils import timezone

from clusters.choices import ClusterKind
from scheduling.choices import JobState
from scheduling.models import DispatchOutbox, Job
from scheduling.services.transitions import transition_jobs
from scheduling.wakeup import wake_simulated


def advance_simulated_jobs() -> dict[str, int]:
    """Start what was placed on simulated clusters and finish what has run its course. Asks to
    run again when the next job ends before the next beat (``wakeup.wake_simulated``)."""
    started = list(
        DispatchOutbox.objects.filter(
            state=DispatchOutbox.State.PENDING,
            cluster__kind=ClusterKind.SIMULATED,
            kind=DispatchOutbox.Kind.START,
        ).values_list("pk", "attempt__job_id")
    )
    moved = {"started": 0, "finished": 0, "failed": 0}
    if started:
        moved["started"] = len(
            transition_jobs(
                [job for _, job in started],
                JobState.RUNNING,
                only_from=JobState.SCHEDULED,
                message="started on a simulated cluster",
            )
        )
        DispatchOutbox.objects.filter(pk__in=[pk for pk, _ in started]).update(
            state=DispatchOutbox.State.SENT, tries=F("tries") + 1
        )
    now = timezone.now()
    default = settings.ORRERY_SIM_DEFAULT_DURATION_S
    done_ok, done_failed = [], {}
    soonest = None
    for pk, started_at, spec in Job.objects.filter(
        state=JobState.RUNNING, attempts__active=True, attempts__cluster__kind=ClusterKind.SIMULATED
    ).values_list("pk", "started_at", "spec"):
        sim = (spec or {}).get("sim") or {}
        duration = default if sim.get("durationSeconds") is None else sim["durationSeconds"]
        if not started_at:
            continue
        end = started_at + timedelta(seconds=duration)
        if end <= now:
            code = sim.get("exitCode") or 0
            if code:
                done_failed[pk] = code
            else:
                done_ok.append(pk)
        elif soonest is None or end < soonest:
            soonest = end
    moved["finished"] = len(
        transition_jobs(
            done_ok,
            JobState.SUCCEEDED,
            only_from=JobState.RUNNING,
            exit_code=0,
            message="finished on a simulated cluster",
        )
    )
    for code in set(done_failed.values()):
        ids = [pk for pk, c in done_failed.items() if c == code]
        moved["failed"] += len(
            transition_jobs(
                ids,
                JobState.FAILED,
                only_from=JobState.RUNNING,
                exit_code=code,
                message=f"exit code {code} on a simulated cluster",
            )
        )
    if soonest is not None:
        wake_simulated((soonest - timezone.now()).total_seconds())
    return moved
