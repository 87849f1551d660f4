"""Tenancy: a user reaches the jobs of their projects only; operators reach all."""

from __future__ import annotations

import pytest
from django.http import Http404

from portal.access import access_job, can_act_on_job, usable_queues, visible_jobs
from portal.choices import Role
from tests.factories import make_job, make_project, make_queue, make_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def nlp_job(bob):
    return make_job(bob, make_queue(make_project("nlp", members=(bob,))))


def test_members_see_their_projects_jobs_only(alice, queue, nlp_job):
    mine = make_job(alice, queue)
    assert list(visible_jobs(alice)) == [mine]
    assert access_job(alice, mine.pk) == mine
    with pytest.raises(Http404):
        access_job(alice, nlp_job.pk)


def test_operators_see_everything(operator, alice, queue, nlp_job):
    mine = make_job(alice, queue)
    assert set(visible_jobs(operator)) == {mine, nlp_job}


def test_acting_on_jobs_needs_ownership_or_management(alice, vision, queue):
    colleague, manager = make_user(), make_user()
    vision.memberships.create(user=colleague, role=Role.MEMBER)
    vision.memberships.create(user=manager, role=Role.MANAGER)
    job = make_job(alice, queue)
    assert can_act_on_job(alice, job)
    assert can_act_on_job(manager, job)
    assert not can_act_on_job(colleague, job)


def test_queues_usable_by_members_only(alice, bob, queue, nlp_job):
    assert list(usable_queues(alice)) == [queue]
    assert queue not in usable_queues(bob)
