"""The portal's pages: who sees what, filters, bulk cancel, the heatmap's data."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.cache import cache
from django.utils import timezone

from scheduling.choices import JobState
from scheduling.models import Job
from scheduling.services.allocations import NodePlacement, bind_job
from tests.factories import make_cluster, make_job, make_node, make_project, make_queue

pytestmark = pytest.mark.django_db


@pytest.fixture
def signed_in(client, alice):
    client.force_login(alice)
    return client


def test_pages_need_a_session(client):
    for path in (
        "/",
        "/submit/",
        "/jobs/",
        "/jobs/1/",
        "/clusters/",
        "/fleet/",
        "/queues/",
        "/fleet/nodes.json",
    ):
        answer = client.get(path)
        assert answer.status_code == 302 and answer["Location"].startswith("/accounts/login/"), path


def test_login_page_signs_in(client, alice):
    assert "Sign in" in client.get("/accounts/login/").content.decode()
    answer = client.post("/accounts/login/", {"username": "alice", "password": "alice", "next": "/jobs/"})
    assert answer.status_code == 302 and answer["Location"] == "/jobs/"
    assert client.get("/jobs/").status_code == 200


def test_another_projects_job_page_is_a_404(client, alice, bob, queue):
    job = make_job(alice, queue, name="secret-run")
    client.force_login(bob)
    assert client.get(f"/jobs/{job.pk}/").status_code == 404
    assert "secret-run" not in client.get("/jobs/").content.decode()
    client.force_login(alice)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "secret-run" in page and 'data-action="cancel"' in page


def test_the_job_page_says_why_it_waits_and_offers_what_the_state_allows(signed_in, alice, queue):
    job = make_job(alice, queue, reason_message="Waiting for 8 free h100-80g on one node.")
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert "Waiting for 8 free h100-80g on one node." in page
    assert 'data-action="hold"' in page and 'data-action="release"' not in page


def test_jobs_table_filters_searches_sorts_and_pages(signed_in, alice, queue):
    for i in range(60):
        make_job(alice, queue, name=f"sweep-{i}", state=JobState.PENDING if i % 2 else JobState.RUNNING)
    page = signed_in.get("/jobs/?state=RUNNING&sort=name").content.decode()
    assert page.count('data-job="') == 30 and "sweep-0<" in page and "sweep-1<" not in page
    assert "page 1 of 2" in signed_in.get("/jobs/").content.decode()
    assert signed_in.get("/jobs/?q=sweep-42").content.decode().count('data-job="') == 1


def test_bulk_cancel_cancels_only_what_the_user_may(client, alice, bob, queue):
    mine = make_job(alice, queue)
    other = make_job(bob, make_queue(make_project("nlp", members=(bob,))))
    client.force_login(alice)
    answer = client.post("/jobs/cancel/", {"job": [mine.pk, other.pk], "next": "/jobs/"}, follow=True)
    assert "Cancelled 1 job(s)." in answer.content.decode()
    assert Job.objects.get(pk=mine.pk).state == JobState.CANCELLED
    assert Job.objects.get(pk=other.pk).state == JobState.PENDING


@pytest.mark.parametrize(
    ("next_url", "lands_on"),
    [
        pytest.param("/jobs/?state=RUNNING", "/jobs/?state=RUNNING", id="path-on-this-site"),
        pytest.param("http://testserver/queues/", "http://testserver/queues/", id="this-host"),
        pytest.param("https://evil.example/", "/jobs/", id="other-host"),
        pytest.param("//evil.example/", "/jobs/", id="scheme-relative"),
        pytest.param("/\\evil.example/", "/jobs/", id="backslash"),
        pytest.param("https:evil.example", "/jobs/", id="scheme-without-slashes"),
        pytest.param("javascript:alert(1)", "/jobs/", id="javascript"),
        pytest.param("", "/jobs/", id="empty"),
    ],
)
def test_bulk_cancel_redirects_only_within_the_site(signed_in, next_url, lands_on):
    answer = signed_in.post("/jobs/cancel/", {"job": [], "next": next_url})
    assert answer.status_code == 302 and answer["Location"] == lands_on


def test_heatmap_data_has_every_node_in_columns(signed_in, node):
    data = signed_in.get("/fleet/nodes.json").json()
    assert data["name"] == ["a-n001"] and data["state"] == ["ready"] and data["gpus"] == [8]
    assert data["held"] == [0] and set(data) == {"id", "name", "cluster", "state", "gpus", "held", "util"}
    assert signed_in.get("/fleet/nodes.json?cluster=nope").json()["id"] == []
    assert set(signed_in.get("/fleet/series.json").json()) == {"t", "allocated", "utilisation", "power_kw"}


def test_odd_input_is_never_a_500(signed_in, alice, queue):
    held = make_job(alice, queue, state=JobState.HELD)
    assert signed_in.get("/jobs/?q=²").status_code == 200
    assert signed_in.get("/jobs/?q=99999999999999999999999").status_code == 200
    assert signed_in.get("/fleet/series.json?hours=abc").status_code == 200
    answer = signed_in.post("/jobs/cancel/", {"job": ["²", "1" + "0" * 30, str(held.pk)]}, follow=True)
    assert answer.status_code == 200 and "Cancelled 1 job(s)." in answer.content.decode()
    page = signed_in.get(f"/jobs/{make_job(alice, queue, state=JobState.HELD).pk}/").content.decode()
    assert 'data-action="release"' in page and 'data-action="requeue"' not in page  # held: not requeuable


def test_paging_links_keep_a_search_with_odd_characters(signed_in, alice, queue):
    for i in range(60):
        make_job(alice, queue, name=f"a&b-{i}")
    page = signed_in.get("/jobs/?q=a%26b").content.decode()
    assert "q=a%26b" in page


def test_cluster_cards_count_running_and_the_jobs_waiting_for_them(signed_in, alice, queue, node):
    make_job(alice, queue, placement={"clusters": ["sim-a"], "nodeSelector": {}})
    make_job(alice, queue, placement={"clusters": ["elsewhere"], "nodeSelector": {}})
    make_job(alice, queue, placement={"clusters": [], "nodeSelector": {}})
    page = signed_in.get("/clusters/").content.decode()
    assert "<strong>1</strong> waiting for it" in page and "3 job(s) waiting across the fleet" in page


# --- predicted starts and preemption -------------------------------------------------------------


def _estimated(alice, queue, at, **fields):
    return make_job(alice, queue, estimated_start_at=at, estimated_where="sim-b: node-3, node-4", **fields)


def test_the_job_page_says_when_and_where_a_waiting_job_would_start(signed_in, alice, queue):
    at = timezone.now().replace(second=0, microsecond=0)
    reserved = _estimated(alice, queue, at, reserved=True)
    page = signed_in.get(f"/jobs/{reserved.pk}/").content.decode()
    assert f"Would start ≈ {at:%H:%M} UTC on sim-b: node-3, node-4 — reserved" in page
    later = at + timedelta(days=3)
    estimate = _estimated(alice, queue, later)
    page = signed_in.get(f"/jobs/{estimate.pk}/").content.decode()
    assert (
        f"Would start ≈ {later:%b} {later.day}, {later:%H:%M} UTC on sim-b: node-3, node-4 — an estimate, "
        "not a reservation"
    ) in page


def test_a_job_without_an_estimate_or_no_longer_waiting_shows_none(signed_in, alice, queue):
    waiting = make_job(alice, queue)
    assert 'id="job-estimate" hidden' in signed_in.get(f"/jobs/{waiting.pk}/").content.decode()
    running = _estimated(alice, queue, timezone.now(), state=JobState.RUNNING)
    page = signed_in.get(f"/jobs/{running.pk}/").content.decode()
    assert 'id="job-estimate" hidden' in page and "Would start" not in page


def test_the_job_page_says_who_preempted_a_job(signed_in, alice, queue):
    draining = make_job(
        alice,
        queue,
        state=JobState.PREEMPTED,
        reason="Preempted",
        reason_message="preempted by job 42 (priority)",
    )
    page = signed_in.get(f"/jobs/{draining.pk}/").content.decode()
    assert 'class="why" id="job-why" >preempted by job 42 (priority)' in page
    requeued = make_job(alice, queue, reason="Preempted", reason_message="preempted by job 42; requeued")
    assert "preempted by job 42; requeued" in signed_in.get(f"/jobs/{requeued.pk}/").content.decode()


def test_the_job_page_shows_an_any_model_request_and_preemptibility(signed_in, alice, queue):
    job = make_job(alice, queue, gpus=2, preemptible=False, placement={"gpuModels": ["h100-80g", "a100-80g"]})
    Job.objects.filter(pk=job.pk).update(gpu_model=None)
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert "1 node(s) × 2 any of h100-80g, a100-80g" in page
    assert "no — never preempted" in page
    Job.objects.filter(pk=job.pk).update(placement={"gpuModels": []})
    assert "× 2 any model" in signed_in.get(f"/jobs/{job.pk}/").content.decode()


def test_the_submit_form_offers_gpus_of_any_model(signed_in):
    assert '<option value="">any model</option>' in signed_in.get("/submit/").content.decode()


def test_the_jobs_list_shows_reasons_and_predicted_starts_and_sorts_by_them(signed_in, alice, queue):
    now = timezone.now().replace(second=0, microsecond=0)
    late = _estimated(alice, queue, now + timedelta(hours=2), name="late-one")
    soon = _estimated(alice, queue, now, reserved=True, name="soon-one", reason="Resources")
    none = make_job(alice, queue, name="no-estimate", reason="Preempted", reason_message="preempted by job 9")
    page = signed_in.get("/jobs/").content.decode()
    assert f"Would start ≈ {now:%H:%M} UTC on sim-b: node-3, node-4 — reserved" in page
    assert 'title="preempted by job 9">Preempted</td>' in page
    by_start = signed_in.get("/jobs/?sort=start").content.decode()
    order = [by_start.index(f'data-job="{j.pk}"') for j in (soon, late, none)]
    assert order == sorted(order)  # soonest first, no estimate last
    by_start_desc = signed_in.get("/jobs/?sort=-start").content.decode()
    order = [by_start_desc.index(f'data-job="{j.pk}"') for j in (late, soon, none)]
    assert order == sorted(order)


@pytest.mark.parametrize(
    "path, queries",
    [
        ("/", 12),
        ("/submit/", 7),
        ("/jobs/", 6),
        ("/jobs/{job}/", 7),
        ("/clusters/", 9),
        ("/clusters/sim-a/", 7),
        ("/fleet/", 2),
        ("/fleet/nodes.json", 5),
        ("/fleet/nodes.json?cluster=sim-a", 5),
        ("/fleet/series.json", 3),
        ("/queues/", 6),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_pages_read_in_a_fixed_number_of_queries(
    signed_in, alice, queue, path, queries, django_assert_num_queries
):
    """Query-count baselines: a page costs the same whatever the number of jobs and nodes
    (session and user lookups included)."""
    cluster = make_cluster("sim-a")
    nodes = [make_node(cluster, gpus=8, name=f"a-{i}") for i in range(3)]
    job = make_job(alice, queue, gpus=2, nodes=2)
    bind_job(job, [NodePlacement(nodes[0], [0, 1]), NodePlacement(nodes[1], [2, 3])])
    for _ in range(3):
        make_job(alice, queue)
    url = path.format(job=job.pk)
    assert signed_in.get(url).status_code == 200
    cache.clear()  # the GPU capacity and token caches start cold in every measurement
    with django_assert_num_queries(queries):
        assert signed_in.get(url).status_code == 200


# --- units, output notes, the list's columns, arrays ------------------------------------------------


def test_the_job_page_gives_quantities_their_units(signed_in, alice, queue, node):
    job = make_job(alice, queue, gpus=1, time_limit_s=93600, memory_bytes_per_node=64 * 2**30)
    bind_job(job, [NodePlacement(node, [0])])
    node.gpus.filter(index=0).update(memory_used_mb=40 * 1024, power_w=312.4, utilization=90)
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert "<dt>Time limit</dt><dd>1d 2h</dd>" in page and "93600" not in page
    assert "64 GiB memory" in page
    assert "<td>40 GiB</td><td>312 W</td>" in page


def _placed(alice, queue, node, state, **fields):
    job = make_job(alice, queue, gpus=1)
    bind_job(job, [NodePlacement(node, [0])])
    Job.objects.filter(pk=job.pk).update(state=state, **fields)
    return job


@pytest.mark.parametrize(
    ("kind", "state", "started", "note"),
    [
        ("simulated", JobState.SUCCEEDED, True, "No output is kept for simulated jobs: sim-a is a simulated"),
        ("simulated", JobState.RUNNING, True, "No output is kept for simulated jobs"),
        ("native", JobState.SUCCEEDED, True, "The job ended without writing any output."),
        ("native", JobState.RUNNING, True, "No output yet."),
        ("native", JobState.SCHEDULED, False, "No output yet: the job has not started."),
        (None, JobState.PENDING, False, "No output yet: the job has not started."),
        (None, JobState.CANCELLED, False, "The job ended before it started: there is no output."),
    ],
    ids=["sim-ended", "sim-running", "ended", "running", "placed", "pending", "cancelled-unplaced"],
)
def test_the_output_box_says_why_it_is_empty(signed_in, alice, queue, kind, state, started, note):
    now = timezone.now()
    times = {"started_at": now if started else None}
    if kind is None:
        job = make_job(alice, queue, state=state)
    else:
        node = make_node(make_cluster("sim-a", kind=kind), name="n1")
        job = _placed(alice, queue, node, state, **times)
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert f'id="log">{note}' in page
    assert "the job has not run" not in page


def test_the_jobs_list_shows_cluster_reason_and_a_ticking_time_used(signed_in, alice, queue, node):
    started = timezone.now() - timedelta(hours=2, minutes=30)
    running = _placed(alice, queue, node, JobState.RUNNING, started_at=started)
    fresh = make_job(alice, queue)  # not yet looked at: reason None
    waits = make_job(alice, queue, reason="Resources", reason_message="8 GPUs on one node: none free")
    page = signed_in.get("/jobs/").content.decode()
    row = _row(page, running.pk)
    assert '<td data-cell="cluster">sim-a</td>' in row and "2:30:0" in row
    assert f'data-started="{int(started.timestamp())}"' in row
    assert '<td data-cell="reason" class="reason">—</td>' in _row(page, fresh.pk)
    assert "None" not in _row(page, fresh.pk)
    assert 'title="8 GPUs on one node: none free">Resources</td>' in _row(page, waits.pk)
    dashboard = signed_in.get("/").content.decode()
    assert '<td data-cell="cluster">sim-a</td>' in _row(dashboard, running.pk)
    assert "Resources</td>" in _row(dashboard, waits.pk)


def _row(page: str, job_id: int) -> str:
    start = page.index(f'<tr data-job="{job_id}"')
    return page[start : page.index("</tr>", start)]


def _array(alice, queue, states):
    members = [make_job(alice, queue, name="sweep", state=s) for s in states]
    first = members[0].pk
    for index, job in enumerate(members):
        Job.objects.filter(pk=job.pk).update(array_id=first, array_index=index)
    return first, members


def test_an_array_is_one_row_with_its_members_by_state_and_opens_to_its_tasks(signed_in, alice, queue):
    array, members = _array(alice, queue, [JobState.RUNNING] * 2 + [JobState.PENDING] * 3)
    plain = make_job(alice, queue, name="plain")
    page = signed_in.get("/jobs/").content.decode()
    assert page.count(f'data-array="{array}"') == 1 and f'data-job="{plain.pk}"' in page
    assert f'href="?array={array}"' in page and f"{array}_[0-4]" in page and "5 tasks" in page
    assert "2 RUNNING</span>" in page and "3 PENDING</span>" in page
    assert not any(f'data-job="{m.pk}"' in page for m in members)

    tasks = signed_in.get(f"/jobs/?array={array}").content.decode()
    assert [f">{array}_{i}</a>" in tasks for i in range(5)] == [True] * 5
    assert f'data-job="{plain.pk}"' not in tasks and "data-array" not in tasks

    found = signed_in.get(f"/jobs/?q={array}_3").content.decode()
    assert f'data-job="{members[3].pk}"' in found and found.count("data-job=") == 1
    # a filter applies to the members: the array shows while one of them matches
    assert f'data-array="{array}"' in signed_in.get("/jobs/?state=PENDING").content.decode()
    assert f"{array}_3" in signed_in.get(f"/jobs/{members[3].pk}/").content.decode()
