"""The operations console: every page renders, bad input is a form error, actions use services."""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.urls import reverse

from clusters.choices import NodeState
from clusters.models import Node
from scheduling.choices import JobState
from scheduling.models import Allocation, QueueQuota
from scheduling.services.allocations import NodePlacement, bind_job
from tests.factories import gpu_model, make_job

pytestmark = pytest.mark.django_db

MODELS = sorted(admin.site._registry, key=lambda m: m._meta.label)


@pytest.fixture
def console(client, operator):
    client.force_login(operator)
    return client


@pytest.fixture
def world(alice, queue, node):
    job = make_job(alice, queue, gpus=2)
    bind_job(job, [NodePlacement(node, [0, 1])])
    QueueQuota.objects.create(queue=queue, gpu_model=gpu_model("h100"), gpus=16)
    return job


@pytest.mark.parametrize("model", MODELS, ids=[m._meta.label for m in MODELS])
def test_every_changelist_and_change_page_renders(console, world, model):
    opts = model._meta
    listing = console.get(reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist"))
    assert listing.status_code == 200
    obj = model._default_manager.first()
    if obj is not None:
        page = console.get(reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk]))
        assert page.status_code == 200


def test_search_and_filters_render(console, world):
    url = reverse("admin:scheduling_job_changelist")
    assert console.get(url, {"q": "job", "state__exact": "SCHEDULED"}).status_code == 200
    assert (
        console.get(
            reverse("admin:clusters_node_changelist"), {"q": "a-n", "state__exact": "ready"}
        ).status_code
        == 200
    )


def _node_form(node: Node, **changes) -> dict:
    data = {
        "cluster": node.cluster_id,
        "name": node.name,
        "cpu_millicores_capacity": node.cpu_millicores_capacity,
        "cpu_millicores_allocatable": node.cpu_millicores_allocatable,
        "memory_bytes_capacity": node.memory_bytes_capacity,
        "memory_bytes_allocatable": node.memory_bytes_allocatable,
        "gpu_capacity": node.gpu_capacity,
        "labels": "{}",
        "rack": "",
        "switch": "",
        "nvlink_domain": "",
        "agent_version": "",
        "power_state": "on",
        "gpus-TOTAL_FORMS": 0,
        "gpus-INITIAL_FORMS": 0,
        "events-TOTAL_FORMS": 0,
        "events-INITIAL_FORMS": 0,
    }
    return data | changes


@pytest.mark.parametrize(
    "changes",
    [
        {"gpu_capacity": 99},
        {"cpu_millicores_capacity": 1, "cpu_millicores_allocatable": 1},
        {"memory_bytes_capacity": 10**15, "memory_bytes_allocatable": 10**15},
    ],
    ids=["gpus", "cpu", "memory"],
)
def test_what_a_node_reports_is_shown_with_units_and_never_edited(console, node, changes):
    node.memory_bytes_capacity, node.memory_bytes_allocatable = 2 * 2**40, 1536 * 2**30
    node.save()
    url = reverse("admin:clusters_node_change", args=[node.pk])
    page = console.get(url).content.decode()
    assert "2 TiB (1.5 TiB allocatable)" in page and 'name="memory_bytes_capacity"' not in page
    assert console.post(url, _node_form(node, rack="r7", **changes)).status_code == 302
    fresh = Node.objects.get(pk=node.pk)
    assert fresh.rack == "r7"  # what the operator may set is saved, the reported capacity is not
    assert all(getattr(fresh, field) == getattr(node, field) for field in changes)


def test_a_nodes_gpus_are_shown_with_units_and_cannot_be_added_or_removed(console, node):
    node.gpus.update(memory_mb=81559, memory_used_mb=1024, power_w=349.6, utilization=87.0)
    page = console.get(reverse("admin:clusters_node_change", args=[node.pk])).content.decode()
    assert "79.6 GiB" in page and "1 GiB" in page and "350 W" in page and "87 %" in page
    assert 'name="gpus-0-memory_mb"' not in page and 'name="gpus-0-DELETE"' not in page
    assert console.get(reverse("admin:clusters_gpudevice_add")).status_code == 403


def test_negative_quota_is_a_form_error(console, queue):
    url = reverse("admin:scheduling_queue_change", args=[queue.pk])
    data = {
        "project": queue.project_id,
        "name": queue.name,
        "priority": 0,
        "fair_share_weight": 1.0,
        "cohort": "",
        "quotas-TOTAL_FORMS": 1,
        "quotas-INITIAL_FORMS": 0,
        "quotas-0-gpu_model": gpu_model("h100").pk,
        "quotas-0-gpus": -4,
        "quotas-0-queue": queue.pk,
    }
    response = console.post(url, data)
    assert response.status_code == 200
    assert "Quotas and borrowing limits cannot be negative" in response.content.decode()
    assert not QueueQuota.objects.filter(queue=queue).exists()


def _queue_form(queue, **changes) -> dict:
    data = {
        "project": queue.project_id,
        "name": queue.name,
        "priority": 0,
        "fair_share_weight": 1.0,
        "cohort": "",
        "max_member_priority": queue.max_member_priority,
        "preempt_within_queue": "never",
        "reclaim_within_cohort": "never",
        "preemption_grace_s": 30,
        "gpu_model_preference": "",
        "quotas-TOTAL_FORMS": 0,
        "quotas-INITIAL_FORMS": 0,
    }
    return data | changes


def test_a_queues_preemption_settings_are_edited_in_the_console(console, queue):
    url = reverse("admin:scheduling_queue_change", args=[queue.pk])
    for alias in ("h100", "a100"):
        gpu_model(alias)  # in the catalog
    response = console.post(
        url,
        _queue_form(
            queue,
            preempt_within_queue="lower_priority",
            reclaim_within_cohort="any",
            preemption_grace_s=120,
            gpu_model_preference=" h100 , a100-80g,",
        ),
    )
    assert response.status_code == 302, response.content.decode()[-2000:]
    queue.refresh_from_db()
    assert (
        queue.preempt_within_queue,
        queue.reclaim_within_cohort,
        queue.preemption_grace_s,
        queue.gpu_model_preference,
    ) == ("lower_priority", "any", 120, ["h100-80g", "a100-80g"])
    page = console.get(url).content.decode()
    assert 'value="h100-80g, a100-80g"' in page  # shown back as typed: slugs, best first


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"preemption_grace_s": 3601}, "less than or equal to 3600"),
        ({"preemption_grace_s": -1}, "greater than or equal to 0"),
        ({"preemption_grace_s": "soon"}, "Enter a whole number"),
        ({"gpu_model_preference": "h100, z9000"}, "Unknown GPU model &#x27;z9000&#x27;"),
        ({"gpu_model_preference": "h100, h100-80g"}, "is h100-80g, listed already"),
        ({"gpu_model_preference": ",".join(f"m{i}" for i in range(17))}, "List at most 16 GPU models"),
        ({"preempt_within_queue": "always"}, "Select a valid choice"),
        ({"reclaim_within_cohort": "sometimes"}, "Select a valid choice"),
    ],
    ids=[
        "grace-over-an-hour",
        "grace-negative",
        "grace-words",
        "unknown-model",
        "alias-twice",
        "too-many",
        "bad-preempt-rule",
        "bad-reclaim-rule",
    ],
)
def test_bad_preemption_settings_are_form_errors(console, queue, changes, message):
    gpu_model("h100")
    url = reverse("admin:scheduling_queue_change", args=[queue.pk])
    response = console.post(url, _queue_form(queue, **changes))
    assert response.status_code == 200
    assert message in response.content.decode()
    queue.refresh_from_db()
    assert (queue.preemption_grace_s, queue.gpu_model_preference, queue.preempt_within_queue) == (
        30,
        [],
        "never",
    )


def test_a_jobs_estimate_and_checkpoint_are_shown_read_only(console, alice, queue):
    from django.utils import timezone

    from scheduling.models import Job

    job = make_job(
        alice,
        queue,
        gpus=2,
        estimated_start_at=timezone.now(),
        estimated_where="sim-b: node-3",
        reserved=True,
        checkpointed_at=timezone.now(),
        preemptible=False,
        placement={"gpuModels": ["h100-80g", "a100-80g"]},
    )
    Job.objects.filter(pk=job.pk).update(gpu_model=None)
    page = console.get(reverse("admin:scheduling_job_change", args=[job.pk])).content.decode()
    for label in ("Preemptible", "Checkpointed at", "Estimated start at", "Estimated where", "Reserved"):
        assert f"<label>{label}:</label>" in page, label
    assert "sim-b: node-3" in page
    for name in ("preemptible", "checkpointed_at", "estimated_start_at", "estimated_where", "reserved"):
        assert f'name="{name}"' not in page, name  # no input for any of them
    listing = console.get(
        reverse("admin:scheduling_job_changelist"), {"reserved__exact": "1"}
    ).content.decode()
    assert "2×h100-80g|a100-80g" in listing


def test_the_scheduler_page_shows_reserved_preempted_and_backfilled_per_cycle(console):
    from django.core.cache import cache

    from scheduling.engine.cycle import RECENT_CYCLES_KEY

    base = {"at": 0, "ms": 1.0, "placed": 5, "lost": 0, "blocked": 0, "pending": 0, "phases": {}}
    cache.set(
        RECENT_CYCLES_KEY,
        [
            base | {"epoch": 7},  # recorded before these counts existed
            base | {"epoch": 8, "reserved": 31, "preempted": 29, "backfilled": 37},
        ],
    )
    try:
        page = console.get("/admin/scheduler/").content.decode()
    finally:
        cache.delete(RECENT_CYCLES_KEY)
    assert "<th>Backfilled</th><th>Reserved</th><th>Preempted</th>" in page
    assert "<td>5</td><td>37</td><td>31</td><td>29</td>" in page
    assert "<td>5</td><td>0</td><td>0</td><td>0</td>" in page


def test_drain_action_goes_through_the_service(console, world, node):
    response = console.post(
        reverse("admin:clusters_node_changelist"),
        {"action": "drain", "_selected_action": [node.pk]},
        follow=True,
    )
    assert response.status_code == 200
    node.refresh_from_db()
    assert node.state == NodeState.DRAINING  # it still runs the job
    assert node.events.get().actor.username == "ops"


def test_resume_of_a_ready_node_warns(console, node):
    response = console.post(
        reverse("admin:clusters_node_changelist"),
        {"action": "resume", "_selected_action": [node.pk]},
        follow=True,
    )
    assert "only a draining, drained or cordoned node resumes" in response.content.decode()


def test_cancel_action_cancels_and_releases(console, world, node):
    response = console.post(
        reverse("admin:scheduling_job_changelist"),
        {"action": "cancel", "_selected_action": [world.pk]},
        follow=True,
    )
    assert response.status_code == 200
    world.refresh_from_db()
    assert world.state == JobState.CANCELLED
    assert not Allocation.objects.filter(job=world, active=True).exists()


def test_requeue_action_on_a_pending_job_is_refused_politely(console, alice, queue):
    job = make_job(alice, queue)
    response = console.post(
        reverse("admin:scheduling_job_changelist"),
        {"action": "requeue", "_selected_action": [job.pk]},
        follow=True,
    )
    assert response.status_code == 200
    assert "PENDING cannot become PENDING" in response.content.decode()


def test_job_page_shows_history_attempts_and_allocations(console, world):
    page = console.get(reverse("admin:scheduling_job_change", args=[world.pk])).content.decode()
    assert "SCHEDULED" in page and "placed on a-n001[0,1]" in page
    assert "Job attempts" in page and "Allocations" in page


def test_issuing_a_token_in_the_console_shows_it_once(console, alice):
    response = console.post(
        reverse("admin:portal_apitoken_add"),
        {"user": alice.pk, "name": "laptop", "scopes": ["read", "submit"], "expires_in_days": ""},
        follow=True,
    )
    assert "copy it now" in response.content.decode()
    assert alice.api_tokens.get().name == "laptop"


def test_non_staff_cannot_open_the_console(client, alice):
    client.force_login(alice)
    response = client.get(reverse("admin:scheduling_job_changelist"))
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_the_landing_page_shows_fleet_health(console, world):
    page = console.get("/admin/").content.decode()
    assert "Fleet health" in page and "1 ready" in page and "2 allocated" in page


def test_the_scheduler_page_shows_recent_cycles_and_why_jobs_wait(console, alice, queue, node):
    from django.core.cache import cache

    from scheduling.engine.cache import SchedulerCache
    from scheduling.engine.cycle import RECENT_CYCLES_KEY, run_cycle

    cache.delete(RECENT_CYCLES_KEY)
    make_job(alice, queue, gpus=2)
    make_job(alice, queue, gpus=64)  # can never fit a node
    run_cycle(SchedulerCache())
    page = console.get("/admin/scheduler/").content.decode()
    assert "Recent cycles" in page and "Waiting jobs by reason" in page
    assert "<td>1</td>" in page  # one placed in the recorded cycle
    assert "Scheduler" in page and "PENDING" in page


def test_the_scheduler_page_is_for_operators(client, alice):
    client.force_login(alice)
    assert client.get("/admin/scheduler/").status_code == 302


def test_a_node_page_shows_its_heartbeats(console, node):
    from django.utils import timezone

    from clusters.models import NodeLastSeen

    page = console.get(f"/admin/clusters/node/{node.pk}/change/").content.decode()
    assert "none received" in page
    now = timezone.now()
    NodeLastSeen.objects.create(node=node, seen_at=now, good_since=now, boot_id="b" * 32, seq=41)
    assert "sequence 41" in console.get(f"/admin/clusters/node/{node.pk}/change/").content.decode()


# --- the audit log ----------------------------------------------------------------------------

AUDIT = "admin:foundation_auditentry_changelist"


@pytest.fixture
def logged():
    """Three entries by two people, one with a user name a spreadsheet would run as a formula."""
    from django.db import transaction

    from foundation import audit
    from foundation.choices import AuditAction
    from tests.factories import make_user

    mallory = make_user("=HYPERLINK(evil)")
    with transaction.atomic():
        with audit.source("203.0.113.7"):
            audit.record(AuditAction.JOB_CANCEL, actor=mallory, target="job:7")
        with audit.source("198.51.100.2"):
            audit.record(AuditAction.NODE_DRAIN, actor=make_user("carol"), target="node:sim-a/a-n001")
            audit.record(AuditAction.TOKEN_REVOKE, actor=None, target="token:orr_abcdef")


def _export(console, fmt: str, **query) -> tuple[object, str]:
    response = console.get(reverse("admin:foundation_auditentry_export", args=[fmt]), query)
    assert response.status_code == 200, response.status_code
    assert response.streaming  # rows go out as they are read, never all in memory
    return response, b"".join(response.streaming_content).decode()


@pytest.mark.parametrize(
    ("query", "targets"),
    [
        ({"q": "carol"}, ["node:sim-a/a-n001"]),
        ({"q": "job:7"}, ["job:7"]),
        ({"q": "203.0.113"}, ["job:7"]),
        ({"action__exact": "token.revoke"}, ["token:orr_abcdef"]),
        ({"source": "198.51.100.2"}, ["node:sim-a/a-n001", "token:orr_abcdef"]),
        ({"nope": "1"}, None),  # not a field: refused, not ignored
    ],
    ids=["actor", "target", "source", "action-filter", "exact-source", "unknown-filter"],
)
def test_the_audit_log_is_searchable(console, logged, query, targets):
    response = console.get(reverse(AUDIT), query)
    page = response.content.decode()
    if targets is None:
        assert response.status_code == 302 and "e=1" in response["Location"]
        return
    for target in ["job:7", "node:sim-a/a-n001", "token:orr_abcdef"]:
        assert (target in page) == (target in targets), target


def test_the_audit_log_exports_what_the_changelist_shows_as_csv(console, logged):
    import csv

    page = console.get(reverse(AUDIT), {"q": "job"}).content.decode()
    assert reverse("admin:foundation_auditentry_export", args=["csv"]) + "?q=job" in page
    response, text = _export(console, "csv", q="job")
    assert response["Content-Type"].startswith("text/csv") and "attachment" in response["Content-Disposition"]
    rows = list(csv.DictReader(text.splitlines()))
    assert [(r["action"], r["target"], r["source"]) for r in rows] == [("job.cancel", "job:7", "203.0.113.7")]
    assert rows[0]["actor_name"] == "'=HYPERLINK(evil)"  # a formula in a user name stays text


def test_the_audit_log_exports_json_lines_oldest_first(console, logged):
    import json

    _, text = _export(console, "jsonl")
    lines = [json.loads(line) for line in text.splitlines()]
    assert [line["target"] for line in lines] == ["job:7", "node:sim-a/a-n001", "token:orr_abcdef"]
    assert lines[2]["actor_id"] is None and lines[0]["actor_name"] == "=HYPERLINK(evil)"


def test_the_audit_log_is_for_operators_and_read_only(console, alice, logged):
    from django.test import Client

    from foundation.models import AuditEntry

    entry = AuditEntry.objects.first()
    export = reverse("admin:foundation_auditentry_export", args=["csv"])
    client = Client()
    client.force_login(alice)
    for url in (reverse(AUDIT), export):
        response = client.get(url)
        assert response.status_code == 302 and "/admin/login/" in response["Location"]
    alice.is_staff = True  # staff, but not granted the audit log
    alice.save()
    assert client.get(reverse(AUDIT)).status_code == 403
    assert client.get(export).status_code == 403
    assert console.get(reverse("admin:foundation_auditentry_add")).status_code == 403
    assert console.post(reverse("admin:foundation_auditentry_delete", args=[entry.pk])).status_code == 403
    assert (
        console.post(
            reverse("admin:foundation_auditentry_change", args=[entry.pk]), {"target": "x"}
        ).status_code
        == 403
    )
    assert console.get(reverse("admin:foundation_auditentry_export", args=["xml"])).status_code == 404
    assert AuditEntry.objects.get(pk=entry.pk).target == entry.target


def test_an_export_with_an_unknown_filter_is_refused(console, logged):
    response = console.get(reverse("admin:foundation_auditentry_export", args=["csv"]), {"nope": "1"})
    assert response.status_code == 400


@pytest.mark.parametrize(
    "model", ["scheduling_job", "scheduling_jobevent", "scheduling_jobattempt"], ids=lambda m: m
)
def test_job_history_cannot_be_deleted_from_the_console(console, world, model):
    obj = {
        "scheduling_job": world,
        "scheduling_jobevent": world.events.first(),
        "scheduling_jobattempt": world.attempts.first(),
    }[model]
    listing = console.get(reverse(f"admin:{model}_changelist")).content.decode()
    assert "delete_selected" not in listing
    assert console.post(reverse(f"admin:{model}_delete", args=[obj.pk]), {"post": "yes"}).status_code == 403
    assert type(obj).objects.filter(pk=obj.pk).exists()
