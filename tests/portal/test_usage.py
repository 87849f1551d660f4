"""The usage page: charts' data carried as JSON (no inline code), totals per project or user,
the same visibility as the usage API, and a bad period shown as a message, never a 500."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from django.utils import timezone

from portal.choices import Role
from portal.models import Membership
from scheduling.choices import JobState
from scheduling.models import JobAttempt
from scheduling.services.accounting import record_ends
from tests.factories import make_cluster, make_job, make_project, make_queue, make_user
from tests.portal.test_csp import assert_strict

pytestmark = pytest.mark.django_db


@pytest.fixture
def usage_world(alice, bob, queue, vision):
    Membership.objects.create(user=bob, project=vision)
    nlp = make_queue(make_project("secret-nlp", members=(make_user("dave"),)))
    cluster = make_cluster("sim-a")
    ended = timezone.now() - timedelta(hours=1)
    for owner, q, gpus in ((alice, queue, 2), (bob, queue, 4), (nlp.project.memberships.get().user, nlp, 8)):
        job = make_job(owner, q, gpus=gpus, state=JobState.SUCCEEDED, finished_at=ended)
        JobAttempt.objects.create(
            job=job,
            number=1,
            cluster=cluster,
            active=False,
            started_at=ended - timedelta(hours=1),
            finished_at=ended,
            # an hour at 500 W per GPU, at 0.2 per kWh and 300 g of CO₂ per kWh
            energy_wh=500 * gpus,
            energy_cost=0.5 * gpus * 0.2,
            co2_g=0.5 * gpus * 300,
        )
        record_ends([job.pk], ended)
    return ended.date().isoformat()


def chart_data(page: str) -> dict:
    found = re.search(r'<script id="usage-data" type="application/json">(.*?)</script>', page, re.S)
    assert found, page[:500]
    return json.loads(found.group(1))


def test_a_member_sees_their_projects_totals_stacked_by_day(client, alice, usage_world):
    client.force_login(alice)
    answer = client.get("/usage/")
    assert_strict(answer, "/usage/")
    page = answer.content.decode()
    assert '<a href="/usage/" class="on">Usage</a>' in page
    data = chart_data(page)
    assert data["byGroup"] == {"vision": {usage_world: 6.0}}
    assert list(data["byModel"].values()) == [{usage_world: 6.0}]
    assert "secret-nlp" not in page and "6.0" in page


def table_rows(page: str, table: str) -> list[list[str]]:
    body = re.search(rf'<table[^>]*id="{table}".*?<tbody>(.*?)</tbody>', page, re.S)
    assert body, page[:500]
    rows = re.findall(r"<tr>(.*?)</tr>", body.group(1), re.S)
    return [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in rows]


def test_totals_show_energy_its_cost_and_co2_per_project_and_model(client, alice, usage_world):
    client.force_login(make_user("ops", staff=True))
    page = client.get("/usage/").content.decode()
    # vision: alice's 2 GPUs and bob's 4 for an hour; secret-nlp: dave's 8
    assert table_rows(page, "usage-totals") == [
        ["secret-nlp", "1", "8.0", "4.0", "0.80", "1.2"],
        ["vision", "2", "6.0", "3.0", "0.60", "0.9"],
    ]
    assert table_rows(page, "usage-models")[0][3:] == ["7.0", "1.40", "2.1"]
    assert "7.0 kWh costing 1.40 and 2.1 kg CO₂" in page


@pytest.mark.parametrize(
    ("who", "expected"),
    [("alice", {"alice"}), ("carol", {"alice", "bob"}), ("ops", {"alice", "bob", "dave"})],
    ids=["member-sees-own", "manager-sees-project", "operator-sees-all"],
)
def test_stacked_by_user_follows_who_may_see_whom(client, alice, vision, usage_world, who, expected):
    user = alice if who == "alice" else make_user(who, staff=who == "ops")
    if who == "carol":
        Membership.objects.create(user=user, project=vision, role=Role.MANAGER)
    client.force_login(user)
    assert set(chart_data(client.get("/usage/?group=user").content.decode())["byGroup"]) == expected


@pytest.mark.parametrize("query", ["since=junk", "since=2001-01-01", "until=0001-01-01&since=٣", "group=<b>"])
def test_a_bad_period_is_a_message_not_an_error(client, alice, usage_world, query):
    client.force_login(alice)
    answer = client.get(f"/usage/?{query}")
    assert answer.status_code == 200
    page = answer.content.decode()
    assert ("query.since" in page or "query.until" in page) == (not query.startswith("group"))
    assert "<b>" not in page.split("<main>")[1]
