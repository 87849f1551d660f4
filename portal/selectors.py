"""Reads of tenancy: memberships, API tokens, projects."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Count, QuerySet

from portal.models import ApiToken, Membership, Project


def memberships(user: AbstractBaseUser) -> QuerySet[Membership]:
    """``user``'s memberships with their projects, by project name."""
    return Membership.objects.filter(user=user).select_related("project").order_by("project__name")


def api_tokens(user: AbstractBaseUser) -> QuerySet[ApiToken]:
    """``user``'s API tokens, revoked and expired ones included, newest first."""
    return ApiToken.objects.filter(user=user).order_by("-created_at")


def with_member_counts(projects: QuerySet[Project]) -> QuerySet[Project]:
    """``projects`` annotated with ``member_count``, in the same query."""
    return projects.annotate(member_count=Count("memberships", distinct=True))
