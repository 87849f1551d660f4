"""Fetch + permission check. A user reaches the jobs of projects they belong to; operators
(staff) reach everything. Another project's job is reported as missing, never as forbidden,
so its existence does not leak."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Q, QuerySet
from django.http import Http404

from portal.choices import Role
from portal.models import ApiToken, Membership, Project
from scheduling.models import Job, Queue
from scheduling.refs import JobRef
from scheduling.spec import SpecError


def visible_projects(user: AbstractBaseUser) -> QuerySet[Project]:
    if user.is_staff:
        return Project.objects.all()
    return Project.objects.filter(memberships__user=user)


def visible_project_ids(users: list[AbstractBaseUser]) -> dict[int, set[int]]:
    """``visible_projects`` of many users at once, as ids by user id: one query for the
    memberships of all of them, and one for every project when any is an operator."""
    seen: dict[int, set[int]] = {user.pk: set() for user in users}
    members = [user.pk for user in users if not user.is_staff]
    for user_id, project_id in Membership.objects.filter(user_id__in=members).values_list(
        "user_id", "project_id"
    ):
        seen[user_id].add(project_id)
    if len(members) < len(seen):
        every = set(Project.objects.values_list("pk", flat=True))
        for user in users:
            if user.is_staff:
                seen[user.pk] = set(every)
    return seen


def visible_jobs(user: AbstractBaseUser) -> QuerySet[Job]:
    jobs = Job.objects.select_related("owner", "project", "queue", "gpu_model")
    if user.is_staff:
        return jobs
    return jobs.filter(project__memberships__user=user)


def access_job(user: AbstractBaseUser, job_id: int) -> Job:
    """The job if ``user`` may see it; Http404 otherwise."""
    job = visible_jobs(user).filter(pk=job_id).first()
    if job is None:
        raise Http404("No such job.")
    return job


def can_act_on_job(user: AbstractBaseUser, job: Job) -> bool:
    """Owners act on their jobs, project managers on all of the project's, operators on all."""
    if user.is_staff or job.owner_id == user.pk:
        return True
    return Membership.objects.filter(user=user, project_id=job.project_id, role=Role.MANAGER).exists()


def is_privileged_in(user: AbstractBaseUser, queue: Queue) -> bool:
    """Operators, and managers of the queue's project, may pass the queue's limits for members
    (the highest priority a member may ask for)."""
    if user.is_staff:
        return True
    return Membership.objects.filter(user=user, project_id=queue.project_id, role=Role.MANAGER).exists()


def usable_queues(user: AbstractBaseUser) -> QuerySet[Queue]:
    """The queues ``user`` may submit to: those of the projects they are a member of."""
    queues = Queue.objects.select_related("project")
    if user.is_staff:
        return queues
    return queues.filter(project__memberships__user=user)


def visible_queues(user: AbstractBaseUser) -> QuerySet[Queue]:
    """The queues of the projects ``user`` can see, with their project."""
    return Queue.objects.filter(project__in=visible_projects(user)).select_related("project")


def access_token(user: AbstractBaseUser, token_id: int) -> ApiToken:
    """One of ``user``'s own API tokens; Http404 for anyone else's, operators included."""
    token = ApiToken.objects.filter(pk=token_id, user=user).first()
    if token is None:
        raise Http404("No such token.")
    return token


def submission_queue(user: AbstractBaseUser, project: str | None, queue: str, *, path: str = "") -> Queue:
    """The queue a spec names, if ``user`` may submit to it; ``SpecError`` naming the field if not.

    Without a project, the user's only project is meant. A project the user does not belong to
    gets the same answer as one that does not exist, so names do not leak."""
    p = f"{path}." if path else ""
    projects = visible_projects(user) if user.is_staff else Project.objects.filter(memberships__user=user)
    if project is None:
        mine = list(projects[:2])
        if len(mine) != 1:
            raise SpecError(
                [(f"{p}metadata.project", f"is required: you belong to {len(mine)} or more projects")]
            )
        found = mine[0]
    else:
        found = projects.filter(name=project).first()
        if found is None:
            raise SpecError([(f"{p}metadata.project", f"no project '{project}' that you are a member of")])
    chosen = Queue.objects.select_related("project").filter(project=found, name=queue).first()
    if chosen is None:
        raise SpecError([(f"{p}spec.queue", f"project '{found.name}' has no queue '{queue}'")])
    return chosen


# --- references: 74, 74_3, 74_[1-5] (scheduling.refs) -------------------------------------------


def one_job(ref: JobRef) -> Q:
    """The condition that selects the one job ``ref`` names (``74`` or ``74_3``)."""
    if ref.ranged:
        raise Http404("A range names several jobs.")
    return Q(pk=ref.job_id) if ref.index is None else Q(array_id=ref.job_id, array_index=ref.index)


def access_ref(user: AbstractBaseUser, ref: JobRef, jobs: QuerySet[Job] | None = None) -> Job:
    """The one job ``ref`` names (``74`` or ``74_3``) if ``user`` may see it; Http404 otherwise.
    ``jobs`` (among the user's visible jobs) may say what to fetch along with it."""
    job = (visible_jobs(user) if jobs is None else jobs).filter(one_job(ref)).first()
    if job is None:
        raise Http404("No such job.")
    return job


def access_ref_jobs(user: AbstractBaseUser, ref: JobRef) -> tuple[QuerySet[Job], bool]:
    """The jobs an action on ``ref`` acts on, if ``user`` may see them, and whether that is more
    than one job by nature (an array or a range): ``74`` is job 74 alone, or its whole array
    when 74 is an array's id (``scancel 74``); ``74_3`` one member; ``74_[1-5]`` those members.
    Only the user's visible jobs are ever selected, so a range cannot reach another project's
    array; Http404 when nothing visible matches."""
    jobs = visible_jobs(user)
    if ref.spans is None:
        job = access_job(user, ref.job_id)
        if job.array_id != job.pk:
            return jobs.filter(pk=job.pk), False
        return jobs.filter(array_id=job.pk), True
    within = Q()
    for low, high in ref.spans:
        within |= Q(array_index__gte=low, array_index__lte=high)
    selected = jobs.filter(within, array_id=ref.job_id)
    if not selected.exists():
        raise Http404("No such job.")
    return selected, ref.ranged


def can_act_on_jobs(user: AbstractBaseUser, jobs: QuerySet[Job]) -> bool:
    """``can_act_on_job`` for every one of ``jobs`` (an array shares one owner and project:
    one or two queries however many members)."""
    if user.is_staff:
        return True
    pairs = set(jobs.order_by().values_list("owner_id", "project_id").distinct())
    foreign = {project for owner, project in pairs if owner != user.pk}
    if not foreign:
        return True
    managed = Membership.objects.filter(user=user, project_id__in=foreign, role=Role.MANAGER).count()
    return managed == len(foreign)


def usage_scope(user: AbstractBaseUser, *, per_user: bool) -> Q:
    """The usage roll-up rows (``UsageDay``) ``user`` may read. Operators read everything. A
    project's totals are its members'; figures per user (a report grouped or filtered by user)
    are for the project's managers, and everyone reads their own."""
    if user.is_staff:
        return Q()
    if per_user:
        managed = Membership.objects.filter(user=user, role=Role.MANAGER).values("project_id")
        return Q(project_id__in=managed) | Q(owner_id=user.pk)
    return Q(project_id__in=Membership.objects.filter(user=user).values("project_id"))


def accounting_jobs(user: AbstractBaseUser) -> QuerySet[Job]:
    """The jobs ``user`` may see (``visible_jobs``' rule), for the history: the project ids are
    read first, so the planner of the history query sees them as values and can use the
    projects' indexes on ``finished_at``, where a join would hide them."""
    if user.is_staff:
        return Job.objects.all()
    return Job.objects.filter(project_id__in=list(visible_projects(user).values_list("pk", flat=True)))
