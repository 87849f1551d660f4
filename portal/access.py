"""Fetch + permission check. A user reaches the jobs of projects they belong to; operators
(staff) reach everything. Another project's job is reported as missing, never as forbidden,
so its existence does not leak."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet
from django.http import Http404

from portal.choices import Role
from portal.models import Membership, Project
from scheduling.models import Job, Queue


def visible_projects(user: AbstractBaseUser) -> QuerySet[Project]:
    if user.is_staff:
        return Project.objects.all()
    return Project.objects.filter(memberships__user=user)


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


def usable_queues(user: AbstractBaseUser) -> QuerySet[Queue]:
    """The queues ``user`` may submit to: those of the projects they are a member of."""
    queues = Queue.objects.select_related("project")
    if user.is_staff:
        return queues
    return queues.filter(project__memberships__user=user)
