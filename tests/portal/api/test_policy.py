"""What a member may ask of a shared queue, and what only operators may do: the highest
priority a member may set, a queue's longest time limit, holds only operators release, caps on
one user's waiting jobs, permissions (not the staff flag) for onboarding and account mapping, an
onboarding form that cannot scan the network, and secret environment values no one else reads."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator

import pytest
from django.contrib.auth.models import Permission

from portal.choices import Role
from portal.models import Membership
from scheduling.choices import JobState, PendingReason
from scheduling.dispatch.works import load_works
from scheduling.models import Job
from scheduling.services.jobs import hold_job
from tests.factories import make_cluster, make_job, make_user
from tests.portal.api.conftest import error_paths, job_spec

pytestmark = pytest.mark.usefixtures("fleet")

JOBS = "/api/v1/jobs"


def submit(client, document, **query):
    suffix = "?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else ""
    return client.post(JOBS + suffix, json.dumps(document), content_type="application/json")


# --- priority and time limits -------------------------------------------------------------------


@pytest.fixture
def manager(vision):
    user = make_user("mgr")
    Membership.objects.create(user=user, project=vision, role=Role.MANAGER)
    return user


@pytest.mark.parametrize("priority, code", [(100, 201), ("high", 201), (101, 400), (1000, 400)])
def test_a_member_cannot_jump_ahead_past_the_queues_limit(api, alice, queue, priority, code):
    response = submit(api(alice), job_spec(spec__priority=priority))
    assert response.status_code == code, response.content
    if code == 400:
        assert error_paths(response) == ["spec.priority"]
        assert "at most 100" in response.json()["errors"][0]["message"]


def test_managers_and_operators_may_set_a_higher_priority(api, manager, operator, queue):
    for user in (manager, operator):
        response = submit(api(user), job_spec(spec__priority=1000))
        assert response.status_code == 201, response.content
        assert response.json()["priority"] == 1000


def test_the_queue_sets_the_members_limit(api, alice, queue):
    queue.max_member_priority = -10
    queue.save()
    assert error_paths(submit(api(alice), job_spec(spec__priority=0))) == ["spec.priority"]
    assert submit(api(alice), job_spec(spec__priority="low")).status_code == 201


def test_a_batch_names_the_spec_past_the_limit(api, alice, queue):
    documents = [job_spec(), job_spec(spec__priority=500)]
    response = api(alice).post("/api/v1/jobs/batch", {"jobs": documents}, format="json")
    assert response.status_code == 400 and error_paths(response) == ["jobs[1].spec.priority"]
    assert not Job.objects.exists()


def test_time_limits_stay_within_the_queues_longest(api, alice, queue):
    queue.max_time_limit_s = 3600
    queue.save()
    response = submit(api(alice), job_spec(spec__timeLimit="2h"))
    assert response.status_code == 400 and error_paths(response) == ["spec.timeLimit"]
    spec = job_spec()
    del spec["spec"]["timeLimit"]
    created = submit(api(alice), spec)  # none given: the queue's longest applies
    assert created.status_code == 201, created.content
    assert created.json()["timeLimitSeconds"] == 3600


def test_a_job_bigger_than_one_user_may_hold_is_refused_not_left_waiting(api, alice, queue):
    queue.max_gpus_per_user = 2
    queue.save()
    response = submit(api(alice), job_spec(spec__resources={"gpus": "h100:4"}))
    assert response.status_code == 400 and error_paths(response) == ["spec.resources.gpus"]
    assert "at most 2 GPUs" in response.json()["errors"][0]["message"]
    assert submit(api(alice), job_spec(spec__resources={"gpus": "h100:2"})).status_code == 201


# --- holds --------------------------------------------------------------------------------------


def test_an_owner_releases_their_own_hold(api, alice, alice_job):
    client = api(alice)
    assert client.post(f"{JOBS}/{alice_job.pk}/hold").json()["reason"] == "Held"
    assert client.post(f"{JOBS}/{alice_job.pk}/release").json()["state"] == "PENDING"


def test_an_operators_hold_is_released_by_operators_only(api, alice, manager, operator, alice_job):
    held = api(operator).post(f"{JOBS}/{alice_job.pk}/hold")
    assert held.json()["reason"] == PendingReason.HELD_BY_OPERATOR
    for user in (alice, manager):
        refused = api(user).post(f"{JOBS}/{alice_job.pk}/release")
        assert refused.status_code == 403, refused.content
        assert "only an operator" in refused.json()["detail"]
    assert Job.objects.get(pk=alice_job.pk).state == JobState.HELD
    assert api(operator).post(f"{JOBS}/{alice_job.pk}/release").json()["state"] == "PENDING"


def test_a_failover_hold_is_released_by_operators_only(api, alice, operator, queue):
    job = make_job(alice, queue, state=JobState.HELD, reason=PendingReason.NODE_LOST)
    assert api(alice).post(f"{JOBS}/{job.pk}/release").status_code == 403
    assert Job.objects.get(pk=job.pk).state == JobState.HELD
    assert api(operator).post(f"{JOBS}/{job.pk}/release").status_code == 200


def test_the_job_page_offers_no_release_an_owner_cannot_do(client, alice, operator, alice_job):
    hold_job(alice_job, actor=operator)
    client.force_login(alice)
    page = client.get(f"/jobs/{alice_job.pk}/").content.decode()
    assert 'data-action="release"' not in page


# --- waiting-job caps per user ------------------------------------------------------------------


def test_one_members_backlog_cannot_lock_out_the_project(api, alice, manager, queue):
    queue.max_pending_jobs = 10
    queue.max_pending_jobs_per_user = 4
    queue.save()
    batch = {"jobs": [job_spec(spec__resources__gpus="h100:1")], **{}}
    batch["jobs"][0]["spec"]["array"] = "0-3"
    assert api(alice).post("/api/v1/jobs/batch", batch, format="json").status_code == 201
    refused = submit(api(alice), job_spec())
    assert refused.status_code == 429 and "you have 4 waiting jobs" in refused.json()["detail"]
    assert submit(api(manager), job_spec()).status_code == 201


def test_the_site_caps_each_users_waiting_jobs_in_a_project(api, alice, manager, queue, settings):
    settings.ORRERY_MAX_WAITING_JOBS_PER_USER = 2
    client = api(alice)
    assert [submit(client, job_spec()).status_code for _ in range(3)] == [201, 201, 429]
    assert submit(api(manager), job_spec()).status_code == 201


# --- permissions, not the staff flag --------------------------------------------------------------


def _staff(*perms: str):
    user = make_user(f"staff{len(perms)}")
    user.is_staff = True
    user.save()
    for codename in perms:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    return user


def test_the_staff_flag_alone_does_not_onboard_or_map(api, alice):
    staff = api(_staff())
    body = {"name": "hpc", "kind": "slurm", "url": "http://127.0.0.1:9", "token": "x"}
    assert staff.post("/api/v1/clusters", body, format="json").status_code == 403
    make_cluster("hpc-a", kind="slurm")
    mapped = staff.put("/api/v1/clusters/hpc-a/accounts/alice", {"username": "alice"}, format="json")
    assert mapped.status_code == 403
    allowed = api(_staff("onboard_cluster", "change_posixaccount"))
    assert allowed.post("/api/v1/clusters", body, format="json").status_code == 400  # past the check
    mapped = allowed.put("/api/v1/clusters/hpc-a/accounts/alice", {"username": "alice"}, format="json")
    assert mapped.status_code == 201


def test_the_console_offers_onboarding_only_with_the_permission(client):
    client.force_login(_staff("view_cluster", "add_cluster"))
    assert client.get("/admin/clusters/cluster/onboard-slurm/").status_code == 302
    client.force_login(_staff("view_cluster", "add_cluster", "onboard_cluster"))
    assert client.get("/admin/clusters/cluster/onboard-slurm/").status_code == 200


class _Internal(http.server.BaseHTTPRequestHandler):
    """An internal service that is not slurmrestd (a metadata endpoint, an admin page)."""

    status = 200

    def do_GET(self) -> None:
        body = b"internal-admin-panel secret=hunter2"
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _Refusing(_Internal):
    status = 401


class _Redirecting(_Internal):
    def do_GET(self) -> None:
        self.send_response(302)
        self.send_header("Location", "http://127.0.0.1:9/")
        self.end_headers()


@pytest.fixture
def internal_services() -> Iterator[list[str]]:
    servers = [http.server.HTTPServer(("127.0.0.1", 0), h) for h in (_Internal, _Refusing, _Redirecting)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers] + [f"http://127.0.0.1:{port}"]
    for server in servers:
        server.shutdown()
        server.server_close()


def test_onboarding_errors_do_not_tell_open_ports_from_closed_ones(api, operator, internal_services):
    client = api(operator)
    answers = []
    for url in internal_services:
        body = {"name": "probe", "kind": "slurm", "url": url, "token": "x"}
        response = client.post("/api/v1/clusters", body, format="json")
        assert response.status_code == 400, response.content
        answers.append(response.json()["errors"])
        assert "hunter2" not in response.content.decode()
    assert all(a == answers[0] for a in answers), answers
    assert answers[0][0]["path"] == "url"


# --- secret environment ---------------------------------------------------------------------------


def test_secret_values_reach_only_the_running_job(api, alice, operator, vision, queue, client):
    bob = make_user("bobby")
    Membership.objects.create(user=bob, project=vision, role=Role.MANAGER)
    document = job_spec(
        spec__env={"PLAIN": "p", "WANDB_KEY": {"value": "s3cr3t-one", "secret": True}},
        spec__secretEnv={"HF_TOKEN": "s3cr3t-two"},
    )
    created = submit(api(alice), document)
    assert created.status_code == 201, created.content
    job = Job.objects.get(pk=created.json()["id"])
    for user in (alice, bob, operator):
        shown = api(user).get(f"{JOBS}/{job.pk}").content.decode()
        assert "s3cr3t" not in shown and "HF_TOKEN" in shown and "WANDB_KEY" in shown
    client.force_login(operator)
    for page in (f"/admin/scheduling/job/{job.pk}/change/", f"/jobs/{job.pk}/"):
        assert "s3cr3t" not in client.get(page).content.decode()
    row = Job.objects.filter(pk=job.pk).values().get()
    assert "s3cr3t" not in json.dumps(row, default=str)  # sealed at rest
    job.attempts.create(number=1, cluster=make_cluster("sim-b"))
    (work,) = load_works(job.attempts.all())
    assert work.env == {"PLAIN": "p", "WANDB_KEY": "s3cr3t-one", "HF_TOKEN": "s3cr3t-two"}


def test_a_retry_with_the_same_key_and_secret_is_the_same_job(api, alice, queue):
    client = api(alice)
    document = job_spec(spec__secretEnv={"K": "v1"})
    first = client.post(JOBS, document, format="json", HTTP_IDEMPOTENCY_KEY="k1")
    again = client.post(JOBS, document, format="json", HTTP_IDEMPOTENCY_KEY="k1")
    assert (first.status_code, again.status_code) == (201, 200)
    other = client.post(JOBS, job_spec(spec__secretEnv={"K": "v2"}), format="json", HTTP_IDEMPOTENCY_KEY="k1")
    assert other.status_code == 422


@pytest.mark.parametrize(
    "env, secret, path",
    [
        ({"A": {"value": "x", "secret": "yes"}}, None, "spec.env.A.secret"),
        ({"A": {"secret": True}}, None, "spec.env.A.value"),
        ({"A": {"value": "x", "secret": True, "other": 1}}, None, "spec.env.A.other"),
        ({"A": "x"}, {"A": "y"}, "spec.secretEnv.A"),
        (None, {"1BAD": "y"}, "spec.secretEnv.1BAD"),
        (None, ["A"], "spec.secretEnv"),
    ],
)
def test_bad_secret_environments_name_the_field(api, alice, queue, env, secret, path):
    document = job_spec()
    if env is not None:
        document["spec"]["env"] = env
    if secret is not None:
        document["spec"]["secretEnv"] = secret
    response = submit(api(alice), document)
    assert response.status_code == 400 and path in error_paths(response), response.content


def test_secret_values_reach_the_agent_and_stay_sealed_in_the_cache(api, alice, queue, fleet):
    from django.core.cache import cache

    from scheduling.dispatch.agent import desired_for_node
    from scheduling.dispatch.desired import desired_key
    from scheduling.services.allocations import NodePlacement, bind_job

    document = job_spec(spec__resources__gpus="h100:1", spec__secretEnv={"HF_TOKEN": "s3cr3t-agent"})
    created = submit(api(alice), document)
    assert created.status_code == 201, created.content
    node = fleet.h100[0]
    bind_job(Job.objects.get(pk=created.json()["id"]), [NodePlacement(node, [0])])
    cache.delete(desired_key(node.pk))
    (entry,) = desired_for_node(node.pk)
    assert entry["env"]["HF_TOKEN"] == "s3cr3t-agent" and "sealed_env" not in entry  # the agent gets it
    assert "s3cr3t" not in json.dumps(cache.get(desired_key(node.pk)))  # Redis holds it sealed
    (again,) = desired_for_node(node.pk)  # from the cache: the same answer
    assert again["env"]["HF_TOKEN"] == "s3cr3t-agent"
