"""Job dependencies, with Slurm's semantics: a job waits until the jobs it names have ended the
way it asks, and is cancelled when that can never happen.

=============  ===============================================  ==============================
kind           met when the target ends                         never met when it ends
=============  ===============================================  ==============================
``afterok``    SUCCEEDED                                        FAILED, TIMEOUT, CANCELLED
``afterany``   in any final state                               —
``afternotok`` FAILED, TIMEOUT or CANCELLED                     SUCCEEDED
``singleton``  stored as ``afterany`` on every earlier job of the same name and owner not yet
               ended at submission
=============  ===============================================  ==============================

A reference ``74`` names every member of array 74 when 74 is an array id, else job 74; ``74_3``
names one member. Only final states count: a preempted or requeued target has not ended.

``attach`` writes one ``JobDependency`` edge per (dependent, target, kind) when jobs are submitted;
a dependent with a waiting edge gets ``dependency_pending`` (the scheduler's cache leaves it out
of the pending queue) and the reason ``Dependency``. ``resolve`` runs in the transaction that
ends targets: it marks their edges met or never, releases the dependents left with no waiting
edge, and returns those with an edge never to be met, which ``transitions`` cancels in turn.

Circular dependencies cannot be made: every target exists before its dependent is submitted,
and a job's dependencies are fixed at submission, so an edge always points to an older job.

Locking, so that no edge is ever left waiting on a job that has ended, and a dependent is
released exactly when its last edge is met:

* ``attach`` reads its targets ``FOR SHARE``: a target ending concurrently either commits first
  (``attach`` then sees it ended and judges the edge at once) or waits for the submission to
  commit (its ``resolve`` then sees the new edge).
* ``resolve`` locks the dependents ``FOR UPDATE`` (in id order) before it touches their edges.
  Two targets of one dependent ending in two transactions thus take turns: the second sees the
  first one's edge met once it gets the lock, and releases the job; neither can decide on a
  snapshot that misses the other's edge.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import connection
from django.db.models import Exists, OuterRef

from scheduling.choices import (
    TERMINAL_STATES,
    DependencyKind,
    DependencyState,
    EventKind,
    JobState,
    PendingReason,
)
from scheduling.models import Job, JobDependency, JobEvent
from scheduling.spec import SpecError
from scheduling.wakeup import request_cycle

K = DependencyKind
SINGLETON = "singleton"
MET_BY: dict[str, frozenset[str]] = {
    K.AFTEROK: frozenset({JobState.SUCCEEDED}),
    K.AFTERANY: TERMINAL_STATES,
    K.AFTERNOTOK: frozenset({JobState.FAILED, JobState.TIMEOUT, JobState.CANCELLED}),
}
assert set(MET_BY) == set(DependencyKind.values)
MAX_EDGES = 100_000  # per submission: an array waiting on an array makes members × members
MAX_SHOWN_ERRORS = 10
PATH = "spec.dependency"


@dataclass(frozen=True)
class Target:
    """A job a dependency may name, as read (and share-locked) at submission."""

    pk: int
    array_id: int | None
    array_index: int | None
    state: str
    project_id: int
    owner_id: int
    name: str

    @property
    def ref(self) -> str:
        return f"{self.array_id}_{self.array_index}" if self.array_id is not None else str(self.pk)


def attach(jobs: list[Job], requests: Sequence[Any], actor: AbstractBaseUser) -> None:
    """Write the dependency edges of just-submitted ``jobs`` (``requests[i].dependency`` for
    ``jobs[i]``) and make the jobs that must wait do so. Raises ``SpecError`` at
    ``spec.dependency`` — and writes nothing — for a reference to no job ``actor`` can see, or to
    a job that has already ended in a way that can never meet the dependency (Slurm's "Job
    dependency problem"). An edge on a job already ended the right way is written met. Runs in
    the submission's transaction, in a fixed number of queries whatever the number of refs."""
    wanted = [(job, r.dependency) for job, r in zip(jobs, requests, strict=True) if r.dependency]
    if not wanted:
        return
    new_ids = {job.pk for job in jobs}
    refs = {ref for _, pairs in wanted for kind, ref in pairs if kind != SINGLETON}
    names = {job.name for job, pairs in wanted if any(kind == SINGLETON for kind, _ in pairs)}
    targets = _lock_targets(refs, names, actor, exclude=new_ids)
    visible = _visible(targets, actor)
    by_ref = _by_ref([t for t in targets if t.project_id in visible])

    same_name: dict[str, list[Target]] = defaultdict(list)  # for singletons: the actor's unended jobs
    for t in targets:
        if t.owner_id == actor.pk and t.state not in TERMINAL_STATES:
            same_name[t.name].append(t)

    edges: dict[tuple[int, int, str], str] = {}  # (job, target, kind) → state
    waits_for: dict[int, list[str]] = defaultdict(list)  # job → what it waits for, as asked
    # problem → the first job it was found for: the members of an array share their problems,
    # and each is told once
    errors: dict[str, str] = {}
    several = len(jobs) > 1
    for job, pairs in wanted:
        for kind, ref in pairs:
            if kind == SINGLETON:
                found = same_name.get(job.name, [])
                kind, shown = K.AFTERANY, f"earlier jobs named {job.name} (singleton)"
            else:
                found, shown = by_ref.get(ref, []), f"{ref} ({kind})"
                if not found:
                    errors.setdefault(f"no job {ref} you can see", job.name)
            waiting = False
            for target in found:
                state = _judge(kind, target.state)
                if state == DependencyState.NEVER:
                    never = f"job {target.ref} already ended {target.state}; {kind} can never be met"
                    errors.setdefault(never, job.name)
                waiting |= state == DependencyState.WAITING
                edges[job.pk, target.pk, kind] = state
            if waiting:
                waits_for[job.pk].append(shown)
        if len(edges) > MAX_EDGES:
            raise SpecError([(PATH, f"makes more than {MAX_EDGES} dependency edges; name fewer jobs")])
    if errors:
        shown = [f"{name}: {problem}" if several else problem for problem, name in errors.items()]
        more = len(shown) - MAX_SHOWN_ERRORS
        raise SpecError(
            [(PATH, e) for e in shown[:MAX_SHOWN_ERRORS]]
            + ([(PATH, f"and {more} more problems")] if more > 0 else [])
        )
    JobDependency.objects.bulk_create(
        (JobDependency(job_id=j, target_id=t, kind=k, state=s) for (j, t, k), s in edges.items()),
        batch_size=5000,
    )
    _mark_waiting(jobs, waits_for)


def _judge(kind: str, target_state: str) -> str:
    """An edge's state for a target in ``target_state``."""
    if target_state not in TERMINAL_STATES:
        return DependencyState.WAITING
    return DependencyState.MET if target_state in MET_BY[kind] else DependencyState.NEVER


def _lock_targets(
    refs: set[str], names: set[str], actor: AbstractBaseUser, *, exclude: set[int]
) -> list[Target]:
    """Every job the references could name (jobs, arrays, array members) and, for singletons,
    the actor's jobs of those names not yet ended, read ``FOR SHARE`` in id order: none of them
    can end until this transaction commits. One statement."""
    ids = sorted({int(r) for r in refs if "_" not in r})
    members = sorted({tuple(map(int, r.split("_"))) for r in refs if "_" in r})
    table = connection.ops.quote_name(Job._meta.db_table)
    sql = f"""
        SELECT id, array_id, array_index, state, project_id, owner_id, name FROM {table}
        WHERE (
            id = ANY(%(ids)s) OR array_id = ANY(%(ids)s)
            OR (array_id, array_index) IN (SELECT * FROM unnest(%(arrays)s::bigint[], %(indices)s::int[]))
            OR (owner_id = %(owner)s AND name = ANY(%(names)s) AND NOT state = ANY(%(ended)s))
        ) AND NOT id = ANY(%(new)s)
        ORDER BY id FOR SHARE"""
    params = {
        "ids": ids,
        "arrays": [a for a, _ in members],
        "indices": [i for _, i in members],
        "owner": actor.pk,
        "names": sorted(names),
        "ended": sorted(TERMINAL_STATES),
        "new": sorted(exclude),
    }
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return [Target(*row) for row in cursor.fetchall()]


def _visible(targets: list[Target], actor: AbstractBaseUser) -> set[int]:
    """The projects among the targets' whose jobs ``actor`` may see (portal's rule: operators
    see every job, others the jobs of projects they are members of)."""
    projects = {t.project_id for t in targets}
    if actor.is_staff or not projects:
        return projects
    project_model = Job._meta.get_field("project").related_model
    return set(
        project_model.objects.filter(pk__in=projects, memberships__user=actor).values_list("pk", flat=True)
    )


def _by_ref(targets: list[Target]) -> dict[str, list[Target]]:
    """The targets each reference names: ``74`` is array 74's members if 74 is an array id,
    else job 74; ``74_3`` is member 3 of array 74."""
    out: dict[str, list[Target]] = defaultdict(list)
    arrays: set[str] = set()
    for t in targets:
        if t.array_id is not None:
            out[f"{t.array_id}_{t.array_index}"].append(t)
            out[str(t.array_id)].append(t)
            arrays.add(str(t.array_id))
    for t in targets:
        if str(t.pk) not in arrays:
            out[str(t.pk)].append(t)
    return out


def _mark_waiting(jobs: list[Job], waits_for: dict[int, list[str]]) -> None:
    """Keep the jobs with a waiting edge out of scheduling, with a reason naming what they wait
    for; one UPDATE per distinct message (the members of an array share theirs)."""
    messages: dict[str, list[int]] = defaultdict(list)
    for pk, shown in waits_for.items():
        messages[_message(shown)].append(pk)
    for message, ids in messages.items():
        Job.objects.filter(pk__in=ids).update(
            dependency_pending=True, reason=PendingReason.DEPENDENCY, reason_message=message
        )
    for job in jobs:
        if job.pk in waits_for:
            job.dependency_pending, job.reason = True, PendingReason.DEPENDENCY
            job.reason_message = _message(waits_for[job.pk])


def _message(shown: list[str]) -> str:
    text = "waits for " + ", ".join(shown)
    return text if len(text) <= 512 else text[:511] + "…"


def resolve(job_ids: Iterable[int], to: str) -> list[int]:
    """The jobs ``job_ids`` have just ended as ``to``: mark the edges that wait on them met or
    never, release the dependents whose edges are now all met (an event ``dependency met`` each,
    and a scheduling cycle), and return the ids of dependents with an edge that can now never
    be met — the caller cancels them. Called in the transaction that moved the jobs; a no-op for
    a state that is not final. Idempotent: edges already judged are left alone."""
    job_ids = list(job_ids)
    if to not in TERMINAL_STATES or not job_ids:
        return []
    waiting = JobDependency.objects.filter(target_id__in=job_ids, state=DependencyState.WAITING)
    dependents = sorted(set(waiting.values_list("job_id", flat=True)))
    if not dependents:
        return []
    # Lock before judging: see the module's docstring. The edges are read again after the lock.
    list(Job.objects.select_for_update().filter(pk__in=dependents).order_by("pk").values_list("pk"))
    met = [kind for kind, states in MET_BY.items() if to in states]
    never = [kind for kind in MET_BY if kind not in met]
    doomed = sorted(set(waiting.filter(kind__in=never).values_list("job_id", flat=True)))
    waiting.filter(kind__in=never).update(state=DependencyState.NEVER)
    waiting.filter(kind__in=met).update(state=DependencyState.MET)

    unmet = JobDependency.objects.filter(job_id=OuterRef("pk")).exclude(state=DependencyState.MET)
    ready = list(
        Job.objects.filter(pk__in=dependents, dependency_pending=True)
        .exclude(Exists(unmet))
        .values_list("pk", flat=True)
    )
    if ready:
        Job.objects.filter(pk__in=ready, state=JobState.PENDING, reason=PendingReason.DEPENDENCY).update(
            reason=PendingReason.NONE, reason_message=""
        )
        Job.objects.filter(pk__in=ready).update(dependency_pending=False)
        # The event is also how the scheduler's cache learns that the job may now be placed.
        JobEvent.objects.bulk_create(
            JobEvent(job_id=pk, kind=EventKind.NOTE, message="dependency met") for pk in ready
        )
        request_cycle()
    return doomed
