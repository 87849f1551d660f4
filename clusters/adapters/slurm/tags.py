"""Which Slurm jobs belong to which Orrery cluster.

Several Orrery clusters may front one Slurm (two partitions, a staging and a production
installation). Each has its own tag (``clusters.adapters.tags``), written on each of its jobs as
the Slurm comment ``orrery:<tag>``: sync, orphan detection and the "already submitted?" check look at
jobs carrying the cluster's own tag only, so no cluster ever adopts, fails or cancels a job of
another. A job whose Slurm id is the one recorded for an attempt is that attempt's job whatever
its comment says (its owner may rewrite the comment; jobs submitted before tags have none).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from clusters.adapters.base import Orphan, Work
from clusters.adapters.slurm.api import job_state

LIVE = frozenset({"PENDING", "HELD", "RUNNING", "STARTING"})


def comment(tag: str) -> str:
    """The Slurm comment that marks a job as this cluster's."""
    return f"orrery:{tag}"


def claim(
    slurm_jobs: Iterable[dict[str, Any]], works: Sequence[Work], tag: str
) -> tuple[dict[str, dict[str, Any]], list[Orphan]]:
    """Sort Slurm's job list (as slurmrestd gives it) for one cluster: the job of each asked
    attempt, and the orphans (pure: tested on plain dicts).

    An asked attempt's job is the one with its recorded Slurm id, or, before its id is recorded,
    the first job of its name carrying ``tag``. Orphans are live jobs carrying ``tag`` under an
    attempt's name that are not the asked attempt's job. A job without ``tag`` is never an
    orphan: it is someone else's."""
    asked = {w.attempt_id: w for w in works}
    found: dict[str, dict[str, Any]] = {}
    orphans = []
    mark = comment(tag)
    for slurm_job in slurm_jobs:
        name, remote_id = str(slurm_job.get("name")), str(slurm_job.get("job_id") or "")
        ours = slurm_job.get("comment") == mark
        work = asked.get(name)
        its_job = work is not None and (work.remote_id == remote_id if work.remote_id else ours)
        if its_job and name not in found:
            found[name] = slurm_job
        elif ours and _is_attempt_id(name) and job_state(slurm_job.get("job_state")) in LIVE:
            orphans.append(Orphan(name, remote_id))
    return found, orphans


def submitted_job(squeue_output: str, tag: str) -> str:
    """The Slurm id of the first job carrying ``tag`` in ``squeue -h -o '%i|%k'`` output ("" when
    none): a dispatch tried again finds its own job, never another cluster's of the same name."""
    mark = comment(tag)
    for line in squeue_output.splitlines():
        job_id, _, text = line.partition("|")
        if text.strip() == mark and job_id.strip():
            return job_id.strip()
    return ""


def _is_attempt_id(name: object) -> bool:
    try:
        uuid.UUID(str(name))
    except ValueError:
        return False
    return True
