"""The budgets page (who sees which budget, the burn-down from the daily roll-up) and the
console's budgets (created and raised through the service, which releases held jobs)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from foundation.choices import AuditAction
from foundation.models import AuditEntry
from portal.choices import Role
from portal.models import Membership
from scheduling.budget_selectors import burn_down
from scheduling.choices import JobState, PendingReason
from scheduling.models import Budget, Job, UsageDay
from scheduling.services.jobs import JobRequest, submit_jobs
from tests.factories import gpu_model, make_budget, make_project, make_queue, make_user
from tests.portal.test_csp import assert_strict

pytestmark = pytest.mark.django_db
H = 3600


@pytest.fixture
def budgets(vision, queue, bob):
    nlp = make_project("nlp", members=(bob,))
    return {
        "vision": make_budget(vision, 100, used_gpu_seconds=30 * H, reserved_gpu_seconds=20 * H),
        "nlp": make_budget(nlp, 777),
    }


def shown(client) -> set[str]:
    page = client.get("/budgets/")
    assert page.status_code == 200
    return set(re.findall(r'<section class="budget" id="budget-(\d+)"', page.content.decode()))


@pytest.mark.parametrize(
    "who, sees",
    [
        ("alice", {"vision"}),
        ("bob", {"nlp"}),
        ("stranger", set()),
        ("manager", {"vision"}),
        ("operator", {"vision", "nlp"}),
    ],
)
def test_each_user_sees_only_their_projects_budgets(client, alice, bob, operator, vision, budgets, who, sees):
    users = {"alice": alice, "bob": bob, "operator": operator, "stranger": make_user("stranger")}
    if who == "manager":
        users[who] = make_user("mgr")
        Membership.objects.create(user=users[who], project=vision, role=Role.MANAGER)
    client.force_login(users[who])
    assert shown(client) == {str(budgets[name].pk) for name in sees}


def test_the_page_needs_a_session(client):
    answer = client.get("/budgets/")
    assert answer.status_code == 302 and answer["Location"].startswith("/accounts/login/")


def test_the_page_shows_where_a_budget_stands_and_its_burn_down(client, alice, vision, queue, budgets):
    budget = budgets["vision"]
    UsageDay.objects.create(
        day=timezone.now().date(),
        project=vision,
        queue=queue,
        owner=alice,
        state=JobState.SUCCEEDED,
        jobs=1,
        gpu_seconds=6 * H,
    )
    client.force_login(alice)
    page = client.get("/budgets/")
    assert_strict(page, "/budgets/")
    html = page.content.decode()
    for figure in ("100 GPU-h", "30.0 GPU-h", "20.0 GPU-h", "<strong>50.0 GPU-h</strong>", "50.0 %"):
        assert figure in html
    series = json.loads(
        re.search(rf'id="burndown-{budget.pk}" type="application/json">(.*?)</script>', html)[1]
    )
    assert series["daily"][-1] == 6.0 and series["left"][-1] == 94.0
    assert 'href="/budgets/" class="on"' in html


def test_burn_down_counts_each_day_of_the_window_against_an_even_spend(alice, vision, queue):
    start = datetime(2026, 3, 1, tzinfo=UTC)
    budget = make_budget(vision, 100, starts_at=start, ends_at=start + timedelta(days=10))
    other = make_queue(vision, "other")
    for day, q, hours in [(1, queue, 10), (1, other, 5), (3, queue, 20), (12, queue, 999), (-1, queue, 999)]:
        UsageDay.objects.create(
            day=(start + timedelta(days=day)).date(),
            project=vision,
            queue=q,
            owner=alice,
            state=JobState.SUCCEEDED,
            jobs=1,
            gpu_seconds=hours * H,
        )
    series = burn_down(budget, now=start + timedelta(days=4, hours=6))
    assert series.t == [int((start + timedelta(days=d)).timestamp()) for d in range(5)]
    assert series.daily == [0, 15, 0, 20, 0]
    assert series.left == [100, 85, 85, 65, 65]
    assert series.ideal == [90, 80, 70, 60, 50]
    budget.queue = queue  # a queue's budget: only the queue's use
    assert burn_down(budget, now=start + timedelta(days=2)).daily == [0, 10]


# --- the console --------------------------------------------------------------------------------


@pytest.fixture
def console(client, operator):
    client.force_login(operator)
    return client


def held_job(alice, queue, hours: int) -> Job:
    request = JobRequest(
        name="t", queue=queue, gpu_model=gpu_model("h100"), gpus_per_node=8, time_limit_s=hours * 450
    )
    [job] = submit_jobs([request], actor=alice)[0]
    job.refresh_from_db()
    return job


def test_raising_a_budget_in_the_console_releases_held_jobs_and_keeps_reservations(
    console, operator, alice, vision, queue
):
    budget = make_budget(vision, 8, on_overrun="hold")
    held_job(alice, queue, 8)  # takes all 8
    waiting = held_job(alice, queue, 8)
    assert waiting.reason == PendingReason.BUDGET_EXHAUSTED
    url = reverse("admin:scheduling_budget_change", args=[budget.pk])
    form = console.get(url)
    assert form.status_code == 200 and b"Left (GPU-h)" in form.content
    ends = budget.ends_at.astimezone(timezone.get_current_timezone())
    answer = console.post(
        url,
        {
            "ends_at_0": ends.strftime("%Y-%m-%d"),
            "ends_at_1": ends.strftime("%H:%M:%S"),
            "gpu_hours": 16,
            "on_overrun": "hold",
        },
    )
    assert answer.status_code == 302, answer.content.decode()[:2000]
    assert Job.objects.get(pk=waiting.pk).state == JobState.PENDING
    budget.refresh_from_db()
    assert (budget.gpu_hours, budget.reserved_gpu_seconds) == (16, 16 * H)  # the form never wrote it back
    assert AuditEntry.objects.get(action=AuditAction.BUDGET_CHANGE).actor_id == operator.pk


def test_creating_a_budget_in_the_console_goes_through_the_service(console, operator, vision, queue):
    now = timezone.now()
    answer = console.post(
        reverse("admin:scheduling_budget_add"),
        {
            "project": vision.pk,
            "queue": queue.pk,
            "starts_at_0": now.strftime("%Y-%m-%d"),
            "starts_at_1": "00:00:00",
            "ends_at_0": (now + timedelta(days=30)).strftime("%Y-%m-%d"),
            "ends_at_1": "00:00:00",
            "gpu_hours": 500,
            "on_overrun": "refuse",
        },
    )
    assert answer.status_code == 302, answer.content.decode()[:2000]
    budget = Budget.objects.get()
    assert (budget.queue_id, budget.gpu_hours) == (queue.pk, 500)
    assert AuditEntry.objects.get(action=AuditAction.BUDGET_CREATE).actor_id == operator.pk


@pytest.mark.parametrize(
    "field, value", [("queue", "other"), ("ends_at_0", "2020-01-01")], ids=["foreign-queue", "ends-first"]
)
def test_a_bad_budget_is_a_form_error(console, vision, field, value):
    foreign = make_queue(make_project("nlp"), "other")
    now = timezone.now()
    data = {
        "project": vision.pk,
        "starts_at_0": now.strftime("%Y-%m-%d"),
        "starts_at_1": "00:00:00",
        "ends_at_0": (now + timedelta(days=30)).strftime("%Y-%m-%d"),
        "ends_at_1": "00:00:00",
        "gpu_hours": 5,
        "on_overrun": "refuse",
    }
    data[field] = foreign.pk if value == "other" else value
    answer = console.post(reverse("admin:scheduling_budget_add"), data)
    assert answer.status_code == 200 and b"errorlist" in answer.content
    assert not Budget.objects.exists()


def test_the_console_lists_budgets_with_their_standing_and_never_deletes_them(console, budgets):
    listing = console.get(reverse("admin:scheduling_budget_changelist"))
    assert listing.status_code == 200
    assert b"50.0 %" in listing.content and b"Left (GPU-h)" in listing.content
    delete = console.get(reverse("admin:scheduling_budget_delete", args=[budgets["vision"].pk]))
    assert delete.status_code == 403
